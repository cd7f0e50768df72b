"""The engines a `Translator` searches with: encoded ids in, hypotheses out.

An engine is what decodes: `search` (the hypotheses of encoded sources, keyed by position), `score` (the
log-probabilities of given targets), `cross_attentions` (how a target reads its source, to place markup) and
`supports(feature)`, which the `Translator` asks instead of testing which engine it holds. Text in and text out
(tokenising, cutting long inputs, documents, markup, the order of the outputs) is the Translator's.

Two engines: `TorchEngine`, nmt's own search over a `Seq2SeqTransformer` (or an `Ensemble` of them), which
supports everything, and `nmt.ct2.CT2Model`, a CTranslate2 export, which searches and places markup only.
"""

from __future__ import annotations

from typing import Protocol

import torch

from nmt.config import ModelConfig
from nmt.decoding import Ensemble, Hypothesis, SamplingConfig, Score, SearchConfig, score_encoded, search_encoded

# What an engine may support (`Engine.supports`), each named by what a caller asks of it:
GLOSSARY = "glossary"  # a constrained search that writes given target terms (`nmt.constraints`)
SCORE = "score"  # the log-probabilities of given targets (`Translator.score`, `nmt score`)
ATTENTION = "attention"  # one model's attention picture of a translation (`Translator.attention`)
TARGET_CHOICE = "target choice"  # a first target token chosen per call (an imported M2M100/NLLB's language)


class Engine(Protocol):
    """What a `Translator` decodes with."""

    name: str  # "torch" or "ctranslate2": what `nmt serve`'s /info reports

    @property
    def cfg(self) -> ModelConfig: ...

    def supports(self, feature: str) -> bool: ...

    def search(self, src_ids: list[list[int]], search: SearchConfig, batch_tokens: int,
               sampling: SamplingConfig | None = None, terms: list[list[list[int]]] | None = None,
               joins: torch.Tensor | None = None, cancelled=None,
               logprobs: bool = False) -> dict[int, list[Hypothesis]]:
        """Hypotheses of each source (ids ending in </s>), keyed by position; with `logprobs` each hypothesis'
        `logprob` is its tokens' log-probability, </s> included."""
        ...

    def score(self, src_ids: list[list[int]], tgt_ids: list[list[int]], batch_tokens: int) -> list[Score]: ...

    def cross_attentions(self, src_ids: list[list[int]], tgt_ids: list[list[int]], layer: int = -1) -> list[torch.Tensor]:
        """Per pair, the (T_i, S_i) cross-attention of decoder layer `layer`, heads averaged, with which the model
        reads target `tgt_ids[i]` (ending in </s>) after source `src_ids[i]`."""
        ...


class TorchEngine:
    """nmt's own search (`nmt.decoding`) over a `Seq2SeqTransformer` or an `Ensemble`, on `device`."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def supports(self, feature: str) -> bool:
        return feature != ATTENTION or not isinstance(self.model, Ensemble)  # a picture is one model's

    def search(self, src_ids, search, batch_tokens, sampling=None, terms=None, joins=None, cancelled=None,
               logprobs=False) -> dict[int, list[Hypothesis]]:
        with torch.inference_mode():  # nmt's search sums every hypothesis' log-probability as it goes
            return search_encoded(self.model, src_ids, search, batch_tokens, device=self.device, sampling=sampling,
                                  terms=terms, joins=joins, cancelled=cancelled)

    def score(self, src_ids, tgt_ids, batch_tokens) -> list[Score]:
        with torch.inference_mode():
            return score_encoded(self.model, src_ids, tgt_ids, batch_tokens, self.device)

    def cross_attentions(self, src_ids, tgt_ids, layer: int = -1) -> list[torch.Tensor]:
        """An ensemble's first model's."""
        from nmt.attention import cross_attentions

        with torch.inference_mode():
            return cross_attentions(getattr(self.model, "models", [self.model])[0], src_ids, tgt_ids, layer)
