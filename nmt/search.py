"""Decoding: a greedy fast path and batched beam search over any model with `encode`/`decode`.

Models that offer `start_cache` (like `Seq2SeqTransformer`) decode incrementally: one new token per
step, encoder keys/values computed once, and rows of finished sentences dropped from the cache so
work shrinks as sentences end. Other models are re-run on the whole prefix each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SearchConfig:
    """How translations are searched for."""

    beam_size: int = 4  # hypotheses kept per sentence (1: greedy)
    nbest: int = 1  # hypotheses returned per sentence
    alpha: float = 0.6  # GNMT length penalty ((5 + len) / 6) ** alpha; 0 scores by raw log-probability
    max_len_a: float = 10  # a generated sentence has at most a + b * source length tokens ...
    max_len_b: float = 2.0  # ... (including the final </s>)
    max_new_tokens: int = 256  # and never more than this


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
    B = src_ids.shape[0]
    limits = length_limits(src_ids, pad, cfg)
    dec = _Decoder.start(model, src_ids)
    alive = torch.arange(B, device=src_ids.device)  # sentence of each row
    last = torch.full((B,), bos, dtype=torch.long, device=src_ids.device)
    out: list[list[int]] = [[] for _ in range(B)]
    logprob = [0.0] * B
    for t in range(int(limits.max())):
        lp = _constrain(dec.step(last), limits[alive] <= t + 1, (pad, bos), eos)  # (N, V)
        best, last = lp.max(-1)
        for i, tok, s in zip(alive.tolist(), last.tolist(), best.tolist()):
            out[i].append(tok)
            logprob[i] += s
        going = last.ne(eos)
        if not bool(going.all()):
            rows = going.nonzero().squeeze(1)
            alive, last = alive[rows], last[rows]
            if len(alive) == 0:
                break
            dec.keep(rows)
    return [Hypothesis(toks, lp_ / _penalty(len(toks), cfg.alpha), lp_, toks[-1:] == [eos])
            for toks, lp_ in zip(out, logprob)]


def _penalty(length: int, alpha: float) -> float:
    return ((5 + length) / 6) ** alpha


@torch.no_grad()
def beam_search(model, src_ids: torch.Tensor, cfg: SearchConfig) -> list[list[Hypothesis]]:
    """Batched beam search; returns the cfg.nbest best hypotheses per sentence, best first.

    A sentence is done once it has beam_size finished hypotheses (or hits its length limit); its
    rows then leave the batch and the cache.
    """
    if cfg.beam_size == 1:
        return [[h] for h in greedy(model, src_ids, cfg)]
    pad, bos, eos = _ids(model, "pad_id"), _ids(model, "bos_id"), _ids(model, "eos_id")
    B, K, dev = src_ids.shape[0], cfg.beam_size, src_ids.device
    limits = length_limits(src_ids, pad, cfg)
    dec = _Decoder.start(model, src_ids)
    dec.keep(torch.arange(B, device=dev).repeat_interleave(K))  # (B*K) rows, beams of a sentence adjacent
    sent = torch.arange(B, device=dev)  # sentence of each active group of K rows
    scores = torch.full((B, K), -torch.inf, device=dev)
    scores[:, 0] = 0.0  # all beams start identical: only the first may expand
    history = torch.full((B * K, 0), pad, dtype=torch.long, device=dev)
    last = torch.full((B * K,), bos, dtype=torch.long, device=dev)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    for t in range(int(limits.max())):
        lp = _constrain(dec.step(last), limits[sent].repeat_interleave(K) <= t + 1, (pad, bos), eos)
        N, V = len(sent), lp.shape[1]
        cand = (scores.view(N * K, 1) + lp).view(N, K * V)
        top, idx = cand.topk(2 * K, dim=1)  # (N, 2K): at most K are </s>, so K others remain
        beam, tok = idx // V, idx % V
        _finalize(finished, sent, top, beam, tok, history, K, eos, cfg.alpha)
        top = top.masked_fill(tok.eq(eos), -torch.inf)
        top, pick = top.topk(K, dim=1)  # (N, K) best non-</s> continuations
        rows = (torch.arange(N, device=dev)[:, None] * K + beam.gather(1, pick)).view(-1)
        last, scores = tok.gather(1, pick).view(-1), top
        history = torch.cat([history.index_select(0, rows), last[:, None]], 1)
        going = torch.tensor([len(finished[s]) < K for s in sent.tolist()], device=dev) & (limits[sent] > t + 1)
        if not bool(going.all()):
            keep_groups = going.nonzero().squeeze(1)
            rows_kept = (keep_groups[:, None] * K + torch.arange(K, device=dev)).view(-1)
            rows, sent, scores = rows.index_select(0, rows_kept), sent[keep_groups], scores[keep_groups]
            last, history = last[rows_kept], history[rows_kept]
        dec.keep(rows)
        if len(sent) == 0:
            break
    return [sorted(f, key=lambda h: -h.score)[: cfg.nbest] for f in finished]


def _constrain(lp: torch.Tensor, at_limit: torch.Tensor, never: tuple[int, ...], eos: int) -> torch.Tensor:
    """Never emit `never` (<pad>, <s>); rows (N,) at their length limit may only emit </s>."""
    lp[:, list(never)] = -torch.inf
    if bool(at_limit.any()):
        only_eos = torch.full_like(lp[0], -torch.inf)
        only_eos[eos] = 0.0
        lp[at_limit] = lp[at_limit] + only_eos
    return lp


def _finalize(finished, sent, top, beam, tok, history, K, eos, alpha) -> None:
    """Move </s> candidates ranked within the first K of a sentence into its finished list."""
    ends = (tok[:, :K].eq(eos) & top[:, :K].isfinite()).nonzero().tolist()
    for g, j in ends:
        s = int(sent[g])
        if len(finished[s]) >= K:
            continue
        tokens = history[g * K + int(beam[g, j])].tolist() + [eos]
        logprob = float(top[g, j])
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
