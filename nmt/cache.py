"""The decoder's key/value cache for incremental decoding (`Seq2SeqTransformer.start_cache`), kept apart from
the model: what a search reorders, repeats and prunes as hypotheses go.
Shapes: G sentences, R = G * group hypothesis rows, H heads, S source, t steps so far, Dh head width.
"""

from __future__ import annotations

import torch


class SelfKV:
    """One decoder layer's self-attention keys and values so far, stored time-major (t, R, H, Dh).

    A reorder of the rows (beams re-ranked, sentences finished) is only noted; the next `extend` copies the
    old steps in the new row order and appends the new one in a single pass (time-major, the old steps are
    one contiguous block of the result). Attention reads them as (R, H, t, Dh) views.
    """

    def __init__(self):
        self.k: torch.Tensor | None = None  # (t, R, H, Dh)
        self.v: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None  # reorder still to apply: new row i is old row rows[i]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def reorder(self, rows: torch.Tensor) -> None:
        if self.k is not None:
            self.rows = rows if self.rows is None else self.rows.index_select(0, rows)

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions k, v (R, H, n, Dh); returns all positions, (R, H, t + n, Dh) each."""
        self.k, self.v = self._append(self.k, k), self._append(self.v, v)
        self.rows = None
        return tuple(self)

    def __iter__(self):
        """K and V as batch-leading (R, H, t, Dh) views (after `extend`)."""
        if self.k is not None:
            yield from (self.k.permute(1, 2, 0, 3), self.v.permute(1, 2, 0, 3))

    def _append(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        new = new.permute(2, 0, 1, 3)  # (n, R, H, Dh)
        if old is None:
            return new.contiguous()
        out = new.new_empty(old.shape[0] + new.shape[0], *new.shape[1:])
        if self.rows is None:
            out[: old.shape[0]] = old
        else:
            torch.index_select(old, 1, self.rows, out=out[: old.shape[0]])
        out[old.shape[0]:] = new
        return out


class DecoderCache:
    """Per-layer keys/values for incremental decoding; every tensor is batch-leading (self-attention K/V are
    stored time-major, `SelfKV`, and seen batch-leading).

    Cross-attention K/V come from the encoder output once per sentence; self-attention K/V grow by one step
    per call, one row per hypothesis. A sentence's `group` hypotheses (beam search's K beams) are consecutive
    rows and share its cross-attention K/V, which are never copied per beam. `select` re-indexes every layer at
    once when hypotheses are re-ranked, repeated or pruned.
    """

    def __init__(self, cross_kv: list[tuple], attend: torch.Tensor | None):
        self.cross_kv = cross_kv  # per layer (G, H, S, Dh) twice
        self.attend = attend  # (G, 1, 1, S) or None
        self.self_kv = [SelfKV() for _ in cross_kv]  # R = G * group rows
        self.group = 1

    @property
    def length(self) -> int:
        return self.self_kv[0].length

    def select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None, group: int = 1) -> None:
        """Keep hypothesis rows `rows` (R',) in that order, `group` per sentence; `sentences` (G',) picks the
        sentences that go on (None: all of them, in order)."""
        for kv in self.self_kv:
            kv.reorder(rows)
        if sentences is not None:
            self.cross_kv = [(k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in self.cross_kv]
            self.attend = None if self.attend is None else self.attend.index_select(0, sentences)
        self.group = group

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` (K,) of a cache holding one row per sentence, in that order."""
        self.select(index, index, 1)
