"""An OPUS-MT model as OPUS-MT-train builds one (SentencePiece models with spm_train's defaults, vocab.json counted
from the encoded corpus, MarianTokenizer, a MarianMTModel trained until it ends its sentences) is imported as
transformers reads it, translates as `generate` does on padded batches of mixed lengths, and exports back to a
MarianMTModel + MarianTokenizer after fine-tuning."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import marian_directory, one_thread  # noqa: F401  (one_thread: module-wide)

from nmt import Translator
from nmt.cli import main
from nmt.synthetic import generate_pairs
from nmt.tokenizer import PairTokenizer

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")  # transformers reads .spm files with it

TRAIN = [p for p in generate_pairs(3000, seed=11) if len(p[0].split()) <= 8][:1500]
TEST = [s for s, _ in generate_pairs(60, seed=99) if len(s.split()) <= 12][:40]  # 3 to 12 words: padded batches


def build_opus_mt(d: Path, pairs: list[tuple[str, str]], steps: int = 400) -> Path:
    """source.spm and target.spm trained by spm_train with its defaults (unigram, <unk> <s> </s> control pieces,
    character coverage 0.9995), one vocab.json counted from both encoded sides as marian-vocab counts (</s> 0,
    <unk> 1, then by frequency; <pad> added last as transformers' Marian converter does), so <s> and pieces the
    encoded corpus never uses are absent from it; MarianTokenizer.save_pretrained; a MarianMTModel trained on
    `pairs` for `steps` steps of 32 pairs."""
    d.mkdir(parents=True, exist_ok=True)
    counts: Counter = Counter()
    for side, i in (("source", 0), ("target", 1)):
        spm.SentencePieceTrainer.train(sentence_iterator=iter([p[i] for p in pairs]), model_prefix=str(d / side),
                                       vocab_size=300, minloglevel=2)
        (d / f"{side}.model").rename(d / f"{side}.spm")
        (d / f"{side}.vocab").unlink()
        processor = spm.SentencePieceProcessor(model_file=str(d / f"{side}.spm"))
        for p in pairs:
            counts.update(processor.encode(p[i], out_type=str))
    vocab = {"</s>": 0, "<unk>": 1}
    for piece, _ in counts.most_common():
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tok = transformers.MarianTokenizer(source_spm=str(d / "source.spm"), target_spm=str(d / "target.spm"),
                                       vocab=str(d / "vocab.json"))
    tok.save_pretrained(d)
    V = len(vocab)
    config = transformers.MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
        pad_token_id=V - 1, eos_token_id=0, decoder_start_token_id=V - 1, dropout=0.0, activation_function="swish",
        scale_embedding=True)
    torch.manual_seed(0)
    hf = transformers.MarianMTModel(config)
    opt = torch.optim.AdamW(hf.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(steps):
        batch = rng.sample(pairs, 32)
        enc = tok([s for s, _ in batch], text_target=[t for _, t in batch], return_tensors="pt", padding=True)
        labels = enc["labels"].masked_fill(enc["labels"].eq(V - 1), -100)
        hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    hf.eval().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def opus(tmp_path_factory) -> tuple[Path, Path]:
    """The OPUS-MT directory and its `nmt import`."""
    d = build_opus_mt(tmp_path_factory.mktemp("opus") / "hf", TRAIN)
    out = d.parent / "nmt"
    assert main(["import", str(d), str(out)]) == 0
    return d, out


def _translate(capsys, model: Path, sentences: list[str], tmp_path: Path, *flags: str) -> list[str]:
    """`nmt translate MODEL --input FILE FLAGS...`: one batch of every sentence (padded to the longest)."""
    path = tmp_path / "input.txt"
    path.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(model), "--input", str(path), *flags]) == 0
    return capsys.readouterr().out.splitlines()


def _generate(hf, tok, sentence: str, **kw) -> str:
    """`generate` of one sentence with nmt's default length rule (10 + 2 * source tokens, </s> forced there)."""
    batch = tok([sentence], return_tensors="pt")
    out = hf.generate(**batch, max_new_tokens=10 + 2 * batch.input_ids.shape[1], forced_eos_token_id=0,
                      suppress_tokens=[hf.config.pad_token_id], do_sample=False, **kw)
    return tok.batch_decode(out, skip_special_tokens=True)[0]


@pytest.mark.slow
def test_an_opus_mt_directory_imports_with_the_ids_marian_tokenizer_gives(opus):
    """<s> and pieces the encoded corpus never used are in the .spm files but not in vocab.json: MarianTokenizer
    gives them <unk>, and so does the import (which refused such a directory before)."""
    hf_dir, out = opus
    vocab = json.loads((hf_dir / "vocab.json").read_text(encoding="utf-8"))
    source = spm.SentencePieceProcessor(model_file=str(hf_dir / "source.spm"))
    absent = [p for p in map(source.id_to_piece, range(source.get_piece_size())) if p not in vocab]
    assert "<s>" in absent and any(len(p) == 1 and p.isalpha() for p in absent), absent
    letter = next(p for p in absent if len(p) == 1 and p.isalpha())
    texts = TEST + [f"A {letter} is here.", f"The {letter}ar of {letter}uiet {letter}"]
    ours, theirs = PairTokenizer.load(out), transformers.MarianTokenizer.from_pretrained(hf_dir)
    assert ours.encode_src(texts) == theirs(texts).input_ids
    assert any(vocab["<unk>"] in ids for ids in theirs(texts[-2:]).input_ids)
    targets = [t for _, t in TRAIN[:40]]
    assert [t + [0] for t in ours.encode_tgt(targets)] == theirs(text_target=targets).input_ids


@pytest.mark.slow
def test_an_imported_opus_mt_model_translates_padded_batches_as_generate(opus, capsys, tmp_path):
    """Every sentence of one padded batch of 3- to 12-word sentences: greedy, beam 4 without length penalty, and
    beam 4 with no token twice (no_repeat_ngram_size 1), as transformers translates each (before, padding with id 0,
    Marian's </s>, changed most lines)."""
    hf_dir, out = opus
    hf = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    tok = transformers.MarianTokenizer.from_pretrained(hf_dir)
    greedy = _translate(capsys, out, TEST, tmp_path, "--beam", "1")
    assert greedy == [_generate(hf, tok, s, num_beams=1) for s in TEST]
    assert len({len(line.split()) for line in greedy}) >= 4  # translations of many lengths, each ended by the model
    beam = _translate(capsys, out, TEST, tmp_path, "--beam", "4", "--alpha", "0")
    assert beam == [_generate(hf, tok, s, num_beams=4, length_penalty=0.0, early_stopping=True) for s in TEST]
    no_repeat = _translate(capsys, out, TEST, tmp_path, "--beam", "4", "--alpha", "0", "--no-repeat-ngram-size", "1")
    assert no_repeat != beam and no_repeat == [_generate(hf, tok, s, num_beams=4, length_penalty=0.0,
                                                         early_stopping=True, no_repeat_ngram_size=1) for s in TEST]


@pytest.mark.slow
def test_beams_cut_at_the_length_limit_rank_as_generate_ranks_them(opus):
    """With every hypothesis cut at 4 tokens, the forced </s> adds nothing to a beam's score, as in transformers
    (before, its real log-probability reordered the beams)."""
    hf_dir, out = opus
    hf = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    tok = transformers.MarianTokenizer.from_pretrained(hf_dir)
    ours = Translator.from_pretrained(out).translate(TEST, beam_size=4, alpha=0.0, max_len_a=4, max_len_b=0,
                                                     max_new_tokens=4)
    batch = tok(TEST, return_tensors="pt", padding=True)
    ids = hf.generate(**batch, num_beams=4, length_penalty=0.0, early_stopping=True, max_new_tokens=4,
                      forced_eos_token_id=0, suppress_tokens=[hf.config.pad_token_id], do_sample=False)
    assert ours == tok.batch_decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_a_fine_tuned_opus_mt_import_exports_to_marian_and_generates_as_nmt_translates(
        opus, corpus_dir, capsys, tmp_path, fresh_accelerate_state):
    """import -> nmt train --init-from -> export: MarianMTModel and MarianTokenizer (two SentencePiece models, one
    vocab.json), whose plain generate(**tok(...)) of a padded batch is `nmt translate --beam 1` of the fine-tuned
    model; where nmt's length rule (10 + 2 * source tokens) cuts a translation that has not ended, which no
    generation_config can say, nmt's is the start of generate's."""
    _, imported = opus
    assert main(["train", "--init-from", str(imported), "--data.train", str(corpus_dir / "train"),
                 "--data.valid", str(corpus_dir / "valid"), "--data.cache_dir", str(tmp_path / "cache"),
                 "--output_dir", str(tmp_path / "run"), "--max_steps", "6", "--max_tokens", "600",
                 "--eval_max_sentences", "8"]) == 0
    tuned, hf_dir = tmp_path / "run" / "model", tmp_path / "hf"
    assert main(["export", str(tuned), "--to", "transformers", str(hf_dir)]) == 0
    hf = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    tok = transformers.MarianTokenizer.from_pretrained(hf_dir)
    texts = TEST + ["  Two  spaces and Unknown wörds: “quotes”!"]
    assert tok(texts).input_ids == PairTokenizer.load(tuned).encode_src(texts)
    ours = _translate(capsys, tuned, texts, tmp_path, "--beam", "1")
    generated = hf.generate(**tok(texts, return_tensors="pt", padding=True))  # (B, 1 + L): start, tokens, padding
    theirs = tok.batch_decode(generated, skip_special_tokens=True)
    lengths = generated[:, 1:].ne(hf.config.pad_token_id).sum(1).tolist()  # tokens generated, the final </s> included
    cut = [n > 10 + 2 * len(ids) for n, ids in zip(lengths, tok(texts).input_ids)]
    assert sum(cut) <= len(texts) // 5, theirs
    for a, b, c in zip(ours, theirs, cut):
        assert b.startswith(a) if c else a == b, (a, b)


def test_a_sentence_translates_alike_alone_and_beside_a_long_one(tmp_path, capsys):
    """Padding is the model's <pad> (Marian's last id): before, it was id 0, Marian's </s>, which the encoder
    attended to and the length rule counted, so a short sentence beside a long one translated differently."""
    pairs = generate_pairs(300, seed=7)
    (tmp_path / "hf").mkdir()
    hf_dir = marian_directory(tmp_path / "hf", pairs)
    out = tmp_path / "nmt"
    assert main(["import", str(hf_dir), str(out)]) == 0
    short, long = "A dog sleeps.", pairs[0][0] + " " + pairs[1][0] + " " + pairs[2][0]
    for flags in (["--beam", "1"], ["--beam", "3"]):
        alone = _translate(capsys, out, [short], tmp_path, *flags)
        beside = _translate(capsys, out, [short, long], tmp_path, *flags)
        assert beside[0] == alone[0], flags
