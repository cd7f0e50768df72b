"""The collator: the teacher-forcing shift and the padding round-trip, and nothing but batch-leading LongTensors."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.batching import Collator, pad

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


def test_pad_rounds_up_to_the_multiple():
    assert pad([[1, 2, 3], [4]], pad_id=0, multiple_of=4).tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert pad([[1, 2, 3, 4]], pad_id=0, multiple_of=4).shape == (1, 4)
    assert pad([[5], [6, 7]]).tolist() == [[5, 0], [6, 7]]
