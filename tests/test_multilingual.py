"""Multilingual training: corpora with languages of their own, target-language tags on the source, corpora mixed
by temperature, validation per language pair, and the target language asked for at translation time.

One tiny two-pair run (the synthetic corpus en->xx and, sides swapped, xx->en) is shared by the module.
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.batching import TokenBatchSampler
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.config import load_config
from nmt.errors import NmtError
from nmt.mixing import Mixing, epoch_draws, epoch_shares
from nmt.train import train
from nmt.translate import Translator
from tests.conftest import multilingual_config


@pytest.fixture(scope="module")
def run(corpus_dir, tmp_path_factory):
    """A finished two-pair run mixed at temperature 5: its config and output directory."""
    out = tmp_path_factory.mktemp("multilingual")
    cfg = multilingual_config(corpus_dir, out, temperature=5.0, max_steps=12, eval_every=6)
    reset_accelerate_state()
    train(cfg)
    reset_accelerate_state()
    return cfg, Path(cfg.output_dir)


@pytest.mark.parametrize("override, error", [
    ("data.train=[a, {path: b, src_lang: de, tgt_lang: 5}]", "'data.train[1].tgt_lang': expected str"),
    ("data.train=[a, {path: b, lang: de}]", "unknown config key 'data.train[1].lang'"),
    ("data.train=[a, {src_lang: de}]", "'data.train[1].path': is required"),
    ("data.train=[a, {path: b, weight: 0}]", "'data.train[1].weight': 0.0 is outside"),
    ("data.train=[a, {path: b, src_lang: 'd e'}]", "'data.train[1].src_lang': 'd e' is not a language code"),
    ("data.train=[a, {path: b, src_lang: xx, tgt_lang: xx}]", "'data.train[1].tgt_lang': equals its src_lang"),
    ("data.valid=[{path: b, weight: 2}]", "'data.valid[0].weight': weights only the training corpora"),
    ("data.temperature=0", "'data.temperature': 0.0 is outside the allowed range (0, 100]"),
    ("data.train=[a, {path: a, src_lang: xx, tgt_lang: en}]\ndata.valid=[{path: v, src_lang: en, tgt_lang: fr}]",
     "'data.valid[0].tgt_lang': 'fr' is no target language of data.train (en, xx)"),
])
def test_config_errors_name_the_key(override, error):
    with pytest.raises(NmtError, match=re.escape(error)):
        load_config(None, override.split("\n"))


def test_a_multilingual_config_resolves_each_corpus_and_needs_a_joint_vocabulary():
    cfg = load_config(None, ["data.train=[a, {path: b, src_lang: de, tgt_lang: en, weight: 2}]", "data.tgt_lang=de"])
    assert [(c.path, c.pair, c.weight) for c in cfg.data.corpora("train")] == [("a", "en-de", 1.0), ("b", "de-en", 2.0)]
    assert cfg.data.is_multilingual and cfg.data.tags() == ["<2de>", "<2en>"]
    assert not load_config(None, ["data.train=[a, b]"]).data.is_multilingual  # one pair: no tags
    assert load_config(None, ["data.multilingual=true"]).data.tags() == ["<2xx>"]  # forced, to extend the model later
    with pytest.raises(NmtError, match="'tokenizer.joint': a multilingual run .* needs one joint vocabulary"):
        load_config(None, ["data.train=[a, {path: b, src_lang: de, tgt_lang: en}]", "tokenizer.joint=false"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10**7), min_size=1, max_size=6), st.floats(0.5, 100))
def test_temperature_shares(sizes, temperature):
    ones = [1.0] * len(sizes)
    shares, proportional = epoch_shares(sizes, ones, temperature), epoch_shares(sizes, ones, 1.0)
    assert shares.sum() == pytest.approx(1.0)
    assert proportional == pytest.approx([n / sum(sizes) for n in sizes])
    powered = [n ** (1 / temperature) for n in sizes]
    assert shares == pytest.approx([p / sum(powered) for p in powered])
    assert epoch_draws(sizes, ones, 1.0) == sizes  # T = 1: each pair once an epoch
    assert max(epoch_shares(sizes, ones, 100.0)) <= max(shares) + 1e-12  # a larger T is flatter
    assert epoch_shares(sizes, ones, 1e6) == pytest.approx([1 / len(sizes)] * len(sizes), rel=1e-3)


def test_a_corpus_the_temperature_shrinks_is_drawn_anew_each_epoch_and_the_sampler_reads_the_draws():
    origin = np.repeat(np.array([0, 1], dtype=np.uint8), [1000, 10])
    draws = epoch_draws([1000, 10], [1, 1], 5.0)
    assert draws[0] < 1000 < 10 * draws[1]  # the large corpus shrinks, the small one is repeated
    mixing = Mixing(origin, draws, seed=1)
    e0, e1 = mixing.rows(0), mixing.rows(1)
    assert len(e0) == len(e1) == sum(draws) and np.array_equal(e0, Mixing(origin, draws, 1).rows(0))  # any process
    assert set(e0[:draws[0]]) != set(e1[:draws[0]])  # another subset of the large corpus each epoch
    seen = set().union(*(set(mixing.rows(epoch)[:draws[0]]) for epoch in range(10)))
    assert seen == set(range(1000))  # within ten epochs every pair of it is read: seen in turn, not cut to a subset
    small = np.bincount(e0[draws[0]:] - 1000, minlength=10)  # whole copies of the small corpus, then a sample
    assert small.sum() == draws[1] and set(small.tolist()) <= {draws[1] // 10, draws[1] // 10 + 1}
    lengths = np.random.default_rng(0).integers(1, 30, size=len(origin))
    sampler = TokenBatchSampler(lengths, max_tokens=120, seed=3, epoch_rows=mixing.rows)
    for epoch in (0, 1):
        read = np.concatenate([np.concatenate(sampler.plan(epoch).micro_batches(step))
                               for step in range(sampler.steps_per_epoch(epoch))])
        assert sorted(read.tolist()) == sorted(mixing.rows(epoch).tolist())  # each draw once, nothing else


def test_tags_are_reserved_and_start_every_source(run):
    cfg, out = run
    translator = Translator.from_pretrained(out / "model")
    tok = translator.tokenizer
    assert [tok.src.token_to_id(t) for t in ("<2en>", "<2xx>")] == [4, 5]  # one token each, inserted by id
    data = json.loads((out / "data.json").read_text())
    assert [(c["pair"], c["pairs"], c["per_epoch"]) for c in data["corpora"]] == [("en-xx", 600, 600),
                                                                                  ("xx-en", 600, 600)]
    assert json.loads((out / "model" / "languages.json").read_text()) == {
        "pairs": ["en-xx", "xx-en"], "target_languages": ["en", "xx"], "tags": {"en": "<2en>", "xx": "<2xx>"}}
    from nmt.data import prepare

    corpus = prepare(cfg.data, cfg.tokenizer, tokenizer=tok)  # the run's cache: what training read
    train_src = corpus.splits["train"]["src_ids"]
    assert {ids[0] for ids in train_src[:600]} == {5} and {ids[0] for ids in train_src[600:]} == {4}
    assert corpus.stats.eval_pairs["valid"] == [["en-xx", 40], ["xx-en", 40]]


def test_validation_is_scored_per_pair_and_the_best_by_their_mean(run):
    _, out = run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in rows if "bleu" in r]
    assert [r["step"] for r in valid] == [6, 12]
    for r in valid:
        assert r["bleu"] == pytest.approx((r["bleu_en-xx"] + r["bleu_xx-en"]) / 2)
        assert r["chrf"] == pytest.approx((r["chrf_en-xx"] + r["chrf_xx-en"]) / 2)
    best = json.loads((out / "best" / "training.json").read_text())
    assert best["metrics"]["bleu"] == max(r["bleu"] for r in valid)
    assert best["step"] == min(valid, key=lambda r: (-r["bleu"], r["valid_nll"]))["step"]  # a BLEU tie: the loss


def test_translate_asks_for_the_target_language(run, corpus_dir, tmp_path, capsys):
    _, out = run
    model = out / "model"
    lines = (corpus_dir / "test.xx").read_text().splitlines()[:5]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    assert main(["translate", str(model), "--tgt-lang", "en", "--beam", "1", "--input", str(tmp_path / "in.txt"),
                 "--output", str(tmp_path / "out.txt")]) == 0
    translator = Translator.from_pretrained(model)
    into_en = translator.translate(lines, beam_size=1, tgt_lang="en")
    assert (tmp_path / "out.txt").read_text().splitlines() == into_en
    refs = (corpus_dir / "test.en").read_text().splitlines()[:5]
    as_en, as_xx = (translator.score(lines, refs, tgt_lang=lang) for lang in ("en", "xx"))
    assert all(a.total != b.total for a, b in zip(as_en, as_xx))  # the tag reaches the model
    assert main(["translate", str(model), "--input", str(tmp_path / "in.txt")]) == 2  # a usage error
    assert "give the target language (--tgt-lang, tgt_lang=), one of en, xx" in capsys.readouterr().err
    with pytest.raises(NmtError, match="target language 'de' is not one this model translates into; choose one of en, xx"):
        translator.translate(lines, tgt_lang="de")


@pytest.mark.parametrize("change, needle", [
    ({"tags": {"en": "</s>", "xx": "<2xx>"}}, "tags['en'] is '</s>'"),  # before: </s> started every source
    ({"target_languages": ["en", "../xx"]}, "target_languages[1]: '../xx' is not a language code"),
])
def test_a_planted_languages_json_is_refused_in_one_line(run, corpus_dir, tmp_path, capsys, change, needle):
    import shutil

    _, out = run
    model = tmp_path / "model"
    shutil.copytree(out / "model", model)
    record = json.loads((model / "languages.json").read_text())
    (model / "languages.json").write_text(json.dumps(record | change))
    assert main(["translate", str(model), "--tgt-lang", "en", "--input", str(corpus_dir / "test.xx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "languages.json" in err[0], err


def test_every_piece_of_a_split_source_starts_with_the_tag(run, monkeypatch):
    import nmt.engines

    _, out = run
    translator = Translator.from_pretrained(out / "model")
    seen = []
    real = nmt.engines.search_encoded
    monkeypatch.setattr(nmt.engines, "search_encoded", lambda model, pieces, *a, **k: seen.extend(pieces) or
                        real(model, pieces, *a, **k))
    limit = translator.model.cfg.max_positions
    long = " ".join(["mu dina ba"] * limit)
    translator.translate([long], beam_size=1, long_inputs="split", tgt_lang="en", max_new_tokens=4)
    assert len(seen) > 1 and all(p[0] == 4 and len(p) <= limit for p in seen)


def test_back_translation_into_a_language_and_its_corpus_weighted_beside_the_others(run, corpus_dir, tmp_path):
    """The reverse model is multilingual: `nmt backtranslate` translates into the synthetic sources' language; the
    tagged back-translated corpus then trains with a weight, its sources led by the target tag and <bt>."""
    from nmt.config import DataConfig, TokenizerConfig
    from nmt.data import prepare

    cfg, out = run
    mono = (corpus_dir / "test.en").read_text().splitlines()[:8]
    (tmp_path / "mono.en").write_text("\n".join(mono) + "\n")
    assert main(["backtranslate", str(out / "model"), "--input", str(tmp_path / "mono.en"), "--output",
                 str(tmp_path / "bt"), "--src-lang", "xx", "--tgt-lang", "en", "--tag", "--beam", "1"]) == 0
    into_xx = Translator.from_pretrained(out / "model").translate(mono, beam_size=1, tgt_lang="xx")
    assert (tmp_path / "bt.xx").read_text().splitlines() == [f"<bt> {t}" for t in into_xx]
    data = DataConfig(train=[*cfg.data.train, {"path": str(tmp_path / "bt"), "src_lang": "xx", "tgt_lang": "en",
                                               "weight": 2}], valid=cfg.data.valid, test=cfg.data.test,
                      cache_dir=cfg.data.cache_dir, dedupe=False, max_ratio=1000)
    corpus = prepare(data, TokenizerConfig(vocab_size=300, reserved=["<bt>"]))
    tok = corpus.tokenizer.src
    assert [(c["pair"], c["pairs"], c["per_epoch"]) for c in corpus.stats.corpora][2] == ("xx-en", 8, 16)
    src_ids = corpus.splits["train"]["src_ids"]
    bt = [src_ids[i] for i in corpus.epoch_rows(0)[-16:]]  # the corpus's 16 draws of an epoch
    assert {tuple(ids[:2]) for ids in bt} == {(tok.token_to_id("<2en>"), tok.token_to_id("<bt>"))}


def test_the_server_takes_tgt_lang(run):
    from helpers import serving

    _, out = run
    translator = Translator.from_pretrained(out / "model")
    with serving(out / "model") as server:
        status, body = server.call("POST", "/translate", {"sentences": ["mu dina ba."], "tgt_lang": "en", "beam": 1})
        assert status == 200
        assert body["translations"] == translator.translate(["mu dina ba."], beam_size=1, tgt_lang="en")
        status, body = server.call("POST", "/translate", {"sentences": ["mu dina ba."], "tgt_lang": "de"})
        assert status == 400 and "choose one of en, xx" in body["error"]
        status, body = server.call("POST", "/translate", {"sentences": ["mu dina ba."]})
        assert status == 400 and "give the target language ('tgt_lang'), one of en, xx" in body["error"]
        status, body = server.call("GET", "/info")
        assert status == 200 and body["model"]["languages"]["target_languages"] == ["en", "xx"]


def test_nmt_check_reports_each_corpus_share(corpus_dir, tmp_path, capsys):
    train = corpus_dir / "train"
    (tmp_path / "check.yaml").write_text(f"""
data:
  train:
    - {{path: {train}, weight: 3}}
    - {{path: {train}, src_lang: xx, tgt_lang: en}}
  valid: {corpus_dir / "valid"}
  test: {corpus_dir / "test"}
  temperature: 5
  cache_dir: {tmp_path / "cache"}
tokenizer: {{vocab_size: 300}}
model: {{size: tiny}}
max_tokens: 400
max_steps: 10
""")
    main(["check", "--config", str(tmp_path / "check.yaml"), "--probe-steps", "0"])  # 1: its validation set is tiny
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("corpora"))
    # weighted sizes 1800 and 600 at temperature 5: shares 3^0.2 : 1, an epoch of 2,400 pairs
    assert "en-xx" in line and "1,331 per epoch (55.5%)" in line and "xx-en" in line and "1,069 per epoch (44.5%)" in line
    assert "temperature 5" in line
