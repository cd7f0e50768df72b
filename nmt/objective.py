"""The training objective: a module wrapping any model, returning summed label-smoothed loss sums.

`Seq2SeqLoss` is what `Accelerator.prepare` receives for training, so DDP/FSDP wrap one forward that
scores a micro-batch: the model's own `packed_loss` when it has one (no (B, T, V) logits), else its logits
through `nmt.loss.label_smoothed_nll`. Its state dict is the plain model's (no `model.` prefix), so
checkpoints and model directories keep the layout of a bare model.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
from torch import nn

from nmt.collate import special_id
from nmt.loss import label_smoothed_nll

_INNER = re.compile(r"(^|\.)model\.")


class LossSums(NamedTuple):
    """Sums over the real (non-pad) target tokens of a batch."""

    loss: torch.Tensor  # label-smoothed loss sum, scalar, carries the gradient
    nll: torch.Tensor  # negative log-likelihood sum, scalar, detached
    tokens: int  # real target tokens scored


class Seq2SeqLoss(nn.Module):
    """`forward(src_ids (B,S), tgt_in_ids (B,T), labels (B,T)) -> LossSums` of any model following the contract
    `model(src_ids, tgt_in_ids) -> logits (B, T, V)`.

    Args:
        model: the model; its `packed_loss(src_ids, tgt_in_ids, labels, label_smoothing)` is used when present.
        label_smoothing: epsilon of the smoothed loss (the nll is always unsmoothed).
        flat_state_dict: state dicts without the `model.` prefix (off under FSDP, whose sharded checkpoints
            name parameters by their path from the wrapped root).
    """

    def __init__(self, model: nn.Module, label_smoothing: float = 0.0, flat_state_dict: bool = True):
        super().__init__()
        self.model = model
        self.label_smoothing = float(label_smoothing)
        self.pad_id = special_id(model, "pad_id")
        if flat_state_dict:
            self.register_state_dict_post_hook(_drop_prefix)
            self.register_load_state_dict_pre_hook(_add_prefix)
            self.register_load_state_dict_post_hook(_report_without_prefix)

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, labels: torch.Tensor) -> LossSums:
        packed = getattr(self.model, "packed_loss", None)
        if packed is not None:
            return LossSums(*packed(src_ids, tgt_in_ids, labels, self.label_smoothing))
        logits = self.model(src_ids, tgt_in_ids)  # (B, T, V)
        return LossSums(*label_smoothed_nll(logits, labels, self.pad_id, self.label_smoothing))


def _drop_prefix(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_prefix(module, state_dict, prefix, *args) -> None:
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def _report_without_prefix(module, incompatible) -> None:
    """Missing/unexpected keys named as in the flat state dict (safetensors' load_model matches them so)."""
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [_INNER.sub(r"\1", k, count=1) for k in keys]


def unwrap_objective(module: nn.Module) -> nn.Module:
    """The plain model inside a (possibly already unwrapped) `Seq2SeqLoss`; other modules as they are."""
    return module.model if isinstance(module, Seq2SeqLoss) else module
