"""Tokenizers: the saved tokenizer is deterministic; BPE-dropout is seeded and equals plain BPE at p = 0."""

import json
import random

import pytest

from nmt.config import TokenizerConfig
from nmt.errors import NmtError
from nmt.synthetic import generate_pairs
from nmt.tokenizer import DropoutSegmenter, PairTokenizer, train_tokenizer

PAIRS = generate_pairs(400, seed=11)
TEXTS = [s for pair in PAIRS for s in pair] + ["Ünïcödé ﬁ  doubled  spaces", "", "  ", "x"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, TokenizerConfig(vocab_size=300, dropout=0.1))


def test_the_trained_tokenizer_has_no_dropout_even_when_asked_for_it(tok):
    assert json.loads(tok.to_str())["model"]["dropout"] is None
    assert all(tok.encode(t).ids == tok.encode(t).ids for t in TEXTS[:50])  # deterministic


def test_dropout_zero_is_the_tokenizers_own_segmentation(tok):
    plain = DropoutSegmenter(tok, 0.0)
    for text in TEXTS + ["unknown ☃ char", "a literal <unk> and </s>"]:
        assert plain.encode(text, random.Random(0)) == tok.encode(text, add_special_tokens=False).ids, text


def test_dropout_is_seeded_and_varies_with_the_seed(tok):
    seg = DropoutSegmenter(tok, 0.1)
    runs = {seed: [seg.encode(t, random.Random(f"{seed}")) for t in TEXTS] for seed in ("a", "b")}
    assert runs["a"] == [seg.encode(t, random.Random("a")) for t in TEXTS]  # same seed, same segmentation
    assert runs["a"] != runs["b"]
    plain = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    longer = sum(len(x) for x in runs["a"]) / sum(len(x) for x in plain)
    assert 1.05 < longer < 2.0  # skipped merges leave more, shorter pieces


def test_every_dropout_segmentation_decodes_to_the_same_text(tok):
    seg = DropoutSegmenter(tok, 0.5)
    for i, text in enumerate(TEXTS):
        ids = seg.encode(text, random.Random(i))
        assert tok.decode(ids) == tok.decode(tok.encode(text, add_special_tokens=False).ids)


def test_dropout_needs_bpe():
    unigram = train_tokenizer(TEXTS, TokenizerConfig(kind="unigram", vocab_size=200))
    with pytest.raises(NmtError, match="plain BPE"):
        DropoutSegmenter(unigram, 0.1)


def test_loading_clears_an_older_tokenizers_dropout(tok, tmp_path):
    data = json.loads(tok.to_str())
    data["model"]["dropout"] = 0.3  # as nmt saved it before dropout moved out of the tokenizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    loaded = PairTokenizer.load(tmp_path)
    assert json.loads(loaded.src.to_str())["model"]["dropout"] is None
    text = ["the quick brown fox jumps over the lazy dog"] * 20
    assert len({tuple(ids) for ids in loaded.encode_src(text)}) == 1  # deterministic: every encoding the same


def test_unknown_rate_counts_unk_among_subwords_but_not_the_final_eos():
    from nmt.tokenizer import EOS, UNK, unknown_rate

    assert unknown_rate([[UNK, 5, EOS], [6, UNK, UNK, 7]]) == 3 / 6
    assert unknown_rate(iter([[5, EOS]])) == 0.0 and unknown_rate([]) == 0.0
