"""The collator: encoded pairs in, batch-leading LongTensors out. Nothing else.

It never builds masks: the model derives them from `pad_id`, so no tensor whose dim 0 is not
the batch ever exists to be cut wrongly by a scatter (the nn.DataParallel mask bug).
"""

from __future__ import annotations

import torch

from nmt.tokenizer import BOS, EOS, PAD


def pad(rows: list[list[int]], pad_id: int = PAD, multiple_of: int | None = None) -> torch.Tensor:
    """(B, L) LongTensor right-padded to the longest row (rounded up to `multiple_of`)."""
    length = max((len(r) for r in rows), default=0)
    if multiple_of:
        length = -(-length // multiple_of) * multiple_of
    out = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def special_id(model, name: str) -> int:
    """A model's `pad_id`, `bos_id` or `eos_id`: its attribute, else its `cfg`'s (the contract the training setup
    checks). Training reads them here and nowhere else: an imported model keeps its own ids (Marian starts with pad)."""
    value = getattr(model, name, None)
    return value if value is not None else getattr(model.cfg, name)


class Collator:
    """Turns [{"src_ids", "tgt_ids"}, ...] into {src_ids (B,S), tgt_in_ids (B,T), labels (B,T)}.

    tgt_in_ids = <s> + target, labels = target + </s>: the shift is done here, once.
    """

    def __init__(self, pad_id: int = PAD, bos_id: int = BOS, eos_id: int = EOS, pad_to_multiple_of: int | None = None):
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.multiple_of = pad_to_multiple_of

    @classmethod
    def for_model(cls, model, pad_to_multiple_of: int | None = None) -> Collator:
        """The collator of `model`'s own pad, decoder start and end ids (`special_id`)."""
        return cls(*(special_id(model, name) for name in ("pad_id", "bos_id", "eos_id")), pad_to_multiple_of)

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        src = [ex["src_ids"] for ex in examples]
        tgt = [ex["tgt_ids"] for ex in examples]
        return {
            "src_ids": pad(src, self.pad_id, self.multiple_of),  # (B, S)
            "tgt_in_ids": pad([[self.bos_id, *t] for t in tgt], self.pad_id, self.multiple_of),  # (B, T)
            "labels": pad([[*t, self.eos_id] for t in tgt], self.pad_id, self.multiple_of),  # (B, T)
        }

    def columns(self, rows: dict[str, list]) -> dict[str, torch.Tensor]:
        """The batch of `rows` given column-wise, as a Dataset returns them for a list of indices
        (`ds[indices]`: {"src_ids": [[...], ...], "tgt_ids": [[...], ...]})."""
        return self([{"src_ids": s, "tgt_ids": t} for s, t in zip(rows["src_ids"], rows["tgt_ids"])])
