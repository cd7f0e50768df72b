"""The batching chapter: how encoded pairs become the batches a step trains on, cut the same way for any number of
processes.

In reading order: token-budget batches with length bucketing (`TokenBatchSampler`): each optimizer step consumes
one *global batch* of pairs of similar length whose padded size fits `max_tokens * world_size * accum_steps`,
dealt into world_size * accum_steps chunks; process r takes chunk a * world_size + r at micro-step a, so 1 process
with accumulation and N processes see exactly the same pairs per optimizer step, and every pair once per epoch.
Then the collator: encoded pairs in, batch-leading LongTensors out, never masks (the model derives them from
`pad_id`). Last, BPE-dropout: the training split re-segmented each epoch (`DropoutEpochs`) and the DataLoader
dataset that reads the epoch in use. The data layer (datasets) is imported only where an epoch is re-segmented.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nmt.compat import dataset_fingerprint
from nmt.config import TrainConfig
from nmt.tokenizer import BOS, EOS, PAD, DropoutSegmenter, PairTokenizer

if TYPE_CHECKING:  # the data layer loads only where an epoch is re-segmented, torch at the first batch
    import datasets
    import torch

    from nmt.data import Corpus


# --- Token-budget batches --------------------------------------------------------------------------------------------


def global_batches(lengths: np.ndarray, budget: int, min_size: int, seed: int | None,
                   ties: np.ndarray | None = None) -> list[np.ndarray]:
    """Group example indices into batches whose count * max length stays within `budget`.

    Args:
        lengths: (N,) padded cost per example, e.g. max(source, target) length.
        budget: padded tokens per global batch.
        min_size: every batch holds at least this many examples (one per chunk).
        seed: shuffles ties inside lengths and the batch order; None keeps sorted order.
        ties: (N,) a second length that orders examples of equal cost (then the seed's shuffle). With
            cost = max(source, target + 1), nearly always the target side, equal-cost buckets mix all source
            lengths; ordering them by source length makes both sides of a batch alike (on Tatoeba en-de:
            source padding 15.7% -> 3.9%, benchmarks/padding.py).

    Returns:
        Batches of indices sorted by length inside each batch, in (shuffled) batch order.

    A last batch (the longest pairs) of fewer than `min_size` pairs joins its neighbour: each chunk needs a pair.
    The batch order is drawn before that join, so that one process and N processes (min_size 1 and N) differ in
    that one step only, the other steps coming in the same order.
    """
    rng = np.random.default_rng(seed) if seed is not None else None
    lengths = np.asarray(lengths)
    order = _sorted_order(lengths, None if ties is None else np.asarray(ties), rng)
    batches = [order[start:end] for start, end in _cuts(lengths, order, budget, min_size)]
    places = np.arange(len(batches)) if rng is None else rng.permutation(len(batches))
    if len(batches) > 1 and len(batches[-1]) < min_size:  # a short tail joins its neighbour, in the neighbour's place
        batches[-2] = np.concatenate(batches[-2:])
        places = places[places != len(batches) - 1]
    return [batches[i] for i in places]


def _sorted_order(lengths: np.ndarray, ties: np.ndarray | None, rng: np.random.Generator | None) -> np.ndarray:
    """Indices by length, then ties, then a random order (the place in `rng.permutation(n)`; none: the index)."""
    perm = np.arange(len(lengths)) if rng is None else rng.permutation(len(lengths))
    keys = [lengths[perm]] if ties is None else [ties[perm], lengths[perm]]
    return perm[np.lexsort(keys)]  # stable: equal keys keep their place in perm


def _cuts(lengths: np.ndarray, order: np.ndarray, budget: int, min_size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each batch over the sorted lengths lengths[order], greedily: the largest end with
    (end - start) * lengths[order[end - 1]] <= budget, at least min_size examples.

    Lengths ascend, so a batch [s, j] fits exactly when g(j) = j + 1 - budget // length[j] <= s, and g strictly
    increases: each cut is one binary search.
    """
    n = len(order)
    limit = np.arange(1, n + 1) - budget // np.maximum(lengths[order], 1).astype(np.int64)
    start = 0
    while start < n:
        end = min(max(int(np.searchsorted(limit, start, side="right")), start + min_size), n)
        yield start, end
        start = end


def deal(batch: np.ndarray, n_chunks: int) -> list[np.ndarray]:
    """Deal a length-sorted batch into n_chunks chunks of similar length (round robin)."""
    return [batch[i::n_chunks] for i in range(n_chunks)]


@dataclass
class EpochPlan:
    """The global batches of one epoch and this process's share of each."""

    batches: list[np.ndarray]
    rank: int
    world_size: int
    accum_steps: int

    def __len__(self) -> int:
        return len(self.batches)

    def micro_batches(self, step: int) -> list[np.ndarray]:
        """This process's accum_steps chunks of global batch `step`."""
        chunks = deal(self.batches[step], self.world_size * self.accum_steps)
        return [chunks[a * self.world_size + self.rank] for a in range(self.accum_steps)]


class TokenBatchSampler:
    """A batch sampler for `torch.utils.data.DataLoader`: yields this process's index lists.

    Stateful: `state_dict()` holds the epoch and the position inside it, so a resumed run
    continues with the very next micro-batch. Reshuffles each epoch from `seed + epoch`. `ties` (e.g. the
    source lengths) orders pairs of equal length inside the buckets: see `global_batches`.
    `epoch_lengths(epoch)`, when given, returns the (lengths, ties) that replace them for planning that epoch
    (pairs re-segmented each epoch by BPE-dropout); `epoch_rows(epoch)`, the indices an epoch reads (several
    corpora mixed, `nmt.mixing.Mixing`; repeats allowed), else every index once. Both must give the same on every
    process.
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, rank: int = 0, world_size: int = 1,
                 accum_steps: int = 1, seed: int | None = 0, ties: Sequence[int] | None = None,
                 epoch_lengths: Callable[[int], tuple[Sequence[int], Sequence[int] | None]] | None = None,
                 epoch_rows: Callable[[int], np.ndarray] | None = None):
        self.lengths = np.asarray(lengths)
        self.epoch_lengths, self.epoch_rows = epoch_lengths, epoch_rows
        self.ties = None if ties is None else np.asarray(ties)  # see global_batches
        self.max_tokens, self.rank, self.world_size = max_tokens, rank, world_size
        self.accum_steps, self.seed = accum_steps, seed
        self.epoch, self.step_in_epoch = 0, 0
        self._plan: EpochPlan | None = None  # the last epoch planned (its number in ._planned)
        self._planned = -1
        n_chunks = world_size * accum_steps
        if len(self.lengths) < n_chunks:
            from nmt.errors import NmtError
            raise NmtError(f"only {len(self.lengths)} training pairs for {n_chunks} micro-batches per step "
                           f"({world_size} processes x {accum_steps} accum_steps); use more data or fewer")

    def plan(self, epoch: int) -> EpochPlan:
        """The batches of `epoch`, built once (NumPy: a sort and one pass) and kept until another epoch is asked."""
        if self._plan is None or self._planned != epoch:
            self._plan, self._planned = self._build_plan(epoch), epoch
        return self._plan

    def _build_plan(self, epoch: int) -> EpochPlan:
        n_chunks = self.world_size * self.accum_steps
        seed = None if self.seed is None else self.seed + epoch
        lengths, ties = self.lengths, self.ties
        if self.epoch_lengths is not None:
            lengths, ties = self.epoch_lengths(epoch)
            lengths, ties = np.asarray(lengths), None if ties is None else np.asarray(ties)
        rows = None if self.epoch_rows is None else self.epoch_rows(epoch)
        if rows is not None:
            lengths, ties = lengths[rows], None if ties is None else ties[rows]
        batches = global_batches(lengths, self.max_tokens * n_chunks, n_chunks, seed, ties)
        if rows is not None:
            batches = [rows[b] for b in batches]
        return EpochPlan(batches, self.rank, self.world_size, self.accum_steps)

    def steps_per_epoch(self, epoch: int | None = None) -> int:
        """Optimizer steps of `epoch` (default: the current one); the same for every epoch unless
        `epoch_lengths` varies."""
        return len(self.plan(self.epoch if epoch is None else epoch))

    def __iter__(self) -> Iterator[list[int]]:
        """Micro-batches from the current position to the end of the epoch, then the epoch advances."""
        plan = self.plan(self.epoch)
        while self.step_in_epoch < len(plan):
            micro = plan.micro_batches(self.step_in_epoch)
            self.step_in_epoch += 1  # counted before yielding: a checkpoint taken now resumes after it
            for chunk in micro:
                yield chunk.tolist()
        self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def __len__(self) -> int:
        return (len(self.plan(self.epoch)) - self.step_in_epoch) * self.accum_steps

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])


def eval_batches(lengths: Sequence[int], max_tokens: int, rank: int, world_size: int) -> list[np.ndarray]:
    """Length-sorted batches for evaluation, dealt round robin to processes; each index once."""
    batches = global_batches(np.asarray(lengths, dtype=np.int64), max_tokens, 1, None)
    return batches[rank::world_size]


# --- The collator ----------------------------------------------------------------------------------------------------
# The collator: encoded pairs in, batch-leading LongTensors out. Nothing else.
#
# It never builds masks: the model derives them from `pad_id`, so no tensor whose dim 0 is not
# the batch ever exists to be cut wrongly by a scatter (the nn.DataParallel mask bug).

def pad(rows: list[list[int]], pad_id: int = PAD, multiple_of: int | None = None) -> torch.Tensor:
    """(B, L) LongTensor right-padded to the longest row (rounded up to `multiple_of`)."""
    import torch  # here, not at the top: data preparation and the epoch plan use this module without a model

    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    return torch.from_numpy(_placed(rows, lengths, pad_id, _rounded(int(lengths.max(initial=0)), multiple_of)))


def _rounded(length: int, multiple_of: int | None) -> int:
    return -(-length // multiple_of) * multiple_of if multiple_of else length


def _placed(rows, lengths: np.ndarray, pad_id: int, width: int, start: int = 0) -> np.ndarray:
    """(B, width) int64 of `pad_id` with each row's ids at columns start .. start + its length: every id read once,
    in one pass over all the rows (no loop over rows in Python: a GPU's micro-batch of ~300 rows is collated in
    about the time the GPU takes to compute it)."""
    out = np.full((len(rows), width), pad_id, dtype=np.int64)
    total = int(lengths.sum())
    if total:
        ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)
        columns = np.arange(width)
        out[(columns >= start) & (columns < start + lengths[:, None])] = ids  # row by row, left to right: ids' order
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
        import torch

        src = [ex["src_ids"] for ex in examples]
        tgt = [ex["tgt_ids"] for ex in examples]
        lengths = np.fromiter(map(len, tgt), dtype=np.int64, count=len(tgt))
        width = _rounded(int(lengths.max()) + 1, self.multiple_of) if len(tgt) else 0  # the longest, <s> or </s>
        tgt_in = _placed(tgt, lengths, self.pad_id, width, start=1)
        tgt_in[:, :1] = self.bos_id  # <s> + target
        labels = _placed(tgt, lengths, self.pad_id, width)
        labels[np.arange(len(tgt)), lengths] = self.eos_id  # target + </s>
        return {"src_ids": pad(src, self.pad_id, self.multiple_of),  # (B, S)
                "tgt_in_ids": torch.from_numpy(tgt_in), "labels": torch.from_numpy(labels)}  # (B, T)

    def columns(self, rows: dict[str, list]) -> dict[str, torch.Tensor]:
        """The batch of `rows` given column-wise, as a Dataset returns them for a list of indices
        (`ds[indices]`: {"src_ids": [[...], ...], "tgt_ids": [[...], ...]})."""
        return self([{"src_ids": s, "tgt_ids": t} for s, t in zip(rows["src_ids"], rows["tgt_ids"])])


# --- BPE-dropout epochs ----------------------------------------------------------------------------------------------
# BPE-dropout: the training split re-segmented each epoch (`DropoutEpochs`), and the DataLoader dataset that
# reads the epoch in use (`EpochView`).


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
        from nmt.encoding import pair_lengths
        from nmt.tables import column

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
    from nmt.encoding import pair_cost

    src_ids, tgt_ids, cost = [], [], []
    for i, src, tgt, plain_src, plain_tgt in zip(indices, batch["src"], batch["tgt"], batch["src_ids"], batch["tgt_ids"]):
        rng = random.Random(f"{epoch_seed}:{i}")  # str seeds hash with SHA-512: the same in every process
        s, t = segmenters[0].encode(src, rng) + [EOS], segmenters[1].encode(tgt, rng, leading_tags=False)
        if pair_cost(s, t) > max_cost:
            s, t = plain_src, plain_tgt
        src_ids.append(s)
        tgt_ids.append(t)
        cost.append(pair_cost(s, t))
    return {"src_ids": src_ids, "tgt_ids": tgt_ids, "cost": cost, "src_len": [len(s) for s in src_ids],
            "tgt_len": [len(t) + 1 for t in tgt_ids]}
