"""Token-budget batches with length bucketing, cut the same way for any number of processes.

Each optimizer step consumes one *global batch* of pairs of similar length whose padded size fits
`max_tokens * world_size * accum_steps`. The global batch is dealt into world_size * accum_steps
chunks; process r takes chunk a * world_size + r at micro-step a. So 1 process with accumulation
and N processes see exactly the same pairs per optimizer step, and every pair once per epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np


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
    """
    rng = np.random.default_rng(seed) if seed is not None else None
    lengths = np.asarray(lengths)
    order = _sorted_order(lengths, None if ties is None else np.asarray(ties), rng)
    batches = [order[start:end] for start, end in _cuts(lengths, order, budget, min_size)]
    if len(batches) > 1 and len(batches[-1]) < min_size:  # a short tail joins its neighbour
        batches[-2:] = [np.concatenate(batches[-2:])]
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


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
    corpora mixed, `nmt.data.Mixing`; repeats allowed), else every index once. Both must give the same on every
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
