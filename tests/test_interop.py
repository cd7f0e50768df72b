"""transformers interop: imported Marian/M2M100 models compute transformers' logits and translations, their
tokenizers give transformers' ids, they fine-tune through `nmt train --init-from`; exported nmt models (the
defaults included) compute nmt's logits in transformers and translate like `nmt translate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import ATOL, marian_directory, marian_model, one_thread, randomize, tiny_model  # noqa: F401  (one_thread: module-wide)

from nmt import Translator, train
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.interop import model_from_hf
from nmt.loading import open_model
from nmt.model import Seq2SeqTransformer
from nmt.synthetic import generate_pairs
from nmt.tokenizer import PairTokenizer
from tests.conftest import tiny_config

transformers = pytest.importorskip("transformers")
PAIRS = generate_pairs(300, seed=7)
SENTENCES = [s for s, _ in generate_pairs(12, seed=5)] + ["Unseen wörds, “quotes” and  two  spaces!"]
TARGETS = [t for _, t in generate_pairs(12, seed=5)]  # text of the target side's language


def _batch(pad: int, eos: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded source batch and decoder inputs that begin with the decoder start."""
    src = torch.tensor([[5, 6, 7, 8, 9, eos], [10, 11, eos, pad, pad, pad], [12, eos, pad, pad, pad, pad]])
    tgt = torch.tensor([[start, 13, 14, 15], [start, 16, 17, 18], [start, 19, 20, 21]])
    return src, tgt


def _assert_same_logits(hf, model: Seq2SeqTransformer, pad: int, eos: int, start: int) -> None:
    src, tgt = _batch(pad, eos, start)
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=src.ne(pad), decoder_input_ids=tgt).logits
        ours = model(src, tgt)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def _m2m100(vocab: int = 60, d_model: int = 16, layers: int = 1, **kw):
    config = transformers.M2M100Config(
        vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model,
        max_position_embeddings=64, **kw)
    hf = transformers.M2M100ForConditionalGeneration(config).eval()
    randomize(hf)
    return hf


@pytest.mark.parametrize("d_model, layers, tied, act, scale", [(16, 1, True, "swish", True), (32, 2, False, "gelu", False),
                                                               (32, 1, True, "relu", True)])
def test_an_imported_marian_model_computes_transformers_logits(d_model, layers, tied, act, scale, tmp_path):
    hf = marian_model(d_model=d_model, layers=layers, tied=tied, activation_function=act, scale_embedding=scale)
    hf.save_pretrained(tmp_path)
    model = model_from_hf(tmp_path)
    assert model.cfg.share_embeddings == tied and model.cfg.bos_id == model.cfg.pad_id == 59
    _assert_same_logits(hf, model, pad=59, eos=0, start=59)


@pytest.mark.parametrize("d_model, layers, act", [(16, 1, "relu"), (32, 2, "gelu")])
def test_an_imported_m2m100_model_computes_transformers_logits(d_model, layers, act, tmp_path):
    hf = _m2m100(d_model=d_model, layers=layers, activation_function=act)
    hf.save_pretrained(tmp_path)
    model = model_from_hf(tmp_path)
    assert (model.cfg.pre_norm, model.cfg.positions) == (True, "m2m100")
    _assert_same_logits(hf, model, pad=1, eos=2, start=2)


# --- Marian with its SentencePiece tokenizers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory) -> Path:
    """A Marian directory as OPUS-MT ships one: source.spm and target.spm (unigram SentencePiece models trained on
    the two sides of the synthetic corpus), one joint vocab.json (</s> 0, <unk> 1, <pad> last), a random model."""
    return marian_directory(tmp_path_factory.mktemp("marian"), PAIRS)


@pytest.fixture(scope="module")
def marian_nmt(marian_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "opus"
    assert main(["import", str(marian_dir), str(out)]) == 0
    return out


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_directory_naming_code_of_its_own_runs_none_of_it(tmp_path, capsys, monkeypatch):
    """Before, transformers asked on stdin whether to run the directory's code, and ran it on "y"."""
    import io
    import json

    hf, marker = tmp_path / "hf", tmp_path / "ran"
    hf.mkdir()
    (hf / "evil.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    (hf / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {
        "AutoConfig": "evil.EvilConfig", "AutoModelForSeq2SeqLM": "evil.EvilModel"}}))
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 4))
    assert main(["import", str(hf), str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys)
    assert "config.json: auto_map" in line and "nmt runs no code" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_an_attention_kernel_or_pickled_weights_are_refused_before_transformers_loads(marian_dir, tmp_path, capsys):
    import json
    import shutil

    kernel, pickled = tmp_path / "kernel", tmp_path / "pickled"
    for d in (kernel, pickled):
        shutil.copytree(marian_dir, d)
    config = json.loads((kernel / "config.json").read_text())
    (kernel / "config.json").write_text(json.dumps(config | {"attn_implementation": "kernels-community/flash-attn"}))
    assert main(["import", str(kernel), str(tmp_path / "out")]) == 2  # before: transformers tried to fetch it
    assert "attn_implementation 'kernels-community/flash-attn'" in _one_error_line(capsys)

    class Planted:  # unpickling it would create the marker
        def __reduce__(self):
            return open, (str(tmp_path / "ran"), "w")

    (pickled / "model.safetensors").unlink()
    torch.save({"model.shared.weight": Planted()}, pickled / "pytorch_model.bin")
    assert main(["import", str(pickled), str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys)
    assert "pytorch_model.bin), which nmt never reads" in line and "save_pretrained(DIR, safe_serialization=True)" in line
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_an_imported_marian_tokenizer_gives_transformers_ids(marian_dir, marian_nmt):
    ours, theirs = PairTokenizer.load(marian_nmt), transformers.MarianTokenizer.from_pretrained(marian_dir)
    assert ours.joint and not ours.one_file  # one segmenter per side, over one joint vocabulary
    assert ours.encode_src(SENTENCES) == theirs(SENTENCES).input_ids
    # (a run of characters the target model does not know is one <unk> there, but several pieces here)
    assert [t + [0] for t in ours.encode_tgt(TARGETS)] == theirs(text_target=TARGETS).input_ids
    ids = theirs(text_target=TARGETS).input_ids
    assert ours.decode_tgt(ids) == theirs.batch_decode(ids, skip_special_tokens=True)


def test_an_imported_marian_model_translates_as_transformers_generates(marian_dir, marian_nmt):
    """Greedy search, pad never emitted, </s> forced at the length limit: what generate does for Marian."""
    hf = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
    tok = transformers.MarianTokenizer.from_pretrained(marian_dir)
    translator = Translator.from_pretrained(marian_nmt)
    ours = translator.translate(SENTENCES[:4], beam_size=1, max_new_tokens=12, max_len_a=12, max_len_b=0)
    batch = tok(SENTENCES[:4], return_tensors="pt", padding=True)
    out = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=12, suppress_tokens=[hf.config.pad_token_id])
    assert ours == tok.batch_decode(out, skip_special_tokens=True)


def test_an_imported_marian_model_fine_tunes_through_init_from(marian_nmt, corpus_dir, tmp_path, fresh_accelerate_state):
    before = open_model(marian_nmt).model
    code = main(["train", "--init-from", str(marian_nmt), "--data.train", str(corpus_dir / "train"),
                 "--data.valid", str(corpus_dir / "valid"), "--data.test", str(corpus_dir / "test"),
                 "--data.cache_dir", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "run"),
                 "--max_steps", "3", "--max_tokens", "400", "--eval_max_sentences", "4"])
    assert code == 0
    after = open_model(tmp_path / "run" / "model").model
    assert after.cfg == before.cfg  # Marian's architecture and ids kept
    assert not torch.equal(after.tgt_embed.weight, before.tgt_embed.weight)  # trained
    assert torch.equal(after.final_logits_bias, before.final_logits_bias)  # a buffer, as in Marian
    for name in ("tokenizer.src.json", "tokenizer.tgt.json"):
        assert (tmp_path / "run" / "model" / name).read_bytes() == (marian_nmt / name).read_bytes()


# --- M2M100 with language tokens -------------------------------------------------------------------------------------


def test_an_imported_m2m100_model_tags_the_source_and_forces_the_target_language(tmp_path):
    """The source gets its language token, the decoder its target language token first, as transformers'
    M2M100 tokenizer (src_lang) and generate (forced_bos_token_id) do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator([t for p in PAIRS for t in p], trainers.UnigramTrainer(
        vocab_size=70, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    tok.add_special_tokens(["__en__", "__xx__"])
    tok.post_processor = processors.TemplateProcessing(single="__en__ $A </s>", special_tokens=[
        ("__en__", tok.token_to_id("__en__")), ("</s>", 2)])  # as NLLB's tokenizer.json has it
    hf_dir = tmp_path / "m2m"
    _m2m100(vocab=tok.get_vocab_size() + 3, d_model=32).save_pretrained(hf_dir)  # rows rounded up, as published
    tok.save(str(hf_dir / "tokenizer.json"))
    assert main(["import", str(hf_dir), str(tmp_path / "out")]) == 2  # the languages are needed
    assert main(["import", str(hf_dir), str(tmp_path / "out"), "--src-lang", "__en__", "--tgt-lang", "__xx__"]) == 0
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), eos_token="</s>",
                                                  pad_token="<pad>", unk_token="<unk>")
    translator = Translator.from_pretrained(tmp_path / "out")
    assert translator.tokenizer.encode_src(SENTENCES) == theirs(SENTENCES).input_ids
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(hf_dir).eval()
    batch = theirs(SENTENCES[:4], return_tensors="pt", padding=True)
    out = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=10, forced_eos_token_id=2,
                      forced_bos_token_id=tok.token_to_id("__xx__"), suppress_tokens=[1])
    assert out[:, 1].eq(tok.token_to_id("__xx__")).all()
    ours = translator.translate(SENTENCES[:4], beam_size=1, max_new_tokens=10, max_len_a=10, max_len_b=0)
    assert ours == theirs.batch_decode(out, skip_special_tokens=True)


NLLB_CODES = ["deu_Latn", "eng_Latn", "fra_Latn", "zho_Hans", "zho_Hant"]


@pytest.fixture(scope="module")
def nllb(tmp_path_factory) -> tuple[Path, Path]:
    """An NLLB-style M2M100 directory (tokenizer.json with NLLB's language tokens, a random model) and its import
    with --src-lang en and no target language: every language of the model stays one to translate into."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator([t for p in PAIRS for t in p], trainers.UnigramTrainer(
        vocab_size=70, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    tok.add_special_tokens(NLLB_CODES)
    tok.post_processor = processors.TemplateProcessing(single="eng_Latn $A </s>", special_tokens=[
        ("eng_Latn", tok.token_to_id("eng_Latn")), ("</s>", 2)])
    hf_dir = tmp_path_factory.mktemp("nllb") / "hf"
    # weights of a trained model's scale: a source's language token moves its translation's score
    _m2m100(vocab=tok.get_vocab_size(), d_model=32, init_std=0.3).save_pretrained(hf_dir)
    tok.save(str(hf_dir / "tokenizer.json"))
    out = hf_dir.parent / "out"
    assert main(["import", str(hf_dir), str(out), "--src-lang", "en"]) == 0
    return hf_dir, out


def test_an_nllb_import_translates_into_each_of_its_languages_by_short_code(nllb, caplog, capsys):
    """`--tgt-lang de` is deu_Latn (said), the forced first token generate is given; the import keeps every language
    for nmt translate and the server."""
    hf_dir, out = nllb
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), eos_token="</s>",
                                                  pad_token="<pad>", unk_token="<unk>")
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(hf_dir).eval()
    batch = theirs(SENTENCES[:4], return_tensors="pt", padding=True)
    translator = Translator.from_pretrained(out)
    assert translator.target_languages == NLLB_CODES
    for given, code in (("de", "deu_Latn"), ("fra_Latn", "fra_Latn"), ("zho_Hant", "zho_Hant")):
        out_ids = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=10, forced_eos_token_id=2,
                              forced_bos_token_id=theirs.convert_tokens_to_ids(code), suppress_tokens=[1])
        with caplog.at_level("INFO", logger="nmt"):
            ours = translator.translate(SENTENCES[:4], beam_size=1, max_new_tokens=10, max_len_a=10, max_len_b=0,
                                        tgt_lang=given)
        assert ours == theirs.batch_decode(out_ids, skip_special_tokens=True), given
    assert "target language de is deu_Latn in this model" in caplog.text
    listed = "deu_Latn, eng_Latn, fra_Latn, zho_Hans, zho_Hant"
    capsys.readouterr()  # transformers' progress bars
    for args, says in ((["--tgt-lang", "xx"], f"choose one of {listed}"), (["--tgt-lang", "zh"], f"choose one of {listed}"),
                       ([], f"give the target language (--tgt-lang, tgt_lang=), one of {listed}")):
        assert main(["translate", str(out), "--input", str(hf_dir / "config.json"), *args]) == 2
        assert says in _one_error_line(capsys)
    for code, says in (("ja", f"'ja' is not a language of this model; its languages: {listed}"),
                       ("zh", "(zh could be zho_Hans or zho_Hant: give one)")):
        assert main(["import", str(hf_dir), str(out.parent / code), "--src-lang", code]) == 2
        assert says in _one_error_line(capsys)

    from helpers import serving

    with serving(out) as server:
        assert server.call("GET", "/info")[1]["target_languages"] == NLLB_CODES
        status, body = server.call("POST", "/translate", {"sentences": SENTENCES[:2], "tgt_lang": "de"})
        assert status == 200 and len(body["translations"]) == 2
        assert server.call("POST", "/translate", {"sentences": SENTENCES[:2], "tgt_lang": "xx"})[0] == 400



def test_an_nllb_import_reads_the_source_language_it_is_told_or_tells_it(nllb, marian_nmt, tmp_path, caplog, capsys):
    """src_lang (--src-lang, the server's src_lang, LibreTranslate's source) starts each source with its language's
    token in place of the import's, as transformers' tokenizer given that src_lang does; "auto" tells each sentence's
    language (one too short to tell keeps the import's, said). A model that reads its languages untold refuses it."""
    pytest.importorskip("py3langid")
    hf_dir, out = nllb
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), eos_token="</s>",
                                                  pad_token="<pad>", unk_token="<unk>")
    hf = transformers.M2M100ForConditionalGeneration.from_pretrained(hf_dir).eval()
    lines = ["Der Hund schläft heute unter dem großen Baum im Garten.",
             "Le chien dort aujourd'hui sous le grand arbre du jardin.",
             "The dog sleeps under the big tree in the garden today.", "OK"]
    search = dict(beam_size=1, max_new_tokens=10, max_len_a=10, max_len_b=0, tgt_lang="fra_Latn")

    def generate(codes: list[str]) -> list[str]:
        ids = [[theirs.convert_tokens_to_ids(code), *theirs(line).input_ids[1:]] for code, line in zip(codes, lines)]
        out_ids = hf.generate(**theirs.pad({"input_ids": ids}, return_tensors="pt"), num_beams=1, do_sample=False,
                              max_new_tokens=10, forced_eos_token_id=2, suppress_tokens=[1],
                              forced_bos_token_id=theirs.convert_tokens_to_ids("fra_Latn"))
        return theirs.batch_decode(out_ids, skip_special_tokens=True)

    translator = Translator.from_pretrained(out)
    assert translator.source_languages == NLLB_CODES
    assert translator.translate(lines, **search) == generate(["eng_Latn"] * 4)
    with caplog.at_level("INFO", logger="nmt"):
        auto = translator.translations(lines, src_lang="auto", **search)
        each = [translator.translations([line], src_lang=code, **search)[0]
                for line, code in zip(lines, ["de", "fr", "eng_Latn", "eng_Latn"])]
    assert [a.text for a in auto] == [e.text for e in each] == generate(["deu_Latn", "fra_Latn", "eng_Latn", "eng_Latn"])
    assert [a.score for a in auto] == pytest.approx([e.score for e in each], abs=1e-4)
    imported = translator.translations(lines, **search)
    assert all(abs(a.score - i.score) > 1e-3 for a, i in zip(auto[:2], imported[:2]))  # the token is read
    assert [a.score for a in auto[2:]] == pytest.approx([i.score for i in imported[2:]], abs=1e-4)
    assert "1 of 4 sentences are too short to tell their language" in caplog.text
    assert "source language de is deu_Latn in this model" in caplog.text

    source = tmp_path / "mixed.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(out), "--input", str(source), "--src-lang", "auto", "--tgt-lang", "fr"]) == 0
    by_cli = capsys.readouterr().out.splitlines()
    assert by_cli == translator.translate(lines, src_lang="auto", tgt_lang="fr")
    for model, flags, says in ((out, ["ja", "--tgt-lang", "fr"], "source language 'ja' is not a language of this "
                                "model; its languages: "), (marian_nmt, ["de"], "this model takes no source language")):
        assert main(["translate", str(model), "--input", str(source), "--src-lang", *flags]) == 2
        assert says in _one_error_line(capsys)

    from helpers import serving

    with serving(out) as server:
        status, body = server.call("POST", "/translate", {"sentences": lines, "tgt_lang": "fr", "src_lang": "auto"})
        assert status == 200 and body["translations"] == by_cli
        status, body = server.call("POST", "/translate", {"sentences": lines, "tgt_lang": "fr", "src_lang": "ja"})
        assert status == 400 and "'ja' is not a language of this model" in body["error"]
        # LibreTranslate's codes are those GET /languages lists: the model's own
        status, body = server.call("POST", "/translate", {"q": lines[0], "source": "deu_Latn", "target": "fra_Latn"})
        assert status == 200 and body["translatedText"] == by_cli[0]
        status, body = server.call("POST", "/translate", {"q": lines[1], "source": "auto", "target": "deu_Latn"})
        assert status == 200 and body["detectedLanguage"]["language"] == "fra_Latn"
        assert body["translatedText"] == translator.translate(lines[1:2], src_lang="fr", tgt_lang="de")[0]


def test_a_fine_tuned_multilingual_import_keeps_its_languages(nllb, corpus_dir, tmp_path, fresh_accelerate_state):
    """Fine-tuning an NLLB import into one language keeps the model's languages: the fine-tuned directory
    translates into each of them, as the import did."""
    hf_dir, _ = nllb
    start = tmp_path / "start"
    assert main(["import", str(hf_dir), str(start), "--src-lang", "en", "--tgt-lang", "de"]) == 0
    assert main(["train", "--init-from", str(start), "--data.train", str(corpus_dir / "train"),
                 "--data.valid", str(corpus_dir / "valid"), "--data.cache_dir", str(tmp_path / "cache"),
                 "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--max_tokens", "400",
                 "--eval_max_sentences", "4"]) == 0
    translator = Translator.from_pretrained(tmp_path / "run" / "model")
    assert translator.target_languages == NLLB_CODES
    assert len(translator.translate(SENTENCES[:2], beam_size=1, max_new_tokens=4, tgt_lang="fr")) == 2

# --- export ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pre_norm, act, arch", [(True, "relu", "PegasusForConditionalGeneration"),
                                                 (False, "gelu", "MarianMTModel")])
def test_an_exported_model_computes_nmt_logits_and_imports_back(pre_norm, act, arch, tmp_path):
    """nmt's defaults (pre-norm, interleaved sinusoids) export exactly, through a permutation of the residual
    stream; post-norm as Marian. Importing the export gives nmt's logits back."""
    from helpers import model_dir

    directory = model_dir(tmp_path / "m", seed=4, layers=2)
    model = tiny_model(seed=4, vocab=open_model(directory).model.cfg.src_vocab_size, layers=2,
                       pre_norm=pre_norm, activation=act)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    assert main(["export", str(directory), "--to", "transformers", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == arch
    _assert_same_logits(hf, model, pad=0, eos=3, start=2)
    back = model_from_hf(tmp_path / "hf")
    src, tgt = _batch(0, 3, 2)
    with torch.no_grad():
        torch.testing.assert_close(back(src, tgt), model(src, tgt), atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    try:
        return train(tiny_config(corpus_dir, out, max_steps=60, eval_every=1000, save_every=1000)).model_dir
    finally:
        reset_accelerate_state()


def test_transformers_translates_an_exported_model_as_nmt_translate_does(trained, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(trained), "--to", "transformers", str(out)]) == 0
    (tmp_path / "in.txt").write_text("".join(s + "\n" for s in SENTENCES[:6]), encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", str(trained), "--beam", "1", "--input", str(tmp_path / "in.txt")]) == 0
    ours = capsys.readouterr().out.splitlines()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    # the "translation" pipeline (transformers < 5) is tokenizer -> generate -> batch_decode, as here
    theirs = []
    for sentence in SENTENCES[:6]:
        ids = tok(sentence, return_tensors="pt").input_ids
        limit = min(10 + 2 * ids.shape[1], 256)  # nmt's default length limit: 10 + 2 * source length
        generated = hf.generate(ids, max_new_tokens=limit, forced_eos_token_id=3)
        theirs += tok.batch_decode(generated, skip_special_tokens=True)
    assert ours == theirs


def test_what_cannot_be_exported_or_overwritten_is_refused(trained, tmp_path, capsys):
    separate, tokenizer = tmp_path / "separate", PairTokenizer.load(trained)
    tiny_model(vocab=tokenizer.src_vocab_size, share=False).save_pretrained(separate)
    tokenizer.save(separate)
    assert main(["export", str(separate), "--to", "transformers", str(tmp_path / "x")]) == 2
    assert "model.share_embeddings is false" in capsys.readouterr().err and not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    assert main(["export", str(trained), "--to", "transformers", str(tmp_path / "full")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err and (tmp_path / "full" / "keep.txt").is_file()
    assert main(["import", str(trained), str(trained)]) == 2
    assert "which this command reads" in capsys.readouterr().err
