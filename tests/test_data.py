"""Reading every input format, cleaning with counts, carving splits, and the encoding cache."""

import dataclasses
import json
from collections import Counter
from pathlib import Path

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.batching import DropoutEpochs
from nmt.cleaning import drop_reason
from nmt.config import DataConfig, TokenizerConfig
from nmt.data import prepare
from nmt.errors import NmtError
from nmt.textfiles import count_lines
from nmt.tokenizer import BOS, EOS, PairTokenizer
from tests.conftest import write_pairs

PAIRS = [(f"the cat {i} sees a dog .", f"le chat {i} voit un chien .") for i in range(60)]


def cfg_for(tmp_path, train, **kw) -> DataConfig:
    return DataConfig(train=str(train), src_lang="en", tgt_lang="fr", cache_dir=str(tmp_path / "cache"), **kw)


TOK = TokenizerConfig(vocab_size=120, min_frequency=1)


def read_all(tmp_path, train, **kw):
    corpus = prepare(cfg_for(tmp_path, train, valid_ratio=0.1, test_ratio=0.1, **kw), TOK)
    return corpus


def texts(corpus) -> set:
    splits = [corpus.splits[name] for name in ("train", "valid", "test")]
    return {(s, t) for ds in splits for s, t in zip(ds["src"], ds["tgt"])}


def test_text_pair_files(tmp_path):
    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    corpus = read_all(tmp_path, tmp_path / "train")
    assert texts(corpus) == set(PAIRS)
    assert sum(corpus.stats.pairs.values()) == 60
    assert corpus.stats.carved_from_train == ["valid", "test"]


def test_tsv_ignores_extra_columns(tmp_path):
    path = tmp_path / "anki.tsv"
    path.write_text("".join(f"{a}\t{b}\tCC-BY 2.0 (France) Attribution: tatoeba.org #1\n" for a, b in PAIRS))
    assert texts(read_all(tmp_path, path)) == set(PAIRS)


def test_jsonl_translation_column_and_plain_fields(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"translation": {"en": s, "fr": t}}) + "\n" for s, t in PAIRS))
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in PAIRS))
    assert texts(read_all(tmp_path, a)) == set(PAIRS)
    assert texts(read_all(tmp_path, b)) == set(PAIRS)


def test_csv_with_language_columns(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("\ufeffen,fr\n" + "".join(f'"{s}","{t}"\n' for s, t in PAIRS))  # a BOM before the header
    assert texts(read_all(tmp_path, path)) == set(PAIRS)


def test_save_to_disk_dataset_dict_uses_its_splits(tmp_path):
    rows = [{"translation": {"en": s, "fr": t}} for s, t in PAIRS]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:50]),
                               "validation": datasets.Dataset.from_list(rows[50:55]),
                               "test": datasets.Dataset.from_list(rows[55:])})
    dd.save_to_disk(str(tmp_path / "disk"))
    corpus = prepare(cfg_for(tmp_path, tmp_path / "disk"), TOK)
    assert corpus.stats.pairs == {"train": 50, "valid": 5, "test": 5}
    assert corpus.stats.carved_from_train == []


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


def test_builtin_corpus_has_three_splits(tmp_path):
    corpus = prepare(DataConfig(max_train_pairs=500, cache_dir=str(tmp_path)), TOK)
    assert corpus.stats.pairs["valid"] == 1000 and corpus.stats.pairs["test"] == 1000
    assert corpus.stats.pairs["train"] <= 500


def test_crlf_and_bom_are_handled(tmp_path):
    (tmp_path / "train.en").write_bytes("\ufeffhello world\r\nsecond line\r\n".encode())
    (tmp_path / "train.fr").write_bytes("bonjour monde\r\ndeuxième ligne\r\n".encode())
    from nmt.readers import read_text_pair
    rows = list(read_text_pair(str(tmp_path / "train.en"), str(tmp_path / "train.fr")))
    assert rows == [{"src": "hello world", "tgt": "bonjour monde"}, {"src": "second line", "tgt": "deuxième ligne"}]


def test_count_lines_without_final_newline(tmp_path):
    (tmp_path / "f").write_bytes(b"a\nb")
    assert count_lines(tmp_path / "f") == 2


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


# --- whole-column cleaning, overlap, mixing, sampling ------------------------------------------------


class RowFormatting:
    """Counts rows formatted one at a time by `datasets` (what iterating a Dataset or a Column does)."""

    def __init__(self, monkeypatch):
        from datasets.formatting import formatting

        self.calls = 0
        todo = [formatting.Formatter]
        while todo:
            cls = todo.pop()
            todo += cls.__subclasses__()
            if "format_row" in vars(cls):
                monkeypatch.setattr(cls, "format_row", self._counted(vars(cls)["format_row"]))

    def _counted(self, fn):
        def format_row(formatter, table):
            self.calls += 1
            return fn(formatter, table)
        return format_row


def test_no_dataset_row_is_formatted_one_by_one(corpus_dir, tmp_path, monkeypatch):
    """Preparation, the training sampler's inputs and `nmt check` read columns as Arrow/NumPy, never rows."""
    from nmt.batching import TokenBatchSampler
    from nmt.encoding import pair_lengths
    from nmt.tables import column
    from nmt.tools.check import preflight
    from tests.conftest import tiny_config

    counter = RowFormatting(monkeypatch)
    cfg = tiny_config(corpus_dir, tmp_path)
    for _ in range(2):  # cold, then from the cache
        corpus = prepare(cfg.data, cfg.tokenizer)
        TokenBatchSampler(column(corpus.splits["train"], "cost"), 400, ties=pair_lengths(corpus.splits["train"])[0]).plan(0)
    preflight(cfg, probe_steps=0)
    assert counter.calls == 0
    assert corpus.splits["train"][0]["src_ids"] and counter.calls == 1  # the counter sees row formatting


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


def _arrow_file(tmp_path, sizes):
    """A memory-mapped Dataset over an Arrow stream of our own, written in batches of `sizes` rows."""
    import pyarrow as pa

    from nmt.tables import open_arrow
    from nmt.textfiles import write_arrow

    bounds, batches = [0], []
    for size in sizes:
        rows = range(bounds[-1], bounds[-1] + size)
        batches.append(pa.record_batch([pa.array([f"s{i}" for i in rows], pa.string()),
                                        pa.array([f"t{i} " * 20 for i in rows], pa.string())], names=["src", "tgt"]))
        bounds.append(bounds[-1] + size)
    path = tmp_path / f"pairs-{'-'.join(map(str, sizes))}.arrow"
    if not path.exists():
        write_arrow(iter(batches), path)
    return open_arrow(path, path.stem), path


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5), batch_size=st.integers(1, 12), data=st.data())
def test_batches_rows_and_columns_are_the_datasets_own(tmp_path_factory, sizes, batch_size, data):
    """arrow_batches, rows and column read a memory-mapped file of ours, and selections of it, as datasets reads
    them row by row; a pickled Dataset re-opens the file by its path."""
    import pickle

    import numpy as np

    from nmt.tables import arrow_batches, rows

    ds, _ = _arrow_file(tmp_path_factory.getbasetemp(), sizes)
    n = len(ds)
    picked = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n)) if n else []
    for view in (ds, ds.select(picked), pickle.loads(pickle.dumps(ds.select(picked)))):
        expected = [(r["src"], r["tgt"]) for r in view]
        streamed = [t.to_pydict() for t in arrow_batches(view, batch_size)]
        assert [p for t in streamed for p in zip(t["src"], t["tgt"])] == expected
        assert all(len(t["src"]) == batch_size for t in streamed[:-1])
        idx = np.array(data.draw(st.lists(st.integers(0, len(view) - 1), max_size=8)) if len(view) else [], np.int64)
        assert rows(view, idx) == [expected[i] for i in idx]


def test_a_column_of_a_selection_is_the_datasets_own(tmp_path):
    from nmt.encoding import pair_lengths
    from nmt.tables import column

    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    train = read_all(tmp_path, tmp_path / "train").splits["train"]
    picked = train.select(list(range(len(train)))[::-2])
    assert column(picked, "cost").tolist() == picked["cost"]
    assert [a.tolist() for a in pair_lengths(picked)] == [picked["src_len"], picked["tgt_len"]]


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


def test_the_cleaned_training_split_is_a_file_not_a_selection(tmp_path):
    """What cleaning and carving keep is written to a file of its own, which a warm start opens as it is."""
    from nmt.compat import dataset_indices

    write_pairs(tmp_path / "train", PAIRS[:50] + PAIRS[:5], "en", "fr")
    corpus = read_all(tmp_path, tmp_path / "train")
    assert corpus.stats.clean["dropped"]["duplicate"] >= 1
    assert dataset_indices(corpus.splits["train"]) is None
    work = Path(corpus.stats.cache)
    assert (work / "train.clean.arrow").is_file()


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
