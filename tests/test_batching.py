"""The token-budget sampler: every pair once per epoch, the same global batches however a step is split,
padded sizes within the budget, reshuffling per epoch, exact resume, and little padding; the collator: ids only,
shifted and padded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.batching import Collator, TokenBatchSampler, eval_batches, global_batches, pad
from nmt.errors import NmtError

PROPERTY = settings(max_examples=40, deadline=None)
lengths_st = st.lists(st.integers(1, 40), min_size=6, max_size=120)
layouts = st.sampled_from([(w, a) for w in (1, 2, 3) for a in (1, 2)])  # (world_size, accum_steps)


def epoch_steps(lengths, max_tokens: int, world: int, accum: int, seed: int | None = 0) -> list[list[list[int]]]:
    """One epoch as steps[step][chunk], chunk = micro-step a * world + rank (the order they are dealt in)."""
    per_rank = [list(TokenBatchSampler(lengths, max_tokens, r, world, accum, seed)) for r in range(world)]
    n_steps = len(per_rank[0]) // accum
    assert all(len(micro) == n_steps * accum for micro in per_rank)  # ranks never disagree on step count
    return [[per_rank[r][s * accum + a] for a in range(accum) for r in range(world)] for s in range(n_steps)]


def step_sets(steps) -> list[frozenset[int]]:
    return [frozenset(i for chunk in step for i in chunk) for step in steps]


@PROPERTY
@given(lengths=lengths_st, max_tokens=st.integers(8, 200), layout=layouts, seed=st.integers(0, 99))
def test_every_index_exactly_once_per_epoch(lengths, max_tokens, layout, seed):
    world, accum = layout
    steps = epoch_steps(lengths, max_tokens, world, accum, seed)
    seen = [i for step in steps for chunk in step for i in chunk]
    assert sorted(seen) == list(range(len(lengths)))
    assert all(len(chunk) > 0 for step in steps for chunk in step)  # no process ever idles in a step


@PROPERTY
@given(lengths=lengths_st, data=st.data(), seed=st.integers(0, 99))
def test_the_same_global_batches_however_a_step_is_split(lengths, data, seed):
    """(1 process, accum 2) and (2 processes, accum 1) see exactly the same pairs per step. One process
    with twice the tokens and no accumulation differs only where the 2-chunk layout must merge a last
    batch of a single pair into its neighbour (each of 2 chunks needs a pair), in that one step, every other
    step coming in the same order; lengths <= max_tokens here."""
    max_tokens = data.draw(st.integers(max(lengths), 200), label="max_tokens")
    accum_steps = step_sets(epoch_steps(lengths, max_tokens, 1, 2, seed))
    assert step_sets(epoch_steps(lengths, max_tokens, 2, 1, seed)) == accum_steps
    double = step_sets(epoch_steps(lengths, 2 * max_tokens, 1, 1, seed))
    if double != accum_steps:  # the last batch (the longest pairs) is one pair, joined to one of the other steps
        tails = [t for t in double if len(t) == 1 and lengths[next(iter(t))] == max(lengths)]
        assert any([step | t if step == other else step for step in double if step != t] == accum_steps
                   for t in tails for other in double if other != t)


@PROPERTY
@given(lengths=lengths_st, max_tokens=st.integers(8, 200), layout=layouts)
def test_padded_sizes_stay_within_the_budget(lengths, max_tokens, layout):
    """What the sampler guarantees, exactly. A global batch of count pairs whose longest has L tokens has
    count * L <= max_tokens * n (n = world * accum chunks) unless (a) even n pairs overflow it (then it holds
    exactly n: one pair per chunk), or (b) it holds the longest pairs of the epoch and absorbed a tail of
    fewer than n of them. Dealt round robin, a chunk then holds floor or ceil of count / n pairs, so its
    padded size exceeds max_tokens by less than one pair: n * chunk_padded <= n * max_tokens + (n - 1) * L."""
    world, accum = layout
    n = world * accum
    lengths = np.array(lengths)
    longest = lengths.max()
    for step in epoch_steps(lengths, max_tokens, world, accum):
        batch = np.sort(np.concatenate(step).astype(int))
        by_length = batch[np.argsort(lengths[batch], kind="stable")]

        def fits(idx) -> bool:
            return len(idx) * lengths[idx].max() <= max_tokens * n or len(idx) == n

        tail_absorbed = lengths[batch].max() == longest and any(fits(by_length[:-t]) for t in range(1, n))
        assert fits(batch) or tail_absorbed
        sizes = [len(c) for c in step]
        assert max(sizes) - min(sizes) <= 1
        if fits(batch) and len(batch) > n:
            L = lengths[batch].max()
            assert all(n * len(c) * lengths[c].max() <= n * max_tokens + (n - 1) * L for c in step)  # n=1: exact


def test_a_single_overlong_pair_gets_a_batch_of_its_own():
    batches = global_batches(np.array([3, 3, 50, 4]), budget=10, min_size=1, seed=None)
    assert [b.tolist() for b in batches] == [[0, 1], [3], [2]]


def test_epochs_are_reshuffled_and_reproducible():
    lengths = np.random.default_rng(0).integers(1, 30, size=300)
    sampler = TokenBatchSampler(lengths, max_tokens=120, seed=5)
    first, second = list(sampler), list(sampler)  # iteration advances the epoch
    assert sampler.epoch == 2 and sorted(sum(first, [])) == sorted(sum(second, []))
    assert first != second
    assert list(TokenBatchSampler(lengths, max_tokens=120, seed=5)) == first  # same seed, same epoch 0
    assert list(TokenBatchSampler(lengths, max_tokens=120, seed=6)) != first
    unshuffled = list(TokenBatchSampler(lengths, max_tokens=120, seed=None))
    flat = sum(unshuffled, [])
    assert list(lengths[flat]) == sorted(lengths)  # seed=None: sorted order, batches in order


@PROPERTY
@given(lengths=lengths_st, max_tokens=st.integers(8, 200), layout=layouts, data=st.data())
def test_resume_yields_exactly_the_remaining_micro_batches(lengths, max_tokens, layout, data):
    """A checkpoint is taken between optimizer steps (after accum_steps micro-batches), in the first or
    second epoch; a fresh sampler loading its state yields exactly what an uninterrupted run would."""
    world, accum = layout
    rank = data.draw(st.integers(0, world - 1), label="rank")
    make = lambda: TokenBatchSampler(lengths, max_tokens, rank, world, accum, seed=3)
    reference = make()
    two_epochs = list(reference) + list(reference)  # iteration advances the epoch
    steps = len(two_epochs) // (2 * accum)
    done = data.draw(st.integers(0, 2 * steps), label="optimizer steps before the checkpoint")
    original, consumed = make(), []
    while len(consumed) < done * accum:
        for micro in original:  # resumes the current epoch where it stands
            consumed.append(micro)
            if len(consumed) == done * accum:
                break
    assert consumed == two_epochs[: done * accum]
    resumed = make()
    resumed.load_state_dict(original.state_dict())
    epoch, step = (0, done) if done <= steps else (1, done - steps)
    assert original.state_dict() == {"epoch": epoch, "step_in_epoch": step}
    assert len(resumed) == (steps - step) * accum
    replay = list(resumed) + list(resumed) + list(resumed)
    assert replay[: len(two_epochs) - done * accum] == two_epochs[done * accum :]


def test_resume_replays_nothing_and_skips_nothing():
    """A direct check of the resume arithmetic on a fixed layout (2 processes, accum 2)."""
    lengths = list(np.random.default_rng(1).integers(1, 20, size=80))
    full = list(TokenBatchSampler(lengths, 30, 1, 2, 2, seed=0))
    a = TokenBatchSampler(lengths, 30, 1, 2, 2, seed=0)
    it = iter(a)
    head = [next(it) for _ in range(4)]  # two optimizer steps
    b = TokenBatchSampler(lengths, 30, 1, 2, 2, seed=0)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == {"epoch": 0, "step_in_epoch": 2} and len(b) == len(full) - 4
    assert head + list(b) == full


def padding_fraction(chunks: list[list[int]], lengths: np.ndarray) -> float:
    real = sum(lengths[c].sum() for c in chunks)
    padded = sum(len(c) * lengths[c].max() for c in chunks)
    return 1 - real / padded


def test_bucketing_keeps_padding_under_five_percent():
    """Lognormal lengths (median ~20 tokens, long tail), 2 processes x 2 micro-steps of 1024 tokens.

    Padding falls as the corpus grows relative to a batch (more pairs of each length): 20k pairs gives
    ~1.6% here, 4k pairs ~6%; real corpora are far larger."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(mean=3.0, sigma=0.6, size=20_000).round(), 1, 250).astype(int)
    chunks = [c for r in range(2) for c in TokenBatchSampler(lengths, 1024, r, 2, 2, seed=0)]
    bucketed = padding_fraction(chunks, lengths)
    shuffled = rng.permutation(len(lengths))
    sizes = np.cumsum([len(c) for c in chunks])[:-1]
    random_chunks = [c.tolist() for c in np.split(shuffled, sizes)]  # the same chunk sizes, random members
    assert bucketed < 0.05
    assert padding_fraction(random_chunks, lengths) > 0.4


def test_eval_batches_cover_every_index_once_across_ranks():
    lengths = list(np.random.default_rng(2).integers(1, 50, size=97))
    for world in (1, 2, 3):
        seen = [i for r in range(world) for b in eval_batches(lengths, 100, r, world) for i in b.tolist()]
        assert sorted(seen) == list(range(97))
    batches = eval_batches(lengths, 100, 0, 1)
    assert all(len(b) * max(lengths[i] for i in b) <= 100 for b in batches)


def test_too_few_pairs_for_the_chunks_is_an_error():
    with pytest.raises(NmtError, match="micro-batches per step"):
        TokenBatchSampler([3, 4, 5], max_tokens=10, world_size=2, accum_steps=2)
    enough = TokenBatchSampler([3, 4, 5, 6], max_tokens=10, world_size=2, accum_steps=2)
    assert len(enough) == 2 and [len(c) for c in enough] == [1, 1]  # one step: a pair per micro-batch


def test_ties_order_equal_cost_pairs_by_the_second_length():
    """Pairs of equal cost are ordered by `ties` (the source length) inside the buckets, so a batch's source
    side is as alike as its cost; without ties the order inside a cost is the seed's shuffle."""
    rng = np.random.default_rng(3)
    cost = rng.integers(10, 13, size=600)  # three costs: target-dominated pairs
    src = rng.integers(1, 11, size=600)  # source lengths all over the place
    padding = lambda bs: sum(len(b) * src[b].max() - src[b].sum() for b in bs)
    with_ties = global_batches(cost, 120, 1, seed=4, ties=src)
    without = global_batches(cost, 120, 1, seed=4)
    for batches in (with_ties, without):
        assert sorted(np.concatenate(batches).tolist()) == list(range(600))
        assert all(len(b) * cost[b].max() <= 120 for b in batches)
    assert all(np.all(np.diff(src[b][cost[b] == cost[b].max()]) >= 0) for b in with_ties)
    assert padding(with_ties) < padding(without) / 3
    plan = TokenBatchSampler(cost, 60, 1, 2, 1, seed=4, ties=src).plan(0)
    assert [b.tolist() for b in plan.batches] == [b.tolist() for b in with_ties]


def test_epoch_lengths_plan_each_epoch_with_its_own_costs():
    """BPE-dropout: pairs get other lengths each epoch; each epoch's batches fit the budget with its lengths."""
    rng = np.random.default_rng(1)
    per_epoch = {e: rng.integers(1, 30, size=200) for e in range(3)}
    ties = {e: rng.integers(1, 30, size=200) for e in range(3)}
    asked = []
    sampler = TokenBatchSampler(per_epoch[0], max_tokens=90, seed=3, ties=ties[0],
                                epoch_lengths=lambda e: asked.append(e) or (per_epoch[e], ties[e]))
    for epoch in range(3):
        steps = list(sampler)
        assert sorted(sum(steps, [])) == list(range(200))
        assert all(len(b) * per_epoch[epoch][b].max() <= 90 for b in steps if len(b) > 1)
        plain = TokenBatchSampler(per_epoch[epoch], max_tokens=90, seed=3, ties=ties[epoch])
        plain.epoch = epoch
        assert steps == list(plain)  # the same plan as a sampler given that epoch's lengths
    assert sorted(set(asked)) == [0, 1, 2]  # (list() also asks len(), which plans the epoch again)
    assert sampler.steps_per_epoch(1) == len(TokenBatchSampler(per_epoch[1], 90, seed=4).plan(0))  # seed 3 + epoch 1
    stale = TokenBatchSampler(per_epoch[2], max_tokens=90, seed=3, ties=ties[0])
    stale.epoch = 2
    assert steps != list(stale)  # epoch 2 was ordered by its own ties, not epoch 0's


def reference_batches(lengths, budget, min_size, seed, ties=None) -> list[np.ndarray]:
    """The plain definition: lexsort by (length, ties, shuffle), then grow each batch while it fits."""
    lengths = np.asarray(lengths)
    rng = np.random.default_rng(seed) if seed is not None else None
    shuffle = np.arange(len(lengths))
    if rng is not None:
        shuffle[rng.permutation(len(lengths))] = np.arange(len(lengths))
    order = np.lexsort((shuffle, lengths) if ties is None else (shuffle, np.asarray(ties), lengths))
    batches, start = [], 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end + 1 - start) * lengths[order[end]] <= budget:
            end += 1
        end = min(max(end, start + min_size), len(order))
        batches.append(order[start:end])
        start = end
    order = rng.permutation(len(batches)) if rng is not None else range(len(batches))
    if len(batches) > 1 and len(batches[-1]) < min_size:
        batches[-2] = np.concatenate(batches[-2:])
        batches[-1] = None
    return [batches[i] for i in order if batches[i] is not None]


@PROPERTY
@given(lengths=lengths_st, budget=st.integers(1, 400), min_size=st.integers(1, 4),
       seed=st.one_of(st.none(), st.integers(0, 3)), with_ties=st.booleans())
def test_the_numpy_plan_equals_the_plain_definition(lengths, budget, min_size, seed, with_ties):
    ties = np.random.default_rng(0).integers(1, 30, len(lengths)) if with_ties else None
    fast = global_batches(np.asarray(lengths), budget, min_size, seed, ties)
    slow = reference_batches(lengths, budget, min_size, seed, ties)
    assert [b.tolist() for b in fast] == [b.tolist() for b in slow]


def test_an_epoch_is_planned_once_and_a_resume_does_not_replay_it(monkeypatch):
    lengths = np.random.default_rng(2).integers(1, 30, size=500)
    full = list(TokenBatchSampler(lengths, 60, seed=0))
    calls = []
    original = TokenBatchSampler._build_plan
    monkeypatch.setattr(TokenBatchSampler, "_build_plan", lambda self, e: calls.append(e) or original(self, e))
    resumed = TokenBatchSampler(lengths, 60, seed=0)
    resumed.load_state_dict({"epoch": 0, "step_in_epoch": 7})
    assert len(resumed) == len(full) - 7 and resumed.steps_per_epoch() == len(full)
    assert list(resumed) == full[7:]
    assert calls == [0]  # one plan of epoch 0: no batch before step 7 was built again, nor the plan re-made


# --- the collator --------------------------------------------------------------------------------------------------

PAD, BOS, EOS = 0, 2, 3
words = st.lists(st.integers(4, 50), max_size=9)  # real tokens never use the special ids
examples = st.lists(st.fixed_dictionaries({"src_ids": words.map(lambda w: [*w, EOS]), "tgt_ids": words}),
                    min_size=1, max_size=6)


def unpad(row: torch.Tensor) -> list[int]:
    tokens = row.tolist()
    return tokens[: len(tokens) - next((i for i, t in enumerate(reversed(tokens)) if t != PAD), len(tokens))]


@settings(max_examples=40, deadline=None)
@given(examples=examples, multiple_of=st.sampled_from([None, 1, 3, 8]))
def test_shift_and_padding_round_trip(examples, multiple_of):
    batch = Collator(pad_to_multiple_of=multiple_of)(examples)
    B = len(examples)
    assert set(batch) == {"src_ids", "tgt_in_ids", "labels"}
    assert all(v.dtype == torch.long and v.dim() == 2 and v.shape[0] == B for v in batch.values())
    m = multiple_of or 1
    S, T = max(len(ex["src_ids"]) for ex in examples), max(len(ex["tgt_ids"]) for ex in examples) + 1
    assert batch["src_ids"].shape[1] == -(-S // m) * m
    assert batch["tgt_in_ids"].shape == batch["labels"].shape == (B, -(-T // m) * m)
    for i, ex in enumerate(examples):
        n = len(ex["tgt_ids"]) + 1  # real positions: <s> + target / target + </s>
        src, tgt_in, labels = batch["src_ids"][i], batch["tgt_in_ids"][i], batch["labels"][i]
        assert unpad(src) == ex["src_ids"] and src[len(ex["src_ids"]) :].eq(PAD).all()
        assert tgt_in[:n].tolist() == [BOS, *ex["tgt_ids"]] and tgt_in[n:].eq(PAD).all()
        assert labels[:n].tolist() == [*ex["tgt_ids"], EOS] and labels[n:].eq(PAD).all()
        assert torch.equal(tgt_in[1:n], labels[: n - 1])  # the shift: the input at t+1 is the label at t
        assert int(labels.ne(PAD).sum()) == n and labels[n - 1] == EOS


def test_collator_uses_its_special_ids():
    examples = [{"src_ids": [5, 9], "tgt_ids": [4]}, {"src_ids": [9], "tgt_ids": []}]
    batch = Collator(pad_id=7, bos_id=8, eos_id=9)(examples)
    assert batch["src_ids"].tolist() == [[5, 9], [9, 7]]
    assert batch["tgt_in_ids"].tolist() == [[8, 4], [8, 7]]
    assert batch["labels"].tolist() == [[4, 9], [9, 7]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(3, 99), max_size=9), st.lists(st.integers(3, 99), max_size=9)),
                max_size=8), st.sampled_from([None, 1, 4, 8]))
def test_the_vectorised_collator_equals_padding_row_by_row(pairs, multiple_of):
    """Issue 46, part 2: the collator places every row's ids in one pass (no Python loop over rows); its tensors
    are those of padding each row in turn, <s> before and </s> after each target, rounded up alike."""
    def row_by_row(rows):
        width = max((len(r) for r in rows), default=0)
        width = -(-width // multiple_of) * multiple_of if multiple_of else width
        return [list(r) + [0] * (width - len(r)) for r in rows]

    batch = Collator(pad_id=0, bos_id=1, eos_id=2, pad_to_multiple_of=multiple_of)(
        [{"src_ids": s, "tgt_ids": t} for s, t in pairs])
    assert batch["src_ids"].tolist() == row_by_row([s for s, _ in pairs]) and batch["src_ids"].dtype == torch.long
    assert batch["tgt_in_ids"].tolist() == row_by_row([[1, *t] for _, t in pairs])
    assert batch["labels"].tolist() == row_by_row([[*t, 2] for _, t in pairs])


def test_pad_rounds_up_to_the_multiple():
    assert pad([[1, 2, 3], [4]], pad_id=0, multiple_of=4).tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert pad([[1, 2, 3, 4]], pad_id=0, multiple_of=4).shape == (1, 4)
    assert pad([[5], [6, 7]]).tolist() == [[5, 0], [6, 7]]


@pytest.mark.parametrize("accum", [1, 3])
def test_the_prefetcher_hands_windows_in_order_and_the_position_a_resume_continues_from(accum):
    """Windows are fetched on a thread ahead of the steps; each comes with the sampler's position after it, and a
    fresh loader started from that position hands the windows that followed it, across an epoch's end."""
    from torch.utils.data import DataLoader

    from nmt.training.loop import Prefetcher

    lengths = list(np.random.default_rng(2).integers(1, 12, size=60))
    pairs = [{"src_ids": list(range(4, 4 + n)), "tgt_ids": list(range(5, 5 + n))} for n in lengths]

    def feed(position=None):
        sampler = TokenBatchSampler(lengths, 40, accum_steps=accum, seed=1)
        if position:
            sampler.load_state_dict(position)
        return Prefetcher(DataLoader(pairs, batch_sampler=sampler, collate_fn=Collator()), sampler, accum), sampler

    prefetcher, sampler = feed()
    steps = 3 * sampler.steps_per_epoch()  # three epochs
    windows = [prefetcher.next() for _ in range(steps)]
    prefetcher.close()
    assert [position for _, position in windows][sampler.steps_per_epoch() - 1: sampler.steps_per_epoch() + 1] == [
        {"epoch": 0, "step_in_epoch": sampler.steps_per_epoch()}, {"epoch": 1, "step_in_epoch": 1}]
    assert all(len(window) == accum for window, _ in windows)
    for k in (0, sampler.steps_per_epoch() - 1, sampler.steps_per_epoch() + 2):
        resumed, _ = feed(windows[k][1])
        for window, position in windows[k + 1:]:
            again, where = resumed.next()
            assert where == position
            assert all(torch.equal(a[key], b[key]) for a, b in zip(window, again) for key in a)
        resumed.close()


def test_the_prefetchers_errors_reach_the_loop_and_closing_a_full_one_returns():
    from nmt.training.loop import Prefetcher

    class Broken:
        def __iter__(self):
            yield {"src_ids": torch.ones(1, 1)}
            raise NmtError("data/train.en: line 3 is not UTF-8")

    sampler = TokenBatchSampler([1, 2], 10)
    broken = Prefetcher(Broken(), sampler, 1)
    broken.next()
    with pytest.raises(NmtError, match="not UTF-8"):
        broken.next()
    broken.close()
    endless = Prefetcher([{"src_ids": torch.ones(1, 1)}], sampler, 1, depth=1)  # the thread waits on a full queue
    endless.next()
    endless.close()
    assert not endless.thread.is_alive()
