"""Several training corpora mixed in an epoch (nmt.mixing) by their weights, with carved splits and dropped pairs."""

import dataclasses
from collections import Counter

import pytest
from helpers import PAIRS, TOK, cfg_for

from nmt.data import prepare
from nmt.errors import NmtError
from tests.conftest import write_pairs


def test_several_training_corpora_mixed_by_weight(tmp_path):
    real, synthetic = PAIRS[:20], [(f"synthetic {i} .", f"synthétique {i} .") for i in range(10)]
    write_pairs(tmp_path / "real", real, "en", "fr")
    write_pairs(tmp_path / "synthetic", synthetic, "en", "fr")
    write_pairs(tmp_path / "valid", PAIRS[40:45], "en", "fr")
    cfg = cfg_for(tmp_path, tmp_path / "real", valid=str(tmp_path / "valid"), test=str(tmp_path / "valid"))
    cfg = dataclasses.replace(cfg, train=[str(tmp_path / "real"), str(tmp_path / "synthetic")], weights=[1, 2.5])
    corpus = prepare(cfg, TOK)
    pairs = list(zip(corpus.splits["train"]["src"], corpus.splits["train"]["tgt"]))
    assert len(pairs) == 30  # each pair once; an epoch's draws select from them
    seen = Counter(pairs[i] for i in corpus.epoch_rows(0))
    assert all(seen[p] == 1 for p in real)
    assert sorted(seen[p] for p in synthetic) == [2] * 5 + [3] * 5  # 2 copies, and half of them once more
    assert [c["per_epoch"] for c in corpus.stats.corpora] == [20, 25]
    assert corpus.stats.sizing_pairs == 30  # unique pairs size the vocabulary and model, not the copies
    with pytest.raises(NmtError, match="data.weights"):
        dataclasses.replace(cfg, weights=[1])


def test_several_corpora_with_carved_splits_and_dropped_pairs_keep_their_mixing(tmp_path):
    """Cleaning writes the pairs it keeps to a file of its own; each corpus's share of it (its mixing weight)
    follows the pairs carved off and dropped from the first one."""
    real = PAIRS[:40] + [PAIRS[5], PAIRS[6], PAIRS[5]]
    synthetic = [(f"synthetic {i} .", f"synthétique {i} .") for i in range(10)]
    write_pairs(tmp_path / "real", real, "en", "fr")
    write_pairs(tmp_path / "synthetic", synthetic, "en", "fr")
    cfg = dataclasses.replace(cfg_for(tmp_path, tmp_path / "real", valid_ratio=0.1, test_ratio=0.1),
                              train=[str(tmp_path / "real"), str(tmp_path / "synthetic")], weights=[1, 2])
    for _ in range(2):  # cold, then from the cache
        corpus = prepare(cfg, TOK)
        held = {(s, t) for name in ("valid", "test") for s, t in zip(corpus.splits[name]["src"], corpus.splits[name]["tgt"])}
        pairs = list(zip(corpus.splits["train"]["src"], corpus.splits["train"]["tgt"]))
        seen = Counter(pairs[i] for i in corpus.epoch_rows(0))
        assert len(corpus.splits["valid"]) + len(corpus.splits["test"]) == 5 + 4  # 10% of 43, then of 38, rounded up
        assert {p: seen[p] for p in synthetic} == {p: 2 for p in synthetic}
        assert all(seen[p] == 1 for p in PAIRS[:40] if p not in held)
        assert [c["per_epoch"] for c in corpus.stats.corpora] == [len(set(PAIRS[:40]) - held), 20]
