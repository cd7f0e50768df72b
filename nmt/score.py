"""Forced decoding: the log-probability a model (or an `Ensemble`) gives a given translation, per token.

Used for corpus filtering (dual conditional cross-entropy), reranking and analysis. One teacher-forced
pass per batch of pairs, batched by length like translation; `Translator.score` and `nmt score` are the
front ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nmt.batching import eval_batches
from nmt.collate import pad
from nmt.ensemble import token_logprobs


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
        src = pad([src_ids[i] for i in rows], cfg.pad_id).to(device)
        tgt_in = pad([[cfg.bos_id, *tgt_ids[i]] for i in rows], cfg.pad_id).to(device)  # (B, T)
        labels = pad([[*tgt_ids[i], cfg.eos_id] for i in rows], cfg.pad_id).to(device)  # (B, T)
        picked = token_logprobs(model, src, tgt_in).gather(2, labels[..., None]).squeeze(2).tolist()  # (B, T)
        for i, lps in zip(rows, picked):
            out[i] = Score(lps[: len(tgt_ids[i]) + 1])
    return out
