"""Ensembles: several models with one vocabulary decoded as one, their log-probabilities averaged per step.

`Ensemble([a, b])` goes wherever a model goes in `nmt.search` (greedy, beam, sampling) and `nmt.score`:
each model keeps its own cache on the same fast path, and every step's next-token distribution is the
mean of the models' log-probabilities (a product of experts, as OpenNMT-py and Marian ensemble),
renormalised. `nmt average` is the weight-space alternative: one model, one model's cost.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from nmt.decoder import Decoder
from nmt.errors import NmtError


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
    """The models' decoders stepped together (`nmt.decoder` interface)."""

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
