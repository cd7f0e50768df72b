"""`nmt backtranslate`: an aligned synthetic corpus, tagged on request, streamed a chunk at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from nmt.cli import main


@pytest.fixture(scope="module")
def model_dir(corpus_dir, tmp_path_factory) -> Path:
    """A tiny en -> xx model: here it plays the reverse model that turns "monolingual" en text into xx sources."""
    from nmt import train
    from nmt.compat import reset_accelerate_state
    from tests.conftest import tiny_config

    result = train(tiny_config(corpus_dir, tmp_path_factory.mktemp("bt"), max_steps=6, eval_every=6, save_every=6))
    reset_accelerate_state()
    return result.model_dir


@pytest.fixture
def mono(corpus_dir, tmp_path) -> Path:
    lines = (corpus_dir / "test.en").read_text(encoding="utf-8").splitlines()[:7]
    path = tmp_path / "mono.en"
    path.write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n", encoding="utf-8")  # line 4 is blank
    return path


def test_writes_an_aligned_tagged_corpus_equal_to_translate(model_dir, mono, tmp_path, capsys):
    from nmt import Translator

    assert main(["backtranslate", str(model_dir), "--input", str(mono), "--output", str(tmp_path / "syn" / "bt"),
                 "--tag", "--beam", "2"]) == 0
    assert "wrote 7 pairs" in capsys.readouterr().out
    text = [s for s in mono.read_text(encoding="utf-8").splitlines() if s]
    # the model translates en -> xx, so its translations are the synthetic xx sources of an xx -> en corpus
    sources = (tmp_path / "syn" / "bt.xx").read_text(encoding="utf-8").splitlines()
    assert (tmp_path / "syn" / "bt.en").read_text(encoding="utf-8").splitlines() == text
    expected = Translator.from_pretrained(model_dir).translate(text, beam_size=2)
    assert sources == [f"<bt> {t}" for t in expected]


def test_chunks_failed_lines_and_decoding_options(model_dir, mono, tmp_path, monkeypatch, capsys, caplog):
    from nmt.translate import Translator

    lines = mono.read_text(encoding="utf-8").splitlines()
    lines[5] = "POISON " + lines[5]  # input line 6
    mono.write_text("\n".join(lines) + "\n", encoding="utf-8")
    calls = []
    real = Translator.translations

    def translations(self, texts, *args, **kw):
        calls.append((len(texts), kw))
        if any("POISON" in t for t in texts):
            raise RuntimeError("simulated failure")
        return real(self, texts, *args, **kw)

    monkeypatch.setattr(Translator, "translations", translations)
    code = main(["backtranslate", str(model_dir), "--input", str(mono), "--output", str(tmp_path / "bt"),
                 "--chunk-size", "3", "--beam", "1", "--alpha", "0.3", "--src-lang", "de", "--tgt-lang", "en",
                 "--sampling", "--topk", "5", "--seed", "7"])
    assert code == 1 and "input line(s) 6 could not be translated" in capsys.readouterr().err
    assert max(n for n, _ in calls) <= 3  # a chunk at a time: memory stays flat on any input size
    assert all(kw["beam_size"] == 1 and kw["alpha"] == 0.3 and kw["sampling"].topk == 5
               for _, kw in calls)  # sampled back-translation: the sampling flags reach the model
    seeds = [kw["sampling"].seed for n, kw in calls if n > 1]  # each chunk (lines retried alone aside)
    assert seeds[0] == 7 and len(set(seeds)) == len(seeds)  # the chunks draw from streams of their own
    kept = [s for s in lines if s and "POISON" not in s]
    assert (tmp_path / "bt.en").read_text(encoding="utf-8").splitlines() == kept  # the failed line left out of both
    assert len((tmp_path / "bt.de").read_text(encoding="utf-8").splitlines()) == len(kept)


def test_decoding_keywords_reach_translate_as_they_are(mono, tmp_path):
    from nmt.tools.backtranslate import backtranslate

    class Recorder:
        def translate_stream(self, lines, chunk_size, failed, **decode):
            self.decode = decode
            return (line.upper() for line in lines)

    rec = Recorder()
    result = backtranslate(rec, mono, tmp_path / "b.xx", tmp_path / "b.en", beam_size=1, sampling={"topk": 5})
    assert rec.decode == {"beam_size": 1, "sampling": {"topk": 5}} and result.pairs == 7 and result.empty == 1


@pytest.mark.parametrize("args, needle", [
    (["--tag", "a b"], "--tag must be one token"),
    (["--src-lang", "en", "--tgt-lang", "en"], "both 'en'"),
    (["--output", "{mono_prefix}"], "--output {mono_prefix}.en is --input {mono}: writing it would destroy the input"),
    (["--input", "{tmp}/missing.en"], "file not found"),
])
def test_user_errors(model_dir, mono, tmp_path, capsys, args, needle):
    args = [a.format(mono_prefix=mono.with_suffix(""), tmp=tmp_path) for a in args]  # a later flag wins
    before = mono.read_bytes()
    assert main(["backtranslate", str(model_dir), "--input", str(mono), "--output", str(tmp_path / "out"), *args]) == 2
    assert needle.format(mono_prefix=mono.with_suffix(""), mono=mono) in capsys.readouterr().err
    assert mono.read_bytes() == before


def test_a_reserved_tag_stays_one_token_and_is_not_decoded():
    from nmt.config import TokenizerConfig
    from nmt.synthetic import generate_pairs
    from nmt.tokenizer import PairTokenizer, train_tokenizer

    pairs = generate_pairs(200, seed=3)
    texts = [a for a, _ in pairs] + [f"<bt> {b}" for _, b in pairs]
    for kind in ("bpe", "unigram"):
        tok = PairTokenizer(train_tokenizer(texts, TokenizerConfig(kind=kind, vocab_size=120, reserved=["<bt>"])))
        ids = tok.encode_src(["<bt> I am young."])[0]
        assert ids[0] == 4 and 4 not in ids[1:]  # training data's leading tag is the tag
        for typed in ("<bt> I am young.", "I am <bt> young </s> <pad>", "<s><unk>"):  # by a user: text, not controls
            typed_ids = [*tok.encode_src([typed], leading_tags=False)[0][:-1], *tok.encode_tgt([typed])[0]]
            assert not {0, 2, 3, 4} & set(typed_ids)  # (<unk> 1: a character the vocabulary lacks)
        assert tok.decode_tgt([ids]) == tok.decode_tgt([ids[1:]])  # the tag never shows in translations
        plain = PairTokenizer(train_tokenizer(texts, TokenizerConfig(kind=kind, vocab_size=120)))
        assert plain.src_tokens("<bt> I am young.")[0] != "<bt>"  # without reserved, the tag is ordinary text


def test_the_loop_trains_a_forward_model_on_real_and_weighted_tagged_synthetic_pairs(model_dir, corpus_dir, tmp_path,
                                                                                       capsys, fresh_accelerate_state):
    """README's three steps end to end: the en -> xx model back-translates monolingual en text into synthetic xx
    sources; an xx -> en model trains on the real corpus once and the tagged synthetic one twice per epoch, with
    <bt> one reserved token of its own; its translations of real sources never show the tag."""
    from nmt import Translator, train
    from nmt.config import DataConfig, TokenizerConfig
    from nmt.data import prepare
    from nmt.synthetic import generate_pairs
    from tests.conftest import tiny_config

    mono = tmp_path / "mono.en"
    mono.write_text("".join(en + "\n" for en, _ in generate_pairs(60, seed=11)), encoding="utf-8")
    assert main(["backtranslate", str(model_dir), "--input", str(mono), "--output", str(tmp_path / "bt"), "--tag",
                 "--beam", "1"]) == 0
    assert (tmp_path / "bt.en").read_text(encoding="utf-8") == mono.read_text(encoding="utf-8")  # real targets
    data = DataConfig(train=[str(corpus_dir / "train"), str(tmp_path / "bt")], weights=[1, 2], src_lang="xx",
                      tgt_lang="en", valid=str(corpus_dir / "valid"), test=str(corpus_dir / "test"),
                      cache_dir=str(tmp_path / "cache"))
    cfg = tiny_config(corpus_dir, tmp_path, data=data, tokenizer=TokenizerConfig(vocab_size=300, reserved=["<bt>"]),
                      max_steps=6, eval_every=6, save_every=6)
    result = train(cfg)
    fresh_accelerate_state()
    corpus = prepare(cfg.data, cfg.tokenizer)  # the run's cache: the pairs it trained on
    real, synthetic = corpus.stats.corpora
    assert real["pairs"] == real["per_epoch"] > 500 and synthetic["train"] == str(tmp_path / "bt")
    assert synthetic["pairs"] > 0 and synthetic["per_epoch"] == 2 * synthetic["pairs"]  # weight 2: twice an epoch
    firsts = [ids[0] for ids in corpus.splits["train"]["src_ids"]]
    starts = [firsts[i] for i in corpus.epoch_rows(0)]  # the pairs an epoch reads
    assert len(starts) == real["per_epoch"] + synthetic["per_epoch"]
    assert starts.count(4) == synthetic["per_epoch"]  # every synthetic source, and only those, opens with <bt>
    assert (result.model_dir / "tokenizer.json").is_file()
    hyps = Translator.from_pretrained(result.model_dir).translate(["<bt> " + corpus.splits["test"]["src"][0]])
    assert "<bt>" not in hyps[0]


def test_languages_from_the_model_directory_name_no_file_outside_the_output_folder(model_dir, mono, tmp_path, capsys):
    import json
    import shutil

    planted = tmp_path / "planted"
    shutil.copytree(model_dir, planted)
    summary = json.loads((planted / "training.json").read_text(encoding="utf-8"))
    summary["config"]["data"]["tgt_lang"] = "de/../../victimdir/notes.txt"  # before: victimdir/notes.txt was replaced
    (planted / "training.json").write_text(json.dumps(summary), encoding="utf-8")
    (tmp_path / "victimdir").mkdir()
    (tmp_path / "victimdir" / "notes.txt").write_text("mine")
    syn = tmp_path / "syn"
    syn.mkdir()
    (syn / "bt.en").symlink_to(tmp_path / "victimdir" / "notes.txt")
    cases = [([str(planted)], "training.json: config.data.tgt_lang: 'de/../../victimdir/notes.txt' is not a language"),
             ([str(model_dir), "--src-lang", "../x"], "--src-lang: '../x' is not a language code"),
             ([str(model_dir)], f"--output {syn / 'bt.en'} resolves to {tmp_path / 'victimdir' / 'notes.txt'}, outside")]
    for args, needle in cases:
        assert main(["backtranslate", *args, "--input", str(mono), "--output", str(syn / "bt")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert (tmp_path / "victimdir" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in syn.iterdir()) == ["bt.en"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "mono.en", "planted", "syn", "victimdir"]
