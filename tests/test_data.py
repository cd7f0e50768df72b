"""The prepared corpus (nmt.data.prepare): validation and test from files or carved (seeded), the tokenizer trained
and used, the cache (nothing encoded twice, a changed file read again), the vocabulary size left to the corpus,
BPE-dropout epochs. Reading, cleaning, tables and mixing have their own modules."""

import dataclasses
from pathlib import Path

import pytest
from helpers import PAIRS, TOK, cfg_for, read_all

from nmt.batching import DropoutEpochs
from nmt.config import DataConfig, TokenizerConfig
from nmt.data import prepare
from nmt.tokenizer import BOS, EOS, PairTokenizer
from tests.conftest import write_pairs


def test_valid_and_test_from_files(tmp_path):
    write_pairs(tmp_path / "train", PAIRS[:40], "en", "fr")
    write_pairs(tmp_path / "valid", PAIRS[40:50], "en", "fr")
    write_pairs(tmp_path / "test", PAIRS[50:], "en", "fr")
    corpus = prepare(cfg_for(tmp_path, tmp_path / "train", valid=str(tmp_path / "valid"),
                             test=str(tmp_path / "test")), TOK)
    assert corpus.stats.pairs == {"train": 40, "valid": 10, "test": 10}


def test_carving_is_seeded(tmp_path):
    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    one = read_all(tmp_path, tmp_path / "train")
    two = read_all(tmp_path / "again", tmp_path / "train")
    three = prepare(cfg_for(tmp_path / "other", tmp_path / "train", valid_ratio=0.1, test_ratio=0.1, split_seed=99), TOK)
    assert one.splits["valid"]["src"] == two.splits["valid"]["src"]
    assert one.splits["valid"]["src"] != three.splits["valid"]["src"]


def test_tokenizer_saved_and_used_for_encoding(tmp_path):
    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    corpus = read_all(tmp_path, tmp_path / "train")
    ex = corpus.splits["train"][0]
    assert ex["src_ids"][-1] == EOS and BOS not in ex["tgt_ids"]
    assert corpus.tokenizer.decode_tgt([ex["tgt_ids"]])[0] == ex["tgt"]
    assert ex["cost"] == max(len(ex["src_ids"]), len(ex["tgt_ids"]) + 1)
    corpus.tokenizer.save(tmp_path)
    assert PairTokenizer.load(tmp_path).encode_src([ex["src"]])[0] == ex["src_ids"]


def test_separate_vocabularies(tmp_path):
    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    corpus = prepare(cfg_for(tmp_path, tmp_path / "train"), TokenizerConfig(vocab_size=80, joint=False, min_frequency=1))
    assert not corpus.tokenizer.joint
    corpus.tokenizer.save(tmp_path / "tok")
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == ["tokenizer.src.json", "tokenizer.tgt.json"]


def test_unigram_tokenizer(tmp_path):
    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    corpus = prepare(cfg_for(tmp_path, tmp_path / "train"), TokenizerConfig(kind="unigram", vocab_size=100))
    assert corpus.tokenizer.src.get_vocab_size() <= 100
    assert corpus.tokenizer.decode_tgt(corpus.tokenizer.encode_tgt(["le chat voit"]))[0] == "le chat voit"


def test_second_run_retokenizes_nothing(tmp_path, monkeypatch):
    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    first = read_all(tmp_path, tmp_path / "train")

    def boom(*a, **k):
        raise AssertionError("re-tokenized on the second run")

    monkeypatch.setattr(PairTokenizer, "encode_src", boom)
    monkeypatch.setattr("nmt.tokenizer.train_tokenizer", boom)
    second = read_all(tmp_path, tmp_path / "train")
    assert second.splits["train"]["src_ids"] == first.splits["train"]["src_ids"]


def test_changed_file_is_read_again(tmp_path):
    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    read_all(tmp_path, tmp_path / "train")
    write_pairs(tmp_path / "train", PAIRS[:50], "en", "fr")
    assert sum(read_all(tmp_path, tmp_path / "train").stats.pairs.values()) == 50


def synthetic_cfg(corpus_dir, tmp_path) -> DataConfig:
    return DataConfig(train=str(corpus_dir / "train"), valid=str(corpus_dir / "valid"), test=str(corpus_dir / "test"),
                      cache_dir=str(tmp_path / "cache"))


def test_vocab_size_left_null_is_chosen_from_the_cleaned_pairs(corpus_dir, tmp_path, monkeypatch):
    from nmt import data

    asked = []
    monkeypatch.setattr(data, "vocab_size_for", lambda n: asked.append(n) or 100)
    corpus = prepare(synthetic_cfg(corpus_dir, tmp_path), TokenizerConfig(vocab_size=None))
    assert asked == [600] and corpus.stats.sizing_pairs == 600
    assert corpus.tokenizer.src_vocab_size == 100  # the rule's answer, not a default
    monkeypatch.setattr(data, "vocab_size_for", lambda n: 120)  # another rule (another nmt), the same data and cache
    assert prepare(synthetic_cfg(corpus_dir, tmp_path), TokenizerConfig(vocab_size=None)).tokenizer.src_vocab_size == 120


@pytest.fixture(scope="module")
def dropout_corpus(corpus_dir, tmp_path_factory):
    return prepare(synthetic_cfg(corpus_dir, tmp_path_factory.mktemp("drop")), TokenizerConfig(vocab_size=300, dropout=0.1))


def test_bpe_dropout_changes_each_epoch_and_is_the_same_in_every_process(dropout_corpus):
    train, tok = dropout_corpus.splits["train"], dropout_corpus.tokenizer
    process_a, process_b = (DropoutEpochs(train, tok, 0.1, seed=1, max_cost=512) for _ in range(2))
    e0, e1 = process_a.encoded(0), process_a.encoded(1)
    assert e0["src_ids"] != e1["src_ids"] and e0["tgt_ids"] != e1["tgt_ids"]  # re-segmented each epoch
    assert e0["src_ids"] != train["src_ids"]  # not the deterministic segmentation
    for epoch, mine in ((1, e1), (0, e0)):  # another process, or a resumed run, in any order
        theirs = process_b.encoded(epoch)
        assert theirs["src_ids"] == mine["src_ids"] and theirs["tgt_ids"] == mine["tgt_ids"]
    assert process_a.encoded(0)["tgt_ids"] == e0["tgt_ids"]  # recomputed after epoch 1: the same
    assert DropoutEpochs(train, tok, 0.1, seed=2, max_cost=512).encoded(0)["src_ids"] != e0["src_ids"]
    costs, src_lengths = process_a.lengths(1)
    assert list(costs) == [max(len(s), len(t) + 1) for s, t in zip(e1["src_ids"], e1["tgt_ids"])]
    assert list(src_lengths) == [len(s) for s in e1["src_ids"]]  # the ties of the epoch's batches
    assert tok.decode_tgt(e1["tgt_ids"][:50]) == tok.decode_tgt(train["tgt_ids"][:50])  # same text, other pieces


def test_bpe_dropout_view_serves_the_samplers_epoch(dropout_corpus):
    epochs = DropoutEpochs(dropout_corpus.splits["train"], dropout_corpus.tokenizer, 0.1, seed=1, max_cost=512)
    now = {"epoch": 0}
    view = epochs.view(lambda: now["epoch"])
    assert len(view) == 600
    first = view.__getitems__([5, 3])
    now["epoch"] = 1
    rows = lambda epoch: [epochs.encoded(epoch)[i] for i in (5, 3)]
    assert view.__getitems__([5, 3]) == rows(1) != rows(0) == first
    assert sorted(first[0]) == ["src_ids", "tgt_ids"]


def test_bpe_dropout_keeps_the_plain_segmentation_of_pairs_it_would_make_too_long(dropout_corpus):
    train = dropout_corpus.splits["train"]
    limit = int(sorted(train["cost"])[300])  # the median pair is at the limit already
    epochs = DropoutEpochs(train, dropout_corpus.tokenizer, 0.5, seed=1, max_cost=limit)
    noisy = epochs.encoded(0)
    assert all(c <= limit or c == plain for c, plain in zip(epochs.lengths(0)[0], train["cost"]))
    kept = [i for i, c in enumerate(train["cost"]) if c > limit]
    assert all(noisy[i]["src_ids"] == train[i]["src_ids"] for i in kept)


def test_bpe_dropout_leaves_validation_test_and_the_cache_alone(corpus_dir, tmp_path, dropout_corpus):
    plain = prepare(synthetic_cfg(corpus_dir, tmp_path), TokenizerConfig(vocab_size=300))
    for name in ("train", "valid", "test"):
        assert plain.splits[name]["src_ids"] == dropout_corpus.splits[name]["src_ids"]
        assert plain.splits[name]["tgt_ids"] == dropout_corpus.splits[name]["tgt_ids"]
    assert Path(plain.stats.cache).name == Path(dropout_corpus.stats.cache).name  # one cache entry for both
    assert TokenizerConfig().dropout is None  # off by default


def test_tokenizer_trained_on_a_sample_still_encodes_every_pair(tmp_path):
    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    full = read_all(tmp_path, tmp_path / "train")
    sampled = prepare(cfg_for(tmp_path, tmp_path / "train", valid_ratio=0.1, test_ratio=0.1),
                      dataclasses.replace(TOK, train_sample=3))
    assert sampled.stats.pairs == full.stats.pairs
    assert sampled.tokenizer.src.get_vocab() != full.tokenizer.src.get_vocab()  # learnt from 3 pairs only
    assert sampled.stats.cache != full.stats.cache


def test_bulk_threads_respect_the_user_and_leave_forks_single_threaded(monkeypatch):
    import os

    from nmt import tokenizer

    monkeypatch.setattr(tokenizer, "_threads", {"set_by_nmt": False})
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    with tokenizer.bulk_threads():
        assert os.environ["TOKENIZERS_PARALLELISM"] == "false"  # the user's choice
    monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    for _ in range(2):
        with tokenizer.bulk_threads():
            assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
        assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_the_cleaned_training_split_is_a_file_not_a_selection(tmp_path):
    """What cleaning and carving keep is written to a file of its own, which a warm start opens as it is."""
    from nmt.compat import dataset_indices

    write_pairs(tmp_path / "train", PAIRS[:50] + PAIRS[:5], "en", "fr")
    corpus = read_all(tmp_path, tmp_path / "train")
    assert corpus.stats.clean["dropped"]["duplicate"] >= 1
    assert dataset_indices(corpus.splits["train"]) is None
    work = Path(corpus.stats.cache)
    assert (work / "train.clean.arrow").is_file()
