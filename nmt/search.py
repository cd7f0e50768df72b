"""Decoding: a greedy fast path and batched beam search over any model with `encode`/`decode`.

Models that offer `start_cache` (like `Seq2SeqTransformer`) decode incrementally: one new token per
step, encoder keys/values computed once, and rows of finished sentences dropped from the cache so
work shrinks as sentences end. Other models are re-run on the whole prefix each step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nmt.errors import NmtError
from nmt.model_dir import SEARCH_FILE
from nmt.ranges import check_fields, ranged


@dataclass
class SearchConfig:
    """How translations are searched for."""

    beam_size: int = ranged(4, "[1, 1000]")  # hypotheses kept per sentence (1: greedy)
    nbest: int = ranged(1, "[1, 1000]")  # hypotheses returned per sentence (at most beam_size)
    alpha: float = ranged(0.6, "[0, 10]")  # GNMT length penalty ((5 + len) / 6) ** alpha; 0: raw log-probability
    max_len_a: float = ranged(10, "[0, 1e6]")  # a generated sentence has at most a + b * source length tokens ...
    max_len_b: float = ranged(2.0, "[0, 1e6]")  # ... (including the final </s>)
    max_new_tokens: int = ranged(256, "[1, 1e6]")  # and never more than this

    def __post_init__(self) -> None:
        check_fields(self, noun="search setting")
        if self.nbest > self.beam_size:
            raise NmtError(f"search setting 'nbest': {self.nbest} hypotheses need beam_size >= {self.nbest} "
                           f"(it is {self.beam_size})")


@dataclass
class Hypothesis:
    tokens: list[int]  # generated ids, ending in </s> unless the length limit cut it
    score: float  # log-probability divided by the length penalty
    logprob: float = 0.0  # total log-probability
    finished: bool = True  # ended in </s>


@dataclass
class _Decoder:
    """The model's stepping interface: cached when the model supports it."""

    model: torch.nn.Module
    src_ids: torch.Tensor  # (N, S) rows being decoded
    memory: torch.Tensor  # (N, S, D)
    cache: object | None = None
    prefix: torch.Tensor | None = field(default=None)  # (N, t) tokens fed so far (uncached models)

    @classmethod
    def start(cls, model, src_ids: torch.Tensor) -> _Decoder:
        memory = model.encode(src_ids)
        cache = model.start_cache(memory, src_ids) if hasattr(model, "start_cache") else None
        return cls(model, src_ids, memory, cache)

    def step(self, last: torch.Tensor) -> torch.Tensor:
        """last (N,) newest tokens -> next-token log-probs (N, V) in float32."""
        if self.cache is not None:
            logits = self.model.decode(last[:, None], self.memory, self.src_ids, cache=self.cache)[:, -1]
        else:
            self.prefix = last[:, None] if self.prefix is None else torch.cat([self.prefix, last[:, None]], 1)
            logits = self.model.decode(self.prefix, self.memory, self.src_ids)[:, -1]
        return torch.log_softmax(logits.float(), dim=-1)

    def keep(self, rows: torch.Tensor) -> None:
        """Continue with rows `rows` only (reordered, repeated or pruned)."""
        self.src_ids, self.memory = self.src_ids.index_select(0, rows), self.memory.index_select(0, rows)
        if self.cache is not None:
            self.cache.reorder(rows)
        if self.prefix is not None:
            self.prefix = self.prefix.index_select(0, rows)

    def reorder_beams(self, rows: torch.Tensor) -> None:
        """Like `keep`, for rows that move only among the beams of their own sentence.

        The rows of one sentence share its source, memory and cross-attention K/V, so only the
        self-attention K/V differ; re-indexing nothing else saves most of a step's copying.
        """
        self_kv = getattr(self.cache, "self_kv", None)
        if self_kv is None:
            return self.keep(rows)
        self.cache.self_kv = [None if kv is None else (kv[0].index_select(0, rows), kv[1].index_select(0, rows))
                              for kv in self_kv]


def length_limits(src_ids: torch.Tensor, pad_id: int, cfg: SearchConfig) -> torch.Tensor:
    """(B,) most tokens to generate per sentence: min(a + b * source length, max_new_tokens)."""
    src_len = src_ids.ne(pad_id).sum(1).float()
    return (cfg.max_len_a + cfg.max_len_b * src_len).long().clamp(1, cfg.max_new_tokens)


def _ids(model, name: str) -> int:
    return getattr(model.cfg, name) if hasattr(model, "cfg") else getattr(model, name)


@torch.no_grad()
def greedy(model, src_ids: torch.Tensor, cfg: SearchConfig | None = None) -> list[Hypothesis]:
    """Best-first decoding, one hypothesis per sentence; finished rows leave the batch."""
    cfg = cfg or SearchConfig(beam_size=1)
    pad, bos, eos = _ids(model, "pad_id"), _ids(model, "bos_id"), _ids(model, "eos_id")
    B, dev = src_ids.shape[0], src_ids.device
    limits = length_limits(src_ids, pad, cfg)
    steps = int(limits.max())
    dec = _Decoder.start(model, src_ids)
    alive = torch.arange(B, device=dev)  # sentence of each row
    last = torch.full((B,), bos, dtype=torch.long, device=dev)
    tokens = torch.full((B, steps), pad, dtype=torch.long, device=dev)  # <pad> is never emitted: it marks the end
    logprob = torch.zeros(B, dtype=torch.float64, device=dev)  # summed in float64 like Python floats
    for t in range(steps):
        lp = _constrain(dec.step(last), limits[alive] <= t + 1, (pad, bos), eos)
        best, last = lp.max(-1)
        tokens[alive, t] = last
        logprob.index_add_(0, alive, best.double())
        going = last.ne(eos)
        if not bool(going.all()):
            rows = going.nonzero().squeeze(1)
            alive, last = alive[rows], last[rows]
            if len(alive) == 0:
                break
            dec.keep(rows)
    lengths, out, lps = tokens.ne(pad).sum(1).tolist(), tokens.tolist(), logprob.tolist()
    return [Hypothesis(toks[:n], lp / _penalty(n, cfg.alpha), lp, toks[n - 1: n] == [eos])
            for toks, n, lp in zip(out, lengths, lps)]


def _penalty(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


@torch.no_grad()
def beam_search(model, src_ids: torch.Tensor, cfg: SearchConfig) -> list[list[Hypothesis]]:
    """Batched beam search; returns the cfg.nbest best hypotheses per sentence, best first.

    A sentence is done once it has beam_size finished hypotheses (or hits its length limit); its
    rows then leave the batch and the cache. The first step runs one row per sentence (all beams
    would be identical); the K beams branch from it.
    """
    if cfg.beam_size == 1:
        return [[h] for h in greedy(model, src_ids, cfg)]
    pad, bos, eos = _ids(model, "pad_id"), _ids(model, "bos_id"), _ids(model, "eos_id")
    B, K, dev = src_ids.shape[0], cfg.beam_size, src_ids.device
    limits = length_limits(src_ids, pad, cfg)
    dec = _Decoder.start(model, src_ids)
    sent, sent_list = torch.arange(B, device=dev), list(range(B))  # sentence of each active group of rows
    scores = torch.zeros(B, 1, device=dev)  # (N, W) log-probability of each row's prefix; W = 1, then K
    history = torch.full((B, 0), pad, dtype=torch.long, device=dev)  # (N*W, t) tokens of each row
    last = torch.full((B,), bos, dtype=torch.long, device=dev)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    for t in range(int(limits.max())):
        N, W = scores.shape
        lp = _constrain(dec.step(last), limits[sent].repeat_interleave(W) <= t + 1, (pad, bos), eos)
        top, beam, tok = _best_continuations(scores, lp, 2 * K)  # (N, 2K): at most K are </s>, K others remain
        _finalize(finished, sent_list, top, beam, tok, history, W, K, eos, cfg.alpha)
        top, pick = top.masked_fill(tok.eq(eos), -torch.inf).topk(K, dim=1)  # (N, K) best non-</s> continuations
        rows = (torch.arange(N, device=dev)[:, None] * W + beam.gather(1, pick)).view(-1)
        last, scores = tok.gather(1, pick).view(-1), top
        history = torch.cat([history.index_select(0, rows), last[:, None]], 1)
        going = [len(finished[s]) < K for s in sent_list]
        going = torch.tensor(going, device=dev) & (limits[sent] > t + 1)
        if not bool(going.all()):
            keep_groups = going.nonzero().squeeze(1)
            rows_kept = (keep_groups[:, None] * K + torch.arange(K, device=dev)).view(-1)
            rows, sent, scores = rows.index_select(0, rows_kept), sent[keep_groups], scores[keep_groups]
            last, history = last[rows_kept], history[rows_kept]
            sent_list = [sent_list[g] for g in keep_groups.tolist()]
            if not sent_list:
                break
            dec.keep(rows)
        elif W == 1:
            dec.keep(rows)  # the first step: each sentence's row becomes K rows
        else:
            dec.reorder_beams(rows)
    return [sorted(f, key=lambda h: -h.score)[: cfg.nbest] for f in finished]


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


def _constrain(lp: torch.Tensor, at_limit: torch.Tensor, never: tuple[int, ...], eos: int) -> torch.Tensor:
    """Never emit `never` (<pad>, <s>); rows (N,) at their length limit may only emit </s>."""
    lp[:, list(never)] = -torch.inf
    if bool(at_limit.any()):
        only_eos = torch.full_like(lp[0], -torch.inf)
        only_eos[eos] = 0.0
        lp[at_limit] = lp[at_limit] + only_eos
    return lp


def _finalize(finished, sent_list, top, beam, tok, history, W, K, eos, alpha) -> None:
    """Move </s> candidates ranked within the first K of a sentence into its finished list."""
    ends = (tok[:, :K].eq(eos) & top[:, :K].isfinite()).nonzero().tolist()
    if not ends:
        return
    top_list, beam_list = top.tolist(), beam.tolist()
    for g, j in ends:
        s = sent_list[g]
        if len(finished[s]) >= K:
            continue
        tokens = history[g * W + beam_list[g][j]].tolist() + [eos]
        logprob = top_list[g][j]
        finished[s].append(Hypothesis(tokens, logprob / _penalty(len(tokens), alpha), logprob, True))


def to_tensor(hyps: list[list[int]], pad_id: int, device=None) -> torch.Tensor:
    """Token lists -> (B, L) LongTensor right-padded with pad_id."""
    length = max((len(h) for h in hyps), default=0)
    out = torch.full((len(hyps), length), pad_id, dtype=torch.long, device=device)
    for i, h in enumerate(hyps):
        out[i, : len(h)] = torch.tensor(h, dtype=torch.long)
    return out


def generate(model, src_ids: torch.Tensor, beam_size: int = 1, max_new_tokens: int = 128, **kwargs) -> torch.Tensor:
    """(B, S) source ids -> (B, L) best translation ids, each ending in </s> (unless cut), then padding."""
    cfg = SearchConfig(beam_size=beam_size, max_new_tokens=max_new_tokens, **kwargs)
    best = [h[0].tokens for h in beam_search(model, src_ids, cfg)]
    return to_tensor(best, _ids(model, "pad_id"), src_ids.device)


# --- a model directory's own search defaults -----------------------------------------------------

def search_defaults(directory: Path) -> dict:
    """{"alpha": ...} from a model directory's search.json (written when training tuned it), else {}."""
    path = Path(directory) / SEARCH_FILE
    if not path.is_file():
        return {}
    try:
        alpha = json.loads(path.read_text(encoding="utf-8"))["alpha"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise NmtError(f"{path}: not a readable search defaults file ({e}); delete it to use the defaults") from None
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise NmtError(f"{path}: alpha must be a number, got {alpha!r}")
    return {"alpha": float(alpha)}


def search_encoded(model, src_ids: list[list[int]], search: SearchConfig, batch_tokens: int,
                   rank: int = 0, world_size: int = 1, device=None) -> dict[int, list[Hypothesis]]:
    """Hypotheses for this process's share of `src_ids`, keyed by input position.

    Inputs are sorted by length into batches of at most `batch_tokens` padded source tokens, and the
    batches dealt round robin to `world_size` processes: each input is decoded exactly once overall.
    """
    from nmt.batching import eval_batches
    from nmt.collate import pad

    out: dict[int, list[Hypothesis]] = {}
    lengths = [len(s) for s in src_ids]
    for batch in eval_batches(lengths, batch_tokens, rank, world_size):
        ids = pad([src_ids[i] for i in batch]).to(device)
        for i, hyps in zip(batch.tolist(), beam_search(model, ids, search)):
            out[i] = hyps
    return out
