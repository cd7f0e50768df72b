"""CTranslate2 (nmt.ct2), the export and its runtime: the exported model scores like ours, greedy-translates like
ours, and every user mistake is one clear line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import BOS, EOS, PAD, one_thread, src_batch, tiny_model  # noqa: F401  (one_thread: module-wide)

from nmt import Translator, train
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.decoding import SamplingConfig, SearchConfig, greedy, length_limits
from nmt.errors import NmtError
from nmt.tokenizer import SPECIALS
from tests.conftest import tiny_config

V = 30
VOCAB = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), V)]


@pytest.fixture(scope="module")
def trained(corpus_dir, tmp_path_factory) -> Path:
    """A tiny model trained long enough that greedy outputs differ by sentence and mostly end on their own."""
    out = tmp_path_factory.mktemp("export")
    cfg = tiny_config(corpus_dir, out, max_steps=700, eval_every=10_000, save_every=10_000, log_every=100)
    try:
        return train(cfg).model_dir
    finally:
        reset_accelerate_state()


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> Path:
    pytest.importorskip("ctranslate2")
    out = tmp_path_factory.mktemp("ct2") / "float32"
    assert main(["export", str(trained), "--to", "ctranslate2", str(out)]) == 0
    return out


@pytest.mark.parametrize("pre_norm,activation,share", [(True, "relu", True), (False, "gelu", True), (True, "gelu", False)])
def test_exported_model_scores_and_searches_like_ours(pre_norm, activation, share, tmp_path):
    """Per-token log-probabilities of forced targets agree for pre-/post-norm, ReLU/GELU, shared/separate
    embeddings (and vocabulary files), with non-zero biases and LayerNorm affines (so no tensor can be
    mapped wrongly unnoticed); greedy through `CT2Model.search` equals ours, length-limit cuts included."""
    ct2 = pytest.importorskip("ctranslate2")
    from nmt.ct2 import CT2Model, save_ctranslate2

    model = tiny_model(seed=7, vocab=V, layers=2, pre_norm=pre_norm, activation=activation, share=share)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    tgt_vocab = VOCAB if share else SPECIALS + [f"t{i}" for i in range(len(SPECIALS), V)]
    save_ctranslate2(model, VOCAB, tgt_vocab, tmp_path)
    assert (tmp_path / ("shared_vocabulary.json" if share else "target_vocabulary.json")).is_file()
    scorer = ct2.Translator(str(tmp_path), compute_type="float32", intra_threads=1)
    src_ids = src_batch(torch.Generator().manual_seed(1), [5, 3, 7], V)
    tgt = torch.randint(4, V, (3, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        lp = torch.log_softmax(model(src_ids, torch.cat([torch.full((3, 1), BOS), tgt], 1)), -1)  # (B, 7, V)
    ours = lp.gather(2, torch.cat([tgt, torch.full((3, 1), EOS)], 1)[..., None])[..., 0]  # words, then </s>
    source = [[VOCAB[i] for i in row if i != PAD] for row in src_ids.tolist()]
    theirs = scorer.score_batch(source, [[tgt_vocab[i] for i in row] for row in tgt.tolist()])  # CT2 adds </s>
    assert torch.allclose(torch.tensor([r.log_probs for r in theirs]), ours, atol=1e-4)
    search = SearchConfig(beam_size=1, max_new_tokens=8)
    found = CT2Model(tmp_path, compute_type="float32", threads=1).search(
        [[i for i in row if i != PAD] for row in src_ids.tolist()], search, batch_tokens=1000)
    assert [found[i][0].tokens for i in range(3)] == [h.tokens for h in greedy(model, src_ids, search)]


def test_export_keeps_the_tuned_alpha(trained, tmp_path):
    """search.json (the alpha training tuned on validation) travels with the export and stays the default."""
    pytest.importorskip("ctranslate2")
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(trained, model_dir)
    (model_dir / "search.json").write_text('{"alpha": 0.9}', encoding="utf-8")
    assert main(["export", str(model_dir), "--to", "ctranslate2", str(tmp_path / "ct2")]) == 0
    assert Translator.from_ctranslate2(tmp_path / "ct2").search_defaults == {"alpha": 0.9}


def test_ct2_greedy_equals_nmt_greedy_on_a_trained_model(trained, exported):
    ct2 = pytest.importorskip("ctranslate2")
    translator = Translator.from_pretrained(trained)
    tok, model = translator.tokenizer, translator.model
    texts = _test_sentences()
    src_ids = tok.encode_src(texts)
    search = SearchConfig(beam_size=1)
    ours = [greedy(model, torch.tensor([ids]), search)[0].tokens for ids in src_ids]
    limits = [int(length_limits(torch.tensor([ids]), PAD, search)) for ids in src_ids]
    natural = sum(len(t) < lim for t, lim in zip(ours, limits))
    assert natural >= 0.8 * len(texts) and len({tuple(t) for t in ours}) >= 0.8 * len(texts)  # not degenerate
    ct2_translator = ct2.Translator(str(exported), compute_type="float32", intra_threads=1)
    by_limit: dict[int, list[int]] = {}
    for i, lim in enumerate(limits):
        by_limit.setdefault(lim, []).append(i)
    for lim, rows in by_limit.items():  # batched CT2 calls; our limit counts </s>, CT2's does not
        results = ct2_translator.translate_batch([tok.src_tokens(texts[i]) for i in rows], beam_size=1,
                                                 max_decoding_length=lim - 1)
        for i, res in zip(rows, results):
            assert res.hypotheses[0] == tok.tgt_tokens([t for t in ours[i] if t != EOS]), texts[i]


def test_translator_and_cli_with_the_export_equal_the_pytorch_model(trained, exported, tmp_path, capsys):
    texts = _test_sentences()[:12]
    ours = Translator.from_pretrained(trained).translate(texts, beam_size=1)
    ct2_translator = Translator.from_ctranslate2(exported)
    assert ct2_translator.backend == "ctranslate2"
    assert ct2_translator.translate(texts, beam_size=1, batch_tokens=64) == ours
    nbest = [t.nbest for t in ct2_translator.translations(texts[:3], beam_size=4, nbest=2)]
    assert [len(n) for n in nbest] == [2, 2, 2] and all(n[0].score >= n[1].score for n in nbest)
    for translator in (Translator.from_pretrained(trained), ct2_translator):  # sampling: top-k 1 is greedy
        assert translator.translate(texts, sampling=SamplingConfig(topk=1)) == ours
        assert translator.translate(texts, sampling=SamplingConfig(temperature=1.5, seed=4)) != ours
    (tmp_path / "in.txt").write_text("".join(t + "\n" for t in texts))
    assert main(["translate", "--ct2", str(exported), "--beam", "1", "--input", str(tmp_path / "in.txt"),
                 "--output", str(tmp_path / "out.txt")]) == 0
    assert (tmp_path / "out.txt").read_text().splitlines() == ours


def test_markup_through_the_export_places_tags_as_the_pytorch_model_does(trained, exported, tmp_path, caplog):
    """format html with --ct2: the tags go where the PyTorch model puts them, through CTranslate2's attention of the
    translation forced (every head of the last layer averaged, as nmt's); an export from before that was recorded
    gives one head's, said once."""
    import json
    import shutil

    words = [t.split() for t in _test_sentences()[:12]]
    texts = [" ".join([w[0], f"<b>{w[1]}</b>", *w[2:-1], f'<i class="x">{w[-1]}</i>']) for w in words]
    ours = Translator.from_pretrained(trained).translate(texts, beam_size=1, format="html")
    assert sum("<b>" in t and "<i" in t for t in ours) == len(texts)
    assert Translator.from_ctranslate2(exported).translate(texts, beam_size=1, format="html", batch_tokens=64) == ours
    old = tmp_path / "old"
    shutil.copytree(exported, old)
    meta = json.loads((old / "nmt_ctranslate2.json").read_text())
    del meta["alignment_heads"]
    (old / "nmt_ctranslate2.json").write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="nmt"):
        Translator.from_ctranslate2(old).translate(texts[:2], beam_size=1, format="html")
    assert caplog.text.count("gives the attention of one head") == 1


def test_with_the_model_beside_the_export_sentences_holding_a_glossary_term_go_to_pytorch(trained, exported, tmp_path,
                                                                                          capsys):
    """nmt translate MODEL_DIR --ct2 DIR --glossary G: the sentences that hold a term are translated by the PyTorch
    model's constrained search, the others by CTranslate2; without MODEL_DIR the glossary is refused saying so."""
    texts = _test_sentences()[:12]
    glossary = [["famous", "Lirosox"]]
    held = [i for i, t in enumerate(texts) if "famous" in t]
    assert 0 < len(held) < len(texts)
    pytorch = Translator.from_pretrained(trained).translate(texts, glossary=glossary)
    ct2 = Translator.from_ctranslate2(exported).translate(texts)
    expected = [pytorch[i] if i in held else ct2[i] for i in range(len(texts))]
    assert all("Lirosox" in expected[i] for i in held)
    assert Translator.from_ctranslate2(exported).with_pytorch(Translator.from_pretrained(trained)).translate(
        texts, glossary=glossary) == expected
    (tmp_path / "in.txt").write_text("".join(t + "\n" for t in texts))
    (tmp_path / "g.tsv").write_text("famous\tLirosox\n")
    flags = ["--ct2", str(exported), "--glossary", str(tmp_path / "g.tsv"), "--input", str(tmp_path / "in.txt")]
    capsys.readouterr()
    assert main(["translate", str(trained), *flags]) == 0
    assert capsys.readouterr().out.splitlines() == expected
    assert main(["translate", *flags]) == 2
    assert "give the PyTorch model too (MODEL_DIR)" in capsys.readouterr().err


def test_int8_export_is_smaller_and_scores_close_to_float32(trained, exported, tmp_path):
    ct2 = pytest.importorskip("ctranslate2")
    out = tmp_path / "int8"
    assert main(["export", str(trained), "--to", "ctranslate2", str(out), "--quantization", "int8"]) == 0
    assert (out / "model.bin").stat().st_size < 0.75 * (exported / "model.bin").stat().st_size
    texts = _test_sentences()[:16]
    assert all(Translator.from_ctranslate2(out).translate(texts, beam_size=4))
    tok = Translator.from_pretrained(trained).tokenizer
    source = [tok.src_tokens(t) for t in texts]
    f32, i8 = (ct2.Translator(str(d), compute_type=c, intra_threads=1) for d, c in ((exported, "float32"), (out, "default")))
    target = [r.hypotheses[0] for r in f32.translate_batch(source, beam_size=1)]
    exact = torch.tensor([x for r in f32.score_batch(source, target) for x in r.log_probs])
    quantized = torch.tensor([x for r in i8.score_batch(source, target) for x in r.log_probs])
    # int8 rounding of a d_model=32 model costs ~0.2 nats a token; a mis-mapped weight would cost several
    assert (exact - quantized).abs().mean() < 0.5


def test_user_errors_are_one_line(trained, exported, tmp_path, capsys):
    def error(argv) -> str:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "error:" in err[0], err
        return err[0]

    assert "not one of" in error(["export", str(trained), "--to", "ctranslate2", str(tmp_path / "q"),
                                  "--quantization", "int3"])
    assert not list(tmp_path.iterdir())  # nothing half-written
    assert "nmt_ctranslate2.json" in error(["translate", "--ct2", str(trained)])
    assert "MODEL_DIR" in error(["translate"])
    assert "--attention needs MODEL_DIR" in error(["translate", "--ct2", str(exported), "--attention",
                                                   str(tmp_path / "a.png")])


def test_force_replaces_only_what_nmt_wrote_and_never_the_model(tmp_path, capsys, monkeypatch):
    pytest.importorskip("ctranslate2")
    from helpers import model_dir

    model = model_dir(tmp_path / "model")
    before = {p.name: p.read_bytes() for p in model.iterdir()}

    def export(out, *force: str) -> str:
        """The one error line of the export, or "" when it wrote OUT."""
        code = main(["export", str(model), "--to", "ctranslate2", str(out), *force])
        err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert code == (2 if err else 0) and len(err) <= 1, (code, err)
        return err[0] if err else ""

    out = tmp_path / "ct2"
    assert export(out) == "" and (out / "model.bin").is_file()
    assert "exists and is not empty" in export(out)
    (out / "model.bin").write_bytes(b"an older export")
    assert export(out, "--force") == "" and (out / "model.bin").read_bytes() != b"an older export"

    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "thesis.tex").write_text("mine")
    (thesis / "config.json").write_text("{}")
    assert "holds what nmt did not write (thesis.tex)" in export(thesis, "--force")
    link = tmp_path / "link"
    link.symlink_to(thesis, target_is_directory=True)  # before: written, then rmtree of the link failed
    assert f"OUT {link} is a symbolic link (to {thesis})" in export(link, "--force")
    run = tmp_path / "run"  # another run's folder: kept, moved aside
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 1\n")
    (run / "notes.txt").write_text("mine")
    assert export(run, "--force") == ""
    assert (run / "model.bin").is_file() and (tmp_path / "run.replaced-1" / "notes.txt").read_text() == "mine"
    for target, words in ((model, f"OUT {model} is {model}"), (tmp_path, f"OUT {tmp_path} holds {model}")):
        assert f"{words}, which this command reads" in export(target, "--force")
    monkeypatch.chdir(thesis)
    assert "OUT . is the working directory" in export(".", "--force")
    assert f"OUT {tmp_path} holds {thesis}, the working directory" in export(tmp_path, "--force")
    monkeypatch.chdir(out)
    monkeypatch.setenv("HOME", str(thesis))
    assert f"OUT {thesis} is your home folder" in export(thesis, "--force")
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    assert (thesis / "thesis.tex").read_text() == "mine" and sorted(p.name for p in thesis.iterdir()) == [
        "config.json", "thesis.tex"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "link", "model", "run", "run.replaced-1", "thesis"]


def test_missing_ctranslate2_names_the_install_command(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` now fails as if not installed
    export = ["export", str(trained), "--to", "ctranslate2", str(tmp_path / "x")]
    for argv in (export, ["translate", "--ct2", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "pip install ctranslate2" in err[0], err
    assert not (tmp_path / "x").exists()
    with pytest.raises(NmtError, match="pip install ctranslate2"):
        Translator.from_ctranslate2(tmp_path)


def _test_sentences() -> list[str]:
    from nmt.synthetic import generate_pairs

    return [src for src, _ in generate_pairs(680, seed=7)[640:]]  # the held-out test split of corpus_dir
