"""Cleaning with counts (nmt.cleaning): each drop reason, whole columns equal to the one-pair reference, an exact
dedupe whatever the hashes, validation/test pairs found in train, and every split kept to pairs the model can take."""

import dataclasses

import pytest
from helpers import PAIRS, TOK, cfg_for
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.cleaning import drop_reason
from nmt.config import DataConfig
from nmt.data import prepare
from tests.conftest import write_pairs


@pytest.mark.parametrize("src, tgt, reason", [
    ("", "x", "empty"), ("  ", "x", "empty"), ("a " * 300, "b", "too_long"),
    ("a b c d e f g h i j", "x y", "length_ratio"), ("a\x00b", "c", "nul_byte"), ("a b", "c", None),
])
def test_drop_reasons(src, tgt, reason):
    assert drop_reason(src, tgt, DataConfig()) == reason


def test_cleaning_counts_each_reason(tmp_path):
    dirty = PAIRS[:30] + [("", "x"), ("x", " "), ("w " * 300, "v"), ("one two three four five six seven eight nine", "x"),
                          PAIRS[0], PAIRS[1]]
    write_pairs(tmp_path / "train", dirty, "en", "fr")
    write_pairs(tmp_path / "valid", PAIRS[30:35], "en", "fr")
    corpus = prepare(cfg_for(tmp_path, tmp_path / "train", valid=str(tmp_path / "valid"), test=str(tmp_path / "valid")), TOK)
    assert corpus.stats.clean == {"read": 36, "kept": 30, "overlap": {"valid": 0, "test": 0},
                                     "dropped": {"empty": 2, "too_long": 1, "length_ratio": 1, "duplicate": 2}}


WORDS = st.text(alphabet=st.sampled_from(["a", "é", " ", "\t", "\xa0", "\u3000", "\u2028", "\x1f", "\x00", "\x85",
                                          "\u200b", "ß"]), max_size=12)


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(WORDS, WORDS), max_size=20), max_words=st.integers(1, 6),
       max_chars=st.integers(1, 12), max_ratio=st.floats(1, 4))
def test_whole_column_drop_codes_equal_the_one_pair_reference(pairs, max_words, max_chars, max_ratio):
    import pyarrow as pa

    from nmt.cleaning import REASONS, drop_codes

    cfg = DataConfig(max_words=max_words, max_chars=max_chars, max_ratio=max_ratio, ratio_min_words=1)
    codes = drop_codes(pa.array([s for s, _ in pairs], pa.string()), pa.array([t for _, t in pairs], pa.string()), cfg)
    assert [REASONS[c - 1] if c else None for c in codes] == [drop_reason(s, t, cfg) for s, t in pairs]


def test_dedupe_is_exact_even_when_every_hash_collides(tmp_path, monkeypatch):
    import numpy as np

    from nmt import cleaning

    pairs = PAIRS[:20] + [PAIRS[3], PAIRS[7], PAIRS[3]]
    write_pairs(tmp_path / "train", pairs, "en", "fr")
    write_pairs(tmp_path / "valid", PAIRS[40:45], "en", "fr")
    monkeypatch.setattr(cleaning, "pair_hashes", lambda src, tgt: np.zeros(len(src), np.uint64))
    corpus = prepare(cfg_for(tmp_path, tmp_path / "train", valid=str(tmp_path / "valid"), test=str(tmp_path / "valid")), TOK)
    assert corpus.stats.clean["dropped"] == {"duplicate": 3}
    assert list(zip(corpus.splits["train"]["src"], corpus.splits["train"]["tgt"])) == PAIRS[:20]


def test_eval_pairs_in_train_are_reported_and_removed_on_request(tmp_path):
    valid, test = PAIRS[40:45], PAIRS[45:50]
    noisy = [(f"  {s.upper()} ", t) for s, t in valid[:2]]  # equal after normalisation (case, spaces)
    write_pairs(tmp_path / "train", PAIRS[:30] + noisy + test[:1], "en", "fr")
    write_pairs(tmp_path / "valid", valid, "en", "fr")
    write_pairs(tmp_path / "test", test, "en", "fr")
    cfg = cfg_for(tmp_path, tmp_path / "train", valid=str(tmp_path / "valid"), test=str(tmp_path / "test"))
    corpus = prepare(cfg, TOK)
    assert corpus.stats.clean["overlap"] == {"valid": 2, "test": 1} and corpus.stats.pairs["train"] == 33
    from nmt.data import overlap_line
    assert overlap_line(corpus.stats).startswith("2 valid and 1 test pairs also occur in the training data")
    removed = prepare(dataclasses.replace(cfg, dedupe_eval=True), TOK)
    assert removed.stats.pairs["train"] == 30 and removed.stats.clean["dropped"] == {"in_valid_or_test": 3}
    assert set(zip(removed.splits["train"]["src"], removed.splits["train"]["tgt"])) == set(PAIRS[:30])


def test_repeats_count_only_the_rows_among_the_training_pairs():
    import numpy as np

    from nmt.cleaning import repeats

    values = np.array([5, 7, 5, 5, 9, 7], dtype=np.uint64)
    texts = lambda idx: [int(values[i]) for i in idx]
    assert repeats(values, texts).tolist() == [False, False, True, True, False, True]
    among = np.array([False, True, True, True, True, False])
    assert repeats(values, texts, among).tolist() == [False, False, False, True, False, False]
    assert not repeats(np.zeros(6, np.uint64), lambda idx: list(idx)).any()  # equal hashes, other texts: kept


def test_every_split_keeps_only_pairs_the_model_can_take(tmp_path):
    """`max_positions` (the model's, passed by training and `nmt check`) bounds every split, as data.max_subwords does;
    validation and test lose nothing else that training would (no length ratio, no duplicates)."""
    long = (" ".join(s for s, _ in PAIRS[50:55]), " ".join(t for _, t in PAIRS[50:55]))  # 35 words a side
    odd = ("a b c d e f g h i j k l", "x")  # a length ratio training drops
    write_pairs(tmp_path / "train", PAIRS[:40] + [long], "en", "fr")
    write_pairs(tmp_path / "valid", PAIRS[40:45] + [long, odd, odd], "en", "fr")
    write_pairs(tmp_path / "test", PAIRS[45:50] + [long], "en", "fr")
    cfg = cfg_for(tmp_path, tmp_path / "train", valid=str(tmp_path / "valid"), test=str(tmp_path / "test"))
    assert prepare(cfg, TOK).stats.pairs == {"train": 41, "valid": 8, "test": 6}
    corpus = prepare(cfg, TOK, max_positions=30)
    assert corpus.stats.pairs == {"train": 40, "valid": 7, "test": 5}
    assert corpus.stats.clean["dropped"] == {"too_many_subwords": 1}
    assert corpus.stats.clean_eval["valid"] == {"read": 8, "kept": 7, "dropped": {"too_many_subwords": 1}}
    assert max(max(corpus.splits[name]["cost"]) for name in ("train", "valid", "test")) <= 30
