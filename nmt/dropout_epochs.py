"""BPE-dropout: the training split re-segmented each epoch (`DropoutEpochs`), and the DataLoader dataset that
reads the epoch in use (`EpochView`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import datasets
import numpy as np

from nmt.compat import dataset_fingerprint
from nmt.config import TrainConfig
from nmt.encoding import pair_cost, pair_lengths
from nmt.tables import column
from nmt.tokenizer import EOS, DropoutSegmenter, PairTokenizer

if TYPE_CHECKING:
    from nmt.data import Corpus


class DropoutEpochs:
    """The training split re-segmented with BPE-dropout (Provilkov et al. 2020) for every epoch.

    Pair i of epoch e is segmented by a generator seeded with (seed, e, i): an epoch's segmentation is the
    same on every process, in a resumed run and however the batches are cut, and differs between epochs.
    Each process encodes the epoch it is in by itself (no cache to share, nothing to wait for) and keeps
    that one; the lengths of the epochs seen are kept for batch planning. A pair whose noisy segmentation
    would be longer than `max_cost` keeps its deterministic one. Validation and test are never touched.
    """

    def __init__(self, train: datasets.Dataset, tokenizer: PairTokenizer, p: float, seed: int, max_cost: int):
        self.train, self.p, self.seed, self.max_cost = train, p, seed, max_cost
        self.segmenters = DropoutSegmenter(tokenizer.src, p), DropoutSegmenter(tokenizer.tgt, p)
        self._lengths: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._epoch: tuple[int, datasets.Dataset] | None = None

    def encoded(self, epoch: int) -> datasets.Dataset:
        """Columns src_ids and tgt_ids of `epoch`'s segmentation (in memory)."""
        if self._epoch is None or self._epoch[0] != epoch:
            ds = self.train.map(_dropout_batch, batched=True, batch_size=1000, with_indices=True, keep_in_memory=True,
                                fn_kwargs={"segmenters": self.segmenters, "epoch_seed": f"{self.seed}:{epoch}",
                                           "max_cost": self.max_cost},
                                new_fingerprint=f"{dataset_fingerprint(self.train)}-dropout-{self.p}-{self.seed}-{epoch}")
            self._epoch = epoch, ds.select_columns(["src_ids", "tgt_ids"])
            self._lengths[epoch] = column(ds, "cost"), pair_lengths(ds)[0]
        return self._epoch[1]

    def lengths(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(N,) padded cost and (N,) source length of every pair in `epoch`'s segmentation: what the batch
        sampler plans that epoch with (`TokenBatchSampler.epoch_lengths`)."""
        if epoch not in self._lengths:
            self.encoded(epoch)
        return self._lengths[epoch]

    def view(self, epoch: Callable[[], int]) -> EpochView:
        """A map-style dataset for a DataLoader, reading the epoch that `epoch()` names at each fetch."""
        return EpochView(self, epoch)


def bpe_dropout(cfg: TrainConfig, corpus: Corpus) -> DropoutEpochs | None:
    """The training pairs re-segmented each epoch when tokenizer.dropout is set; None when it is off."""
    if not cfg.tokenizer.dropout:
        return None
    return DropoutEpochs(corpus.splits["train"], corpus.tokenizer, cfg.tokenizer.dropout, cfg.seed,
                         max_cost=min(cfg.data.max_subwords, cfg.model.max_positions))


@dataclass
class EpochView:
    """DataLoader dataset over `DropoutEpochs`; `epoch` is the batch sampler's (read in the loading process,
    so the DataLoader must run without worker processes, as nmt.train's does)."""

    epochs: DropoutEpochs
    epoch: Callable[[], int]

    def __len__(self) -> int:
        return len(self.epochs.train)

    def __getitems__(self, indices: list[int]) -> list[dict]:
        return self.epochs.encoded(self.epoch()).__getitems__(indices)

    def __getitem__(self, index: int) -> dict:
        return self.__getitems__([index])[0]


def _dropout_batch(batch: dict, indices: list[int], segmenters: tuple[DropoutSegmenter, DropoutSegmenter],
                   epoch_seed: str, max_cost: int) -> dict:
    src_ids, tgt_ids, cost = [], [], []
    for i, src, tgt, plain_src, plain_tgt in zip(indices, batch["src"], batch["tgt"], batch["src_ids"], batch["tgt_ids"]):
        rng = random.Random(f"{epoch_seed}:{i}")  # str seeds hash with SHA-512: the same in every process
        s, t = segmenters[0].encode(src, rng) + [EOS], segmenters[1].encode(tgt, rng)
        if pair_cost(s, t) > max_cost:
            s, t = plain_src, plain_tgt
        src_ids.append(s)
        tgt_ids.append(t)
        cost.append(pair_cost(s, t))
    return {"src_ids": src_ids, "tgt_ids": tgt_ids, "cost": cost, "src_len": [len(s) for s in src_ids],
            "tgt_len": [len(t) + 1 for t in tgt_ids]}
