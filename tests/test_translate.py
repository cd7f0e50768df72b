"""nmt.translate: Translator's batching, order, n-best lists, streaming, long inputs and its model directory."""

import json

import pytest
import torch
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)

from nmt.config import ModelConfig, TokenizerConfig
from nmt.errors import NmtError
from nmt.model import Seq2SeqTransformer
from nmt.search import SEARCH_FILE
from nmt.synthetic import generate_pairs
from nmt.tokenizer import EOS, train_pair_tokenizer
from nmt.translate import Translator, fit_length

TEXTS = [src for src, _ in generate_pairs(12, seed=3)]


@pytest.fixture(scope="module")
def translator() -> Translator:
    """A random tiny model (d_model 16) over a tokenizer trained on the synthetic language."""
    pairs = generate_pairs(300, seed=1)
    tok = train_pair_tokenizer(lambda: (s for s, _ in pairs), lambda: (t for _, t in pairs),
                               TokenizerConfig(vocab_size=120))
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size, d_model=16,
                             n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32, dropout=0.0)
    return Translator(Seq2SeqTransformer(cfg), tok)


def test_batches_do_not_change_translations_and_order_is_kept(translator):
    alone = [translator.translate([t], beam_size=2, max_new_tokens=8)[0] for t in TEXTS]
    assert translator.translate(TEXTS, beam_size=2, max_new_tokens=8, batch_tokens=24) == alone  # many small batches
    assert translator.translate(TEXTS[::-1], beam_size=2, max_new_tokens=8) == alone[::-1]


def test_nbest_lists_are_scored_best_first(translator):
    out = translator.translate(TEXTS[:3], beam_size=4, nbest=3, max_new_tokens=8)
    assert [len(hyps) for hyps in out] == [3, 3, 3]
    for hyps in out:
        scores = [score for _, score in hyps]
        assert all(isinstance(text, str) for text, _ in hyps) and scores == sorted(scores, reverse=True)
    best = translator.translate(TEXTS[:3], beam_size=4, max_new_tokens=8)
    assert [hyps[0][0] for hyps in out] == best


def test_stream_equals_translate_in_any_chunking(translator):
    whole = translator.translate(TEXTS, beam_size=1, max_new_tokens=8)
    lines = [t + "\n" for t in TEXTS]
    assert list(translator.translate_stream(lines, chunk_size=5, beam_size=1, max_new_tokens=8)) == whole
    nbest = list(translator.translate_stream(lines[:2], chunk_size=1, beam_size=2, nbest=2, max_new_tokens=8))
    assert [len(line.split("\t")) for line in nbest] == [4, 4]  # text, score, text, score


def test_fit_length_truncates_or_splits_keeping_the_end_of_sentence():
    ids = [5, 6, 7, 8, 9, 10, EOS]
    assert fit_length(ids, 7, "truncate") == [ids]
    assert fit_length(ids, 4, "truncate") == [[5, 6, 7, EOS]]
    assert fit_length(ids, 4, "split") == [[5, 6, 7, EOS], [8, 9, 10, EOS]]
    with pytest.raises(NmtError, match="long_inputs must be"):
        fit_length(ids, 4, "drop")


def test_from_pretrained_reads_the_directory_and_its_tuned_alpha(translator, tmp_path):
    translator.model.save_pretrained(tmp_path)
    translator.tokenizer.save(tmp_path)
    loaded = Translator.from_pretrained(tmp_path)
    assert loaded.search_defaults == {} and loaded.backend == "torch"
    assert loaded.translate(TEXTS[:4], beam_size=2, max_new_tokens=8) == translator.translate(TEXTS[:4], beam_size=2,
                                                                                             max_new_tokens=8)
    (tmp_path / SEARCH_FILE).write_text(json.dumps({"alpha": 1.3}))
    assert Translator.from_pretrained(tmp_path).search_defaults == {"alpha": 1.3}
