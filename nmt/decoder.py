"""The stepping interface every search runs on: next-token log-probabilities for a set of rows, and rows
reordered, repeated or dropped as the search goes.

Rows come in groups, one group per sentence (greedy and sampling: 1 row each; beam search: its K beams).
What belongs to a sentence (its source, the encoder output, cross-attention K/V) is held once per group;
what belongs to a row (the prefix, self-attention K/V) once per row.
Models with `start_cache` (like `Seq2SeqTransformer`) decode incrementally; other models with `encode`/
`decode` are re-run on the whole prefix each step; a model with its own `start_decoder(src_ids)` (an
`nmt.ensemble.Ensemble`) returns its own object with `step` and `reorder`.
"""

from __future__ import annotations

import torch


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
