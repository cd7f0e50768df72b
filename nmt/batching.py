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

CHUNK = 1 << 16  # pairs per pass of the plan's element-wise work: temporaries of 0.5 MiB, not of the corpus


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


def narrow(values) -> np.ndarray:
    """(N,) lengths in the smallest integer type that holds them (uint8 or uint16 for subword counts): what a
    sampler keeps for the whole run, 2 bytes a pair instead of 8."""
    values = np.asarray(values)
    if values.dtype.kind not in "iu":
        values = values.astype(np.int64)
    if len(values) == 0:
        return values.astype(np.int64, copy=False)
    return values.astype(narrow_type(int(values.min()), int(values.max())), copy=False)


def narrow_type(low: int, high: int) -> np.dtype:
    """The type `narrow` gives integers from `low` to `high`: unsigned and as small as it can be, else int64."""
    return np.dtype(np.int64) if low < 0 else np.min_scalar_type(high)


def index_type(n: int) -> type:
    """The integer type for indices into n elements: int32 while it holds them (half of int64's bytes)."""
    return np.int32 if n < 2**31 else np.int64


def _spans(n: int) -> Iterator[tuple[int, int]]:
    """[start, end) of each CHUNK of range(n): the element-wise passes' temporaries are a chunk's, not the corpus's."""
    return ((start, min(n, start + CHUNK)) for start in range(0, n, CHUNK))


def true_indices(mask: np.ndarray) -> np.ndarray:
    """np.flatnonzero(mask) in `index_type`, found chunk by chunk: 4 bytes a True, no int64 or whole-range copy."""
    out, at = np.empty(int(np.count_nonzero(mask)), dtype=index_type(len(mask))), 0
    for start, end in _spans(len(mask)):
        found = np.flatnonzero(mask[start: end]) + start
        out[at: at + len(found)] = found
        at += len(found)
    return out


def _sorted_order(lengths: np.ndarray, ties: np.ndarray | None, rng: np.random.Generator | None) -> np.ndarray:
    """Indices by length, then ties, then a random order.

    perm[k] is the example at place k of the random order. When the keys fit in 63 bits, place k's keys and k
    itself are packed into one integer (chunk by chunk); sorting those values (not an argsort) and reading k back
    gives perm[k], written over the sorted values' own memory: about 0.1 s for 3M pairs, and at the peak 12 bytes
    a pair (the packed values, the permutation), 4 kept (the order).
    """
    n = len(lengths)
    perm = np.arange(n, dtype=index_type(n))
    if rng is not None:
        rng.shuffle(perm)  # the same draws, so the same order, as rng.permutation(n)
    keys = [lengths, *([] if ties is None else [ties])]
    bits = [max(int(k.max(initial=0)), 1).bit_length() for k in keys] + [max(n - 1, 1).bit_length()]
    if n == 0 or min(int(k.min()) for k in keys) < 0 or sum(bits) > 63:
        return perm[np.lexsort([k[perm] for k in keys[::-1]])]  # stable, so equal keys keep place order
    packed = np.empty(n, dtype=np.int64)
    for start, end in _spans(n):
        at = perm[start: end]
        values = np.zeros(len(at), dtype=np.int64)
        for key, width in zip(keys, bits):
            np.left_shift(values, width, out=values)
            np.bitwise_or(values, key[at], out=values, casting="unsafe")
        np.left_shift(values, bits[-1], out=values)
        packed[start: end] = values | np.arange(start, end, dtype=np.int64)
    packed.sort()
    return _read_back(perm, packed, (1 << bits[-1]) - 1)


def _read_back(perm: np.ndarray, packed: np.ndarray, mask: int) -> np.ndarray:
    """perm[packed & mask]: int32 indices written chunk by chunk into the first half of `packed`'s memory (chunk
    [s, e) lands in bytes [4s, 4e), inside the values [0, e) already read), whose second half is then handed back."""
    n = len(packed)
    if perm.dtype != np.int32:
        np.bitwise_and(packed, mask, out=packed)
        return perm[packed]
    slots = packed.view(np.int32)
    for start, end in _spans(n):
        slots[start: end] = perm[packed[start: end] & mask]
    del slots
    packed.resize((n + 1) // 2, refcheck=False)  # no view of it is left: `slots` is gone
    return packed.view(np.int32)[:n]


def _cuts(lengths: np.ndarray, order: np.ndarray, budget: int, min_size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each batch over the sorted lengths lengths[order], greedily: the largest end with
    (end - start) * lengths[order[end - 1]] <= budget, at least min_size examples.

    Lengths ascend, so a batch [s, j] fits exactly when g(j) = j + 1 - budget // length[j] <= s, and g strictly
    increases: each cut is one binary search (~20k of them for 3M pairs in 4,096-token batches). g is built chunk
    by chunk (4 bytes a pair, no sorted copy of the lengths).
    """
    n = len(order)
    limit = np.empty(n, dtype=index_type(max(n + 1, budget)))
    for start, end in _spans(n):
        part = np.maximum(lengths[order[start: end]], 1).astype(limit.dtype)
        np.floor_divide(budget, part, out=part)
        np.subtract(np.arange(start + 1, end + 1, dtype=limit.dtype), part, out=limit[start: end])
    start, as_limit = 0, limit.dtype.type  # a scalar of the array's type: no conversion of the array per search
    while start < n:
        end = min(max(int(np.searchsorted(limit, as_limit(start), side="right")), start + min_size), n)
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
        self.lengths = narrow(lengths)
        self.epoch_lengths, self.epoch_rows = epoch_lengths, epoch_rows
        self.ties = None if ties is None else narrow(ties)  # see global_batches
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
        lengths, ties = self.lengths, self.ties  # narrowed when stored
        if self.epoch_lengths is not None:
            lengths, ties = self.epoch_lengths(epoch)
            lengths, ties = narrow(lengths), None if ties is None else narrow(ties)
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
