"""Translating text with a trained model directory: token-budget batches, output in input order.

`Translator.from_pretrained(d).translate([...])` is the Python entry; `translate_stream` keeps
memory flat on inputs of any size by working through them a chunk at a time.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from nmt.batching import eval_batches
from nmt.collate import pad
from nmt.model import Seq2SeqTransformer
from nmt.search import Hypothesis, SearchConfig, beam_search
from nmt.tokenizer import PairTokenizer

log = logging.getLogger(__name__)


def search_encoded(model, src_ids: list[list[int]], search: SearchConfig, batch_tokens: int,
                   rank: int = 0, world_size: int = 1, device=None) -> dict[int, list[Hypothesis]]:
    """Hypotheses for this process's share of `src_ids`, keyed by input position.

    Inputs are sorted by length into batches of at most `batch_tokens` padded source tokens, and the
    batches dealt round robin to `world_size` processes: each input is decoded exactly once overall.
    """
    out: dict[int, list[Hypothesis]] = {}
    lengths = [len(s) for s in src_ids]
    for batch in eval_batches(lengths, batch_tokens, rank, world_size):
        ids = pad([src_ids[i] for i in batch]).to(device)
        for i, hyps in zip(batch.tolist(), beam_search(model, ids, search)):
            out[i] = hyps
    return out


class Translator:
    """A trained model and its tokenizer, ready to translate sentences."""

    def __init__(self, model: Seq2SeqTransformer, tokenizer: PairTokenizer, device: str | torch.device = "cpu"):
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> "Translator":
        """Load config.json, model.safetensors and tokenizer.json from a model directory."""
        directory = Path(directory)
        model = Seq2SeqTransformer.from_pretrained(directory)
        tokenizer = PairTokenizer.load(directory).without_dropout()
        _check_vocab(model, tokenizer, directory)
        return cls(model, tokenizer, device)

    def translate(self, texts: list[str], beam_size: int = 4, nbest: int = 1, batch_tokens: int = 4096,
                  **search_kwargs) -> list[str] | list[list[tuple[str, float]]]:
        """Translate sentences; returns strings, or (translation, score) lists when nbest > 1."""
        search = SearchConfig(beam_size=beam_size, nbest=nbest, **search_kwargs)
        src_ids = [self._fit(ids) for ids in self.tokenizer.encode_src(list(texts))]
        with torch.inference_mode():
            found = search_encoded(self.model, src_ids, search, batch_tokens, device=self.device)
        hyps = [found[i] for i in range(len(src_ids))]
        if nbest == 1:
            return self.tokenizer.decode_tgt([h[0].tokens for h in hyps])
        return [list(zip(self.tokenizer.decode_tgt([h.tokens for h in hs]), [h.score for h in hs])) for hs in hyps]

    def translate_stream(self, lines: Iterable[str], chunk_size: int = 2000, **kwargs) -> Iterator[str]:
        """Translate an iterable of lines of any length, yielding outputs in input order."""
        chunk: list[str] = []
        for line in lines:
            chunk.append(line.rstrip("\r\n"))
            if len(chunk) == chunk_size:
                yield from self._flat(self.translate(chunk, **kwargs))
                chunk = []
        if chunk:
            yield from self._flat(self.translate(chunk, **kwargs))

    @staticmethod
    def _flat(outputs) -> Iterator[str]:
        for out in outputs:
            yield out if isinstance(out, str) else "\t".join(f"{t}\t{s:.4f}" for t, s in out)

    def _fit(self, ids: list[int]) -> list[int]:
        """Truncate a source longer than the model's positions (keeping </s>), with a warning."""
        limit = self.model.cfg.max_positions
        if len(ids) <= limit:
            return ids
        log.warning("a source sentence of %d subwords was truncated to model.max_positions=%d", len(ids), limit)
        return ids[: limit - 1] + ids[-1:]


def _check_vocab(model: Seq2SeqTransformer, tokenizer: PairTokenizer, directory: Path) -> None:
    from nmt.errors import NmtError

    if (model.cfg.src_vocab_size, model.cfg.tgt_vocab_size) != (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size):
        raise NmtError(f"{directory}: the tokenizer ({tokenizer.src_vocab_size}/{tokenizer.tgt_vocab_size} "
                       f"tokens) does not match the model ({model.cfg.src_vocab_size}/{model.cfg.tgt_vocab_size}); "
                       "copy the tokenizer that the model was trained with")
