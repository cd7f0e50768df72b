"""Reading a corpus in every form it comes in (nmt.readers): text file pairs, TSV, JSONL, CSV, a save_to_disk
DatasetDict, the builtin corpus; CRLF and BOM."""

import json

import datasets
from helpers import PAIRS, TOK, cfg_for, read_all, texts

from nmt.config import DataConfig
from nmt.data import prepare
from tests.conftest import write_pairs


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
