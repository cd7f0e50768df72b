"""The decoding chapter: turning a source into translations with any model that has `encode`/`decode`, and
scoring given translations.

`search(model, src_ids, cfg, sampling)` is the entry: n-best hypotheses per sentence, by greedy search, sampling
or batched beam search, one loop each. Models that offer `start_cache` (like `Seq2SeqTransformer`) decode
incrementally: one new token per step, encoder keys/values computed once per sentence (shared by its beams), and
rows of finished sentences dropped from the cache so work shrinks as sentences end.

In reading order: the searches; the stepping interface every search runs on (`start_decoder`); sampling's
choice of the next token; ensembles of models decoded as one; and forced decoding (`score`), the log-probability
a model gives a given translation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from nmt.batching import eval_batches, special_id
from nmt.batching import pad as pad_rows
from nmt.config import check_fields, ranged
from nmt.constraints import Terms, going_first
from nmt.errors import NmtError

# --- Search: greedy, sampling and beam -------------------------------------------------------------------------------


@dataclass
class SearchConfig:
    """How translations are searched for."""

    beam_size: int = ranged(4, "[1, 1000]")  # hypotheses kept per sentence (1: greedy)
    nbest: int = ranged(1, "[1, 1000]")  # hypotheses returned per sentence (at most beam_size)
    alpha: float = ranged(0.6, "[0, 10]")  # GNMT length penalty ((5 + len) / 6) ** alpha; 0: raw log-probability
    max_len_a: float = ranged(10, "[0, 1e6]")  # a generated sentence has at most a + b * source length tokens ...
    max_len_b: float = ranged(2.0, "[0, 1e6]")  # ... (including the final </s>)
    max_new_tokens: int = ranged(256, "[1, 1e6]")  # and never more than this
    # no n-gram of this many tokens twice in a translation (as transformers' no_repeat_ngram_size); 0: any may repeat
    no_repeat_ngram_size: int = ranged(0, "[0, 1000]")
    # the token every translation starts with, forced (an imported M2M100/NLLB's target language); None: the
    # model's own forced_bos_id (config.json), or none
    first_token: int | None = ranged(None, "[0, 1e9]")

    def __post_init__(self) -> None:
        check_fields(self, noun="search setting")
        if self.nbest > self.beam_size:
            raise NmtError(f"search setting 'nbest': {self.nbest} hypotheses need beam_size >= {self.nbest} "
                           f"(it is {self.beam_size})")


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, ending in </s> unless the length limit cut it
    score: float  # log-probability divided by the length penalty
    logprob: float = 0.0  # total log-probability; a </s> forced at the length limit counts 0, as in transformers
    finished: bool = True  # ended in </s>


def length_limits(src_ids: torch.Tensor, pad_id: int, cfg: SearchConfig, most: int | None = None) -> torch.Tensor:
    """(B,) most tokens to generate per sentence: min(a + b * source length, max_new_tokens, `most`)."""
    src_len = src_ids.ne(pad_id).sum(1).float()
    return (cfg.max_len_a + cfg.max_len_b * src_len).long().clamp(1, min(cfg.max_new_tokens, most or cfg.max_new_tokens))


def _most(model) -> int | None:
    """The most tokens the model's decoder can take after the start token (its position table's length)."""
    cfg = getattr(model, "cfg", None)
    return cfg.max_positions - 1 if cfg is not None and hasattr(cfg, "max_positions") else None


class Cancelled(Exception):
    """A search's `cancelled()` turned True: nobody waits for its result (a server's clients all gave up)."""


@torch.no_grad()
def search(model, src_ids: torch.Tensor, cfg: SearchConfig, sampling: SamplingConfig | None = None,
           terms: list[list[list[int]]] | None = None, joins: torch.Tensor | None = None,
           cancelled=None) -> list[list[Hypothesis]]:
    """src_ids (B, S) -> cfg.nbest hypotheses per sentence, best first: drawn by `sampling` when given
    (cfg.nbest independent samples each), else found by beam search (greedy at beam size 1). `terms`: per
    sentence, the target terms (token ids) its translation must hold, `joins` (V,) the tokens that continue a word
    (`nmt.constraints.Terms`; beam search only). `cancelled` (a function), asked before every step: once it
    returns True the search stops and raises `Cancelled`."""
    if terms is not None and sampling is not None:
        raise NmtError("a glossary needs beam search: leave sampling off (--sampling) to use one")
    if sampling is None:
        return beam_search(model, src_ids, cfg, terms, joins, cancelled)
    n = cfg.nbest
    drawn = greedy(model, src_ids.repeat_interleave(n, 0) if n > 1 else src_ids, cfg, sampling, cancelled)
    return [sorted(drawn[i * n: (i + 1) * n], key=lambda h: -h.score) for i in range(src_ids.shape[0])]


# Every search reads the device once per step (which rows go on: a list of booleans), and nothing else until it
# ends: on a GPU each read waits for the device, and a step of a small model is a few launches.


@torch.no_grad()
def greedy(model, src_ids: torch.Tensor, cfg: SearchConfig | None = None,
           sampling: SamplingConfig | None = None, cancelled=None) -> list[Hypothesis]:
    """Best-first decoding (or, with `sampling`, each token drawn), one hypothesis per sentence; finished
    rows leave the batch. A hypothesis' logprob is the model's own (before sampling's temperature).
    `cancelled`: as for `search`."""
    cfg = cfg or SearchConfig(beam_size=1)
    pad, bos, eos = special_id(model, "pad_id"), special_id(model, "bos_id"), special_id(model, "eos_id")
    B, dev = src_ids.shape[0], src_ids.device
    limits = length_limits(src_ids, pad, cfg, _most(model))
    steps, never, forced = int(limits.max()), _never(pad, bos, eos, dev), _forced(model, cfg)
    dec = start_decoder(model, src_ids)
    generator = sampling.generator(dev) if sampling is not None else None
    alive = torch.arange(B, device=dev)  # sentence of each row
    last = torch.full((B,), bos, dtype=torch.long, device=dev)
    tokens = torch.full((B, steps), pad, dtype=torch.long, device=dev)  # <pad> is never emitted: it marks the end
    logprob = torch.zeros(B, dtype=torch.float64, device=dev)  # summed in float64 like Python floats
    for t in range(steps):
        _check(cancelled)
        lp = _constrain(dec.step(last), limits.index_select(0, alive) <= t + 1, never, eos, forced if t == 0 else None)
        if cfg.no_repeat_ngram_size:
            _ban_repeats(lp, tokens[:, :t].index_select(0, alive), cfg.no_repeat_ngram_size)
        if sampling is None:
            best, last = lp.max(-1)
        else:
            last = choose(lp, sampling, generator)
            best = lp.gather(1, last[:, None]).squeeze(1)
        tokens[alive, t] = last
        logprob.index_add_(0, alive, best.double())
        going = last.ne(eos).tolist()  # the step's one read of the device
        if all(going):
            continue
        if not any(going):
            break
        rows = torch.tensor([i for i, g in enumerate(going) if g], dtype=torch.long, device=dev)
        alive, last = alive[rows], last[rows]
        dec.reorder(rows, rows)
    lengths, out, lps = tokens.ne(pad).sum(1).tolist(), tokens.tolist(), logprob.tolist()
    return [Hypothesis(toks[:n], lp / _penalty(n, cfg.alpha), lp, toks[n - 1: n] == [eos])
            for toks, n, lp in zip(out, lengths, lps)]


def _check(cancelled) -> None:
    if cancelled is not None and cancelled():
        raise Cancelled("the search was cancelled: nobody waits for its result")


def _penalty(length, alpha: float):
    return ((5 + length) / 6) ** alpha


@torch.no_grad()
def beam_search(model, src_ids: torch.Tensor, cfg: SearchConfig, terms: list[list[list[int]]] | None = None,
                joins: torch.Tensor | None = None, cancelled=None) -> list[list[Hypothesis]]:
    """Batched beam search; returns the cfg.nbest best hypotheses per sentence, best first.

    A sentence is done once it has beam_size finished hypotheses (or hits its length limit); its
    rows then leave the batch and the cache. The first step runs one row per sentence (all beams
    would be identical); the K beams branch from it. Finished hypotheses are kept on the device
    (`Finished`) and read once, at the end.

    `terms` (per sentence, target terms as token ids; None or all empty: the plain search) constrains the
    search: every term appears in each hypothesis that ends before its length limit (`nmt.constraints.Terms`:
    its state per row, and the beam filled by dynamic beam allocation); `joins` (V,): the tokens that continue a
    word, which never follow a term's last token. `cancelled`: as for `search`.
    """
    terms = Terms(terms, src_ids.device, joins) if terms is not None and any(terms) else None
    if cfg.beam_size == 1 and terms is None:
        return [[h] for h in greedy(model, src_ids, cfg, cancelled=cancelled)]
    pad, bos, eos = special_id(model, "pad_id"), special_id(model, "bos_id"), special_id(model, "eos_id")
    B, K, dev = src_ids.shape[0], cfg.beam_size, src_ids.device
    limits = length_limits(src_ids, pad, cfg, _most(model))
    steps = int(limits.max())
    dec, never, forced = start_decoder(model, src_ids), _never(pad, bos, eos, dev), _forced(model, cfg)
    sent = torch.arange(B, device=dev)  # sentence of each active group of rows
    scores = torch.zeros(B, 1, device=dev)  # (N, W) log-probability of each row's prefix; W = 1, then K
    history = torch.full((B, 0), pad, dtype=torch.long, device=dev)  # (N*W, t) tokens of each row
    last = torch.full((B,), bos, dtype=torch.long, device=dev)
    finished = Finished(B, K, steps, pad, dev)
    for t in range(steps):
        _check(cancelled)
        N, W = scores.shape
        at = limits.index_select(0, sent)
        lp = _constrain(dec.step(last), at.repeat_interleave(W) <= t + 1, never, eos, forced if t == 0 else None)
        if cfg.no_repeat_ngram_size:
            _ban_repeats(lp, history, cfg.no_repeat_ngram_size)
        if terms is not None:
            terms.restrict(lp, at.repeat_interleave(W) <= t + 1, eos)
        top, beam, tok = _best_continuations(scores, lp, 2 * K)  # (N, 2K): at most K are </s>, K others remain
        if terms is None:
            finished.add(sent, top[:, :K], beam[:, :K], tok[:, :K].eq(eos), history.view(N, W, t), eos, cfg.alpha)
            top, pick = top.masked_fill(tok.eq(eos), -torch.inf).topk(K, dim=1)  # (N, K) best non-</s> continuations
        else:  # dynamic beam allocation: which candidates end, and the same number of others in its order
            (end_top, end_beam, ends), (top, beam, tok) = terms.allocate(
                scores, lp, sent, top, beam, tok, at.repeat_interleave(W) <= t + 1, eos, K)
            finished.add(sent, end_top, end_beam, ends, history.view(N, W, t), eos, cfg.alpha,
                         terms.unmet().view(N, W).gather(1, end_beam))
            top, pick = going_first(top, tok, eos, K)
        rows = (torch.arange(N, device=dev)[:, None] * W + beam.gather(1, pick)).view(-1)
        last, scores = tok.gather(1, pick).view(-1), top
        history = torch.cat([history.index_select(0, rows), last[:, None]], 1)
        if terms is not None:
            terms.update(rows, last)
        going = ((finished.count.index_select(0, sent) < K) & (at > t + 1)).tolist()  # the step's one read
        if all(going):
            dec.reorder(rows, None, K)  # the first step turns each sentence's row into K rows
            continue
        if not any(going):
            break
        keep = torch.tensor([g for g, on in enumerate(going) if on], dtype=torch.long, device=dev)
        kept_rows = (keep[:, None] * K + torch.arange(K, device=dev)).view(-1)
        rows, sent, scores = rows.index_select(0, kept_rows), sent[keep], scores[keep]
        last, history = last[kept_rows], history[kept_rows]
        if terms is not None:
            terms.keep(kept_rows)
        dec.reorder(rows, keep, K)
    return finished.best(cfg.nbest)


class Finished:
    """The finished hypotheses of B sentences, K slots each, held on the device until the search ends.

    A step's </s> candidates fill a sentence's free slots in rank order; those beyond its K go to one spare
    slot (K) that is never read, so filling them needs no look at how many there were. In a constrained search
    each also keeps how many terms it missed (`missing`): the fewer, the better, before the score.
    """

    def __init__(self, B: int, K: int, steps: int, pad: int, device):
        self.K = K
        self.count = torch.zeros(B, dtype=torch.long, device=device)
        self.score = torch.full((B, K + 1), -torch.inf, device=device)  # log-probability / length penalty
        self.logprob = torch.zeros(B, K + 1, device=device)
        self.length = torch.zeros(B, K + 1, dtype=torch.long, device=device)
        self.tokens = torch.full((B, K + 1, steps), pad, dtype=torch.long, device=device)
        self.missing: torch.Tensor | None = None  # (B, K + 1) terms each missed (constrained search only)

    def add(self, sent: torch.Tensor, top: torch.Tensor, beam: torch.Tensor, ends: torch.Tensor,
            history: torch.Tensor, eos: int, alpha: float, missing: torch.Tensor | None = None) -> None:
        """Candidates (N, K) of sentences `sent` (N,): total log-probability `top`, the row they extend `beam`
        (within its sentence's W rows of `history`, (N, W, t)), whether they end in </s> (`ends`) and, in a
        constrained search, how many terms they miss (`missing`)."""
        N, t = ends.shape[0], history.shape[2]
        ends = ends & top.isfinite()
        slot = self.count.index_select(0, sent)[:, None] + ends.long().cumsum(1) - 1  # (N, K)
        taken = ends & (slot < self.K)
        slot = torch.where(taken, slot, self.K)
        rows = sent[:, None].expand(N, ends.shape[1])
        self.score[rows, slot] = top / _penalty(t + 1, alpha)
        self.logprob[rows, slot] = top
        self.length[rows, slot] = t + 1
        prefix = history.gather(1, beam[:, :, None].expand(-1, -1, t))  # (N, K, t)
        self.tokens[rows, slot, :t] = prefix
        self.tokens[rows, slot, t] = eos
        self.count.index_add_(0, sent, taken.sum(1))
        if missing is not None:
            if self.missing is None:
                self.missing = torch.zeros_like(self.length)
            self.missing[rows, slot] = missing

    def best(self, n: int) -> list[list[Hypothesis]]:
        """The n best finished hypotheses of each sentence, best first (read from the device once)."""
        count, score, logprob = self.count.tolist(), self.score.tolist(), self.logprob.tolist()
        length, tokens = self.length.tolist(), self.tokens.tolist()
        missing = self.missing.tolist() if self.missing is not None else None
        out = []
        for s, c in enumerate(count):
            hyps = [Hypothesis(tokens[s][j][: length[s][j]], score[s][j], logprob[s][j], True) for j in range(c)]
            if missing is None:
                out.append(sorted(hyps, key=lambda h: -h.score)[:n])
            else:  # those that hold every term first
                ranked = sorted(range(c), key=lambda j: (missing[s][j], -hyps[j].score))
                out.append([hyps[j] for j in ranked[:n]])
        return out


def _best_continuations(scores: torch.Tensor, lp: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """The n best (prefix, token) continuations of each sentence, best first.

    scores (N, W) prefix log-probabilities, lp (N*W, V) next-token log-probabilities -> (top, beam, tok),
    each (N, n): total log-probability, row within the sentence's W rows, token. A sentence's n best lie
    within each row's n best tokens, so only N*W*n candidates are ranked instead of N*W*V. Sentences with
    fewer than n candidates are filled up with -inf ones (row 0, token 0).
    """
    N, W = scores.shape
    k = min(n, lp.shape[1])
    row_top, row_tok = lp.topk(k, dim=1)  # (N*W, k)
    cand = (scores.view(N * W, 1) + row_top).view(N, W * k)
    top, idx = cand.topk(min(n, W * k), dim=1)
    beam, tok = idx // k, row_tok.view(N, W * k).gather(1, idx)
    if top.shape[1] < n:
        fill = n - top.shape[1]
        top = torch.cat([top, top.new_full((N, fill), -torch.inf)], 1)
        beam, tok = (torch.cat([x, x.new_zeros(N, fill)], 1) for x in (beam, tok))
    return top, beam, tok


def _forced(model, cfg: SearchConfig) -> int | None:
    """The first token a search forces: the search's own, else the model's forced_bos_id."""
    if cfg.first_token is not None:
        return cfg.first_token
    return getattr(getattr(model, "cfg", model), "forced_bos_id", None)


def _never(pad: int, bos: int, eos: int, device) -> torch.Tensor:
    """The ids search never emits: <pad> and the decoder start, unless that is </s> (M2M100's). Made on the device
    (no copy from host memory, which would make the host wait for a GPU's queue)."""
    ids = sorted({pad, bos} - {eos})
    never = torch.empty(len(ids), dtype=torch.long, device=device)
    for i, token in enumerate(ids):
        never[i] = token  # a fill on the device
    return never


def _constrain(lp: torch.Tensor, at_limit: torch.Tensor, never: torch.Tensor, eos: int,
               forced: int | None = None) -> torch.Tensor:
    """Never emit the ids `never` (<pad>, <s>); rows (N,) at their length limit may only emit </s>, at
    log-probability 0; `forced` (the first step of a model with `forced_bos_id`) is the only choice, at
    log-probability 0. A forced token adds nothing to a hypothesis' score, as in transformers' ForcedEOS- and
    ForcedBOSTokenLogitsProcessor, so beams cut at the limit rank by what the model chose. In place, and without
    reading the device."""
    if forced is not None:
        lp.fill_(-torch.inf)
        lp[:, forced] = 0.0
        return lp
    lp.index_fill_(1, never, -torch.inf)
    eos_lp = lp[:, eos].masked_fill(at_limit, 0.0)
    lp.masked_fill_(at_limit[:, None], -torch.inf)
    lp[:, eos] = eos_lp
    return lp


def _ban_repeats(lp: torch.Tensor, history: torch.Tensor, n: int) -> None:
    """In place: each row (R, V) of `lp` may not emit a token that would end an n-gram its `history` (R, t) holds
    already (the row's last n-1 tokens followed by it once before). Without reading the device."""
    t = history.shape[1]
    if t < n or n < 1:
        return
    grams = history.unfold(1, n, 1)  # (R, t - n + 1, n): every n-gram so far
    ends = grams[:, :, -1]  # the token each n-gram ended with
    if n > 1:
        seen = grams[:, :, :-1].eq(history[:, None, t - n + 1:]).all(-1)  # its first n-1 tokens are the row's last
        ends = ends.masked_fill(~seen, lp.shape[1])  # points past the vocabulary: bans nothing
    banned = torch.zeros(lp.shape[0], lp.shape[1] + 1, dtype=torch.bool, device=lp.device)
    banned.scatter_(1, ends, True)
    lp.masked_fill_(banned[:, :-1], -torch.inf)


def generate(model, src_ids: torch.Tensor, beam_size: int = 1, max_new_tokens: int = 128, **kwargs) -> torch.Tensor:
    """(B, S) source ids -> (B, L) best translation ids, each ending in </s> (unless cut), then padding."""
    cfg = SearchConfig(beam_size=beam_size, max_new_tokens=max_new_tokens, **kwargs)
    best = [h[0].tokens for h in beam_search(model, src_ids, cfg)]
    return pad_rows(best, special_id(model, "pad_id")).to(src_ids.device)


def search_encoded(model, src_ids: list[list[int]], cfg: SearchConfig, batch_tokens: int,
                   rank: int = 0, world_size: int = 1, device=None,
                   sampling: SamplingConfig | None = None, stop=None, terms: list[list[list[int]]] | None = None,
                   joins: torch.Tensor | None = None, cancelled=None) -> dict[int, list[Hypothesis]]:
    """Hypotheses for this process's share of `src_ids`, keyed by input position.

    Inputs are sorted by length into batches of at most `batch_tokens` padded source tokens, and the
    batches dealt round robin to `world_size` processes: each input is decoded exactly once overall.
    With `sampling`, batch number k draws with seed `sampling.seed + k`. `stop` (a function): checked before each
    batch; when it returns True the inputs decoded so far are returned. `terms` (one list per input: its target
    terms' ids; `joins` as for `beam_search`): a batch in which some input has terms is searched under them, any
    other by the plain search. `cancelled`: as for `search` (asked before every step of every batch).
    """
    out: dict[int, list[Hypothesis]] = {}
    lengths = [len(s) for s in src_ids]
    for k, batch in enumerate(eval_batches(lengths, batch_tokens, rank, world_size)):
        if stop is not None and stop():
            break
        ids = pad_rows([src_ids[i] for i in batch], special_id(model, "pad_id")).to(device)
        draw = sampling if sampling is None or sampling.seed is None else replace(sampling, seed=sampling.seed + k)
        rows = batch.tolist()
        held = None if terms is None or not any(terms[i] for i in rows) else [terms[i] for i in rows]
        for i, hyps in zip(rows, search(model, ids, cfg, draw, held, joins, cancelled)):
            out[i] = hyps
    return out


# --- The stepping interface ------------------------------------------------------------------------------------------
# The stepping interface every search runs on: next-token log-probabilities for a set of rows, and rows
# reordered, repeated or dropped as the search goes.
#
# Rows come in groups, one group per sentence (greedy and sampling: 1 row each; beam search: its K beams).
# What belongs to a sentence (its source, the encoder output, cross-attention K/V) is held once per group;
# what belongs to a row (the prefix, self-attention K/V) once per row.
# Models with `start_cache` (like `Seq2SeqTransformer`) decode incrementally; other models with `encode`/
# `decode` are re-run on the whole prefix each step; a model with its own `start_decoder(src_ids)` (an
# `Ensemble`, below) returns its own object with `step` and `reorder`.

COMPILED_FROM = 2  # cached steps before this one run eagerly: a cache of 0 or 1 steps would be a graph of its own


def compile_decoder(model: nn.Module) -> nn.Module:
    """`model` (in place) with its cached `decode`, the call every search step makes, compiled whole
    (`fullgraph=True`, sizes dynamic: the cache's length and the rows change every step).

    The compiled step always sees one kind of cache, so that a handful of graphs serve every batch and beam size
    (a graph per beam size, and one more for a batch of one sentence, whose size-1 dimensions torch specialises):
    the first `COMPILED_FROM` steps of a batch (an empty cache, then one of length 1) run eagerly, and a reorder
    of the rows is applied before the call rather than inside it. Full-prefix calls (no cache) run eagerly."""
    eager = model.decode
    compiled = torch.compile(eager, fullgraph=True, dynamic=True)

    def decode(tgt_in_ids: torch.Tensor, memory: torch.Tensor, src_ids: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is None or cache.length < COMPILED_FROM:
            return eager(tgt_in_ids, memory, src_ids, cache)
        cache.settle()
        return compiled(tgt_in_ids, memory, src_ids, cache)

    model.decode = decode
    return model


def start_decoder(model, src_ids: torch.Tensor):
    """A decoder for the sentences src_ids (B, S): one row each to start with."""
    if hasattr(model, "start_decoder"):
        return model.start_decoder(src_ids)
    return Decoder(model, src_ids)


class Decoder:
    """One model's rows. `step(last)` feeds each row its newest token; `reorder` changes which rows go on."""

    def __init__(self, model, src_ids: torch.Tensor):
        self.model, self.src_ids = model, src_ids  # (G, S) one source per sentence group
        self.memory = model.encode(src_ids)  # (G, S, D)
        self.cache = model.start_cache(self.memory, src_ids) if hasattr(model, "start_cache") else None
        self.prefix: torch.Tensor | None = None  # (R, t) tokens fed so far (models without a cache)
        self.group = 1  # rows per sentence

    def step(self, last: torch.Tensor) -> torch.Tensor:
        """last (R,) newest token of each row -> next-token log-probabilities (R, V) in float32."""
        if self.cache is not None:
            logits = self.model.decode(last[:, None], self.memory, self.src_ids, cache=self.cache)[:, -1]
        else:
            self.prefix = last[:, None] if self.prefix is None else torch.cat([self.prefix, last[:, None]], 1)
            memory, src_ids = self.memory, self.src_ids
            if self.group > 1:
                memory, src_ids = memory.repeat_interleave(self.group, 0), src_ids.repeat_interleave(self.group, 0)
            logits = self.model.decode(self.prefix, memory, src_ids)[:, -1]
        logits = logits.float().contiguous()  # (R, V), this step's own tensor
        return torch.log_softmax(logits, dim=-1, out=logits)  # in place: no new (R, V) buffer each step

    def reorder(self, rows: torch.Tensor, sentences: torch.Tensor | None = None, group: int = 1) -> None:
        """Continue with rows `rows` (R',) of the current ones, in that order, `group` consecutive rows per
        sentence; `sentences` (G',) are the sentence groups that go on (None: all, as they are)."""
        if self.cache is not None:  # with a cache, decode reads only the cache (memory and src_ids stay as they were)
            self.cache.select(rows, sentences, group)
        else:
            self.prefix = None if self.prefix is None else self.prefix.index_select(0, rows)
            if sentences is not None:
                self.memory, self.src_ids = self.memory.index_select(0, sentences), self.src_ids.index_select(0, sentences)
        self.group = group


# --- Sampling: which tokens may be drawn -----------------------------------------------------------------------------
# Sampling instead of searching: which tokens may be drawn (top-k, top-p), how sharply (temperature), and the
# seeded draw itself. `search` above runs the loop; this part only chooses the next token of each row.

SEEDS = 10**9 + 1  # seeds are 0 .. 1e9 (the range of SamplingConfig.seed)


@dataclass
class SamplingConfig:
    """Draw each next token from the model's distribution instead of taking the best one.

    Sampled back-translation gives the forward model more varied synthetic sources than beam search
    (Edunov et al. 2018). With topk 1, or temperature 0, sampling is greedy search.
    """

    topk: int = ranged(0, "[0, 1e6]")  # draw only among the k most likely tokens (0: no limit)
    topp: float = ranged(1.0, "(0, 1]")  # ... and among the fewest most likely tokens holding probability >= p
    temperature: float = ranged(1.0, "[0, 1e3]")  # divides the log-probabilities: < 1 sharper, > 1 flatter, 0 greedy
    seed: int | None = ranged(0, "[0, 1e9]")  # same seed, inputs and batches: same samples; None: torch's global RNG

    def __post_init__(self) -> None:
        check_fields(self, noun="sampling setting")

    def generator(self, device: torch.device) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)


def choose(lp: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """lp (N, V) log-probabilities -> (N,) one token per row, drawn from the tempered top-k / top-p set; the
    argmax at temperature 0 or top-k 1.

    Top-k and top-p are applied to the model's own distribution (before the temperature), as fairseq does;
    the most likely token is always kept, so every row can draw. With top-k the draw looks at k tokens a
    row only; top-p alone sorts the whole vocabulary.
    """
    if cfg.temperature == 0 or cfg.topk == 1:
        return lp.argmax(-1)
    V = lp.shape[1]
    k = cfg.topk if 0 < cfg.topk < V else (V if cfg.topp < 1 else 0)
    if not k:
        return torch.multinomial(torch.softmax(lp / cfg.temperature, dim=-1), 1, generator=generator).squeeze(1)
    top, token = lp.topk(k, dim=1)  # (N, k), most likely first
    if cfg.topp < 1:
        probs = top.exp()
        before = probs.cumsum(1) - probs  # (N, k) mass of the tokens ranked above each one
        top = top.masked_fill(before >= cfg.topp, -torch.inf)
    pick = torch.multinomial(torch.softmax(top / cfg.temperature, dim=-1), 1, generator=generator)  # (N, 1)
    return token.gather(1, pick).squeeze(1)


# --- Ensembles -------------------------------------------------------------------------------------------------------
# Ensembles: several models with one vocabulary decoded as one, their log-probabilities averaged per step.
#
# `Ensemble([a, b])` goes wherever a model goes in `search` (greedy, beam, sampling) and `score`:
# each model keeps its own cache on the same fast path, and every step's next-token distribution is the
# mean of the models' log-probabilities (a product of experts, as OpenNMT-py and Marian ensemble),
# renormalised. `nmt average` is the weight-space alternative: one model, one model's cost.

class Ensemble(nn.Module):
    """Models decoded together. They must agree on the target vocabulary and the special token ids."""

    def __init__(self, models: list[nn.Module]):
        super().__init__()
        if not models:
            raise NmtError("an ensemble needs at least one model")
        self.models = nn.ModuleList(models)
        first = models[0].cfg
        for i, m in enumerate(models[1:], 2):
            for key in ("tgt_vocab_size", "src_vocab_size", "pad_id", "bos_id", "eos_id", "forced_bos_id"):
                if getattr(m.cfg, key) != getattr(first, key):
                    raise NmtError(f"ensemble model {i} has model.{key}={getattr(m.cfg, key)} but model 1 has "
                                   f"{getattr(first, key)}: ensembled models must share one vocabulary")

    @property
    def cfg(self):
        """The first model's config, with the shortest max_positions of all (what every model can take)."""
        return replace(self.models[0].cfg, max_positions=min(m.cfg.max_positions for m in self.models))

    def start_decoder(self, src_ids: torch.Tensor) -> EnsembleDecoder:
        return EnsembleDecoder([Decoder(m, src_ids) for m in self.models])

    def token_logprobs(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced (B, T, V) log-probabilities, combined as in decoding."""
        return combine([token_logprobs(m, src_ids, tgt_in_ids) for m in self.models])


class EnsembleDecoder:
    """The models' decoders stepped together (the stepping interface above)."""

    def __init__(self, decoders: list[Decoder]):
        self.decoders = decoders

    def step(self, last: torch.Tensor) -> torch.Tensor:
        return combine([d.step(last) for d in self.decoders])

    def reorder(self, rows: torch.Tensor, sentences: torch.Tensor | None = None, group: int = 1) -> None:
        for d in self.decoders:
            d.reorder(rows, sentences, group)


def combine(logprobs: list[torch.Tensor]) -> torch.Tensor:
    """(..., V) log-probabilities of each model -> their mean, renormalised over V (one model: as it is)."""
    if len(logprobs) == 1:
        return logprobs[0]
    return torch.log_softmax(torch.stack(logprobs).mean(0), dim=-1)


def token_logprobs(model, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor) -> torch.Tensor:
    """src_ids (B, S), tgt_in_ids (B, T) -> teacher-forced next-token log-probabilities (B, T, V), float32."""
    if hasattr(model, "token_logprobs"):
        return model.token_logprobs(src_ids, tgt_in_ids)
    logits = model.decode(tgt_in_ids, model.encode(src_ids), src_ids)
    return torch.log_softmax(logits.float(), dim=-1)


# --- Forced decoding -------------------------------------------------------------------------------------------------
# Forced decoding: the log-probability a model (or an `Ensemble`) gives a given translation, per token.
#
# Used for corpus filtering (dual conditional cross-entropy), reranking and analysis. One teacher-forced
# pass per batch of pairs, batched by length like translation; `Translator.score` and `nmt score` are the
# front ends.

@dataclass
class Score:
    """The log-probability (nats) of one target given its source, `</s>` included."""

    token_logprobs: list[float]  # one per target token, the last for </s>

    @property
    def total(self) -> float:
        return sum(self.token_logprobs)

    @property
    def mean(self) -> float:
        return self.total / len(self.token_logprobs)


@torch.no_grad()
def score_encoded(model, src_ids: list[list[int]], tgt_ids: list[list[int]], batch_tokens: int,
                  device=None) -> list[Score]:
    """Scores of targets `tgt_ids` (ids without specials) given sources `src_ids` (ending in </s>), in input order.

    Pairs are sorted by length into batches of at most `batch_tokens` padded tokens (the longer side counts).
    """
    cfg = model.cfg
    out: list[Score | None] = [None] * len(src_ids)
    lengths = [max(len(s), len(t) + 1) for s, t in zip(src_ids, tgt_ids)]
    for batch in eval_batches(lengths, batch_tokens, 0, 1):
        rows = batch.tolist()
        src = pad_rows([src_ids[i] for i in rows], cfg.pad_id).to(device)
        tgt_in = pad_rows([[cfg.bos_id, *tgt_ids[i]] for i in rows], cfg.pad_id).to(device)  # (B, T)
        labels = pad_rows([[*tgt_ids[i], cfg.eos_id] for i in rows], cfg.pad_id).to(device)  # (B, T)
        picked = token_logprobs(model, src, tgt_in).gather(2, labels[..., None]).squeeze(2).tolist()  # (B, T)
        for i, lps in zip(rows, picked):
            out[i] = Score(lps[: len(tgt_ids[i]) + 1])
    return out
