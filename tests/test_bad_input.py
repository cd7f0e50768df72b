"""The catalogue of malformed inputs: each gets a named outcome, never a traceback.

Outcomes: ERROR = one line naming the file (and line), exit code 2, nothing written;
SKIP = the pair is dropped and counted under the named reason; WORKS = read as intended.
"""

import json
from pathlib import Path

import pytest
from helpers import GOOD, assert_error, good_bytes, nmt_train, pair_files

from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.config import DataConfig, TokenizerConfig
from nmt.data import prepare
from tests.conftest import write_pairs

TOK = TokenizerConfig(vocab_size=150, min_frequency=1)


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def prepared(tmp_path, train_spec, **kw):
    cfg = DataConfig(train=str(train_spec), src_lang="en", tgt_lang="de", cache_dir=str(tmp_path / "cache"), **kw)
    return prepare(cfg, TOK)


# --- ERROR: one line, exit 2 -----------------------------------------------------------------------

def test_empty_files(tmp_path, capsys):
    assert_error(*nmt_train(tmp_path, pair_files(tmp_path, b"", b""), capsys), "no training pairs", "empty file")
    assert not (tmp_path / "run").exists()


def test_mismatched_line_counts(tmp_path, capsys):
    spec = pair_files(tmp_path, good_bytes(0), good_bytes(1) + b"extra\n")
    assert_error(*nmt_train(tmp_path, spec, capsys), "train.en has 40 lines", "train.de has 41")


def test_tsv_line_with_one_column(tmp_path, capsys):
    path = tmp_path / "c.tsv"
    path.write_text("".join(f"{a}\t{b}\n" for a, b in GOOD[:5]) + "no tab here\n")
    assert_error(*nmt_train(tmp_path, path, capsys), "c.tsv:6", "expected source<TAB>target")


def test_invalid_utf8(tmp_path, capsys):
    spec = pair_files(tmp_path, good_bytes(0) + b"caf\xc3\x28\n", good_bytes(1) + b"x\n")
    assert_error(*nmt_train(tmp_path, spec, capsys), "train.en:41: not valid UTF-8")


def test_jsonl_line_that_is_not_json(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"en": "a", "de": "b"}) + "\n{'en': 'single quotes'}\n")
    assert_error(*nmt_train(tmp_path, path, capsys), "d.jsonl:2: not valid JSON")


def test_jsonl_missing_field(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"en": "a", "fr": "b"}) + "\n")
    assert_error(*nmt_train(tmp_path, path, capsys), "d.jsonl:1: missing field", "'de'")


def test_jsonl_key_given_twice(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"en": s, "de": t}) for s, t in GOOD[:4]]
    lines[2] = '{"en": "a dog", "de": "ein Hund", "de": "WRONG"}'  # json.loads keeps the last silently
    path.write_text("\n".join(lines) + "\n")
    assert_error(*nmt_train(tmp_path, path, capsys), "d.jsonl:3: key 'de' is given twice", "delete one")
    nested = tmp_path / "n.jsonl"
    nested.write_text('{"translation": {"en": "a", "de": "b", "en": "c"}}\n')
    assert_error(*nmt_train(tmp_path, nested, capsys), "n.jsonl:1: key 'en' is given twice")


def test_csv_field_over_the_csv_limit(tmp_path, capsys):
    path = tmp_path / "c.csv"
    rows = [f'"{s}","{t}"' for s, t in GOOD[:4]]
    rows[2] = '"' + "x" * (128 * 1024 + 1) + '","ein Satz"'  # datasets' DatasetGenerationError before
    path.write_text("en,de\n" + "\n".join(rows) + "\n")
    assert_error(*nmt_train(tmp_path, path, capsys), "c.csv:4:", "131,072 characters", ".tsv or .jsonl")


def test_a_number_of_5000_digits(tmp_path, capsys):
    spec = pair_files(tmp_path, good_bytes(0), good_bytes(1))
    code, err = nmt_train(tmp_path, spec, capsys, "--max_steps", "9" * 5000)  # a ValueError of int() before
    assert_error(code, err, "override 'max_steps': a number of 5,000 digits", "allowed range")
    assert len(err) < 400 and not (tmp_path / "run").exists()
    config = tmp_path / "c.yaml"
    config.write_text(f"optim:\n  warmup_steps: {'9' * 5000}\n")
    assert_error(main(["check", "--config", str(config)]), capsys.readouterr().err, "c.yaml:2: a number of 5,000")
    with pytest.raises(SystemExit) as exit_:
        main(["translate", str(tmp_path), "--beam", "9" * 5000])
    assert exit_.value.code == 2 and "a value of 5,000 characters is outside the allowed range" in \
        capsys.readouterr().err


def test_empty_corpus_after_cleaning(tmp_path, capsys):
    spec = pair_files(tmp_path, b"\n  \n\t\n", b"a\n\n \n")
    assert_error(*nmt_train(tmp_path, spec, capsys), "no training pairs left after cleaning")


def test_validation_set_empty_after_cleaning(tmp_path, capsys):
    spec = pair_files(tmp_path, good_bytes(0), good_bytes(1))
    valid = pair_files(tmp_path, b"\n \n", b"leer\nleer\n", name="valid")
    code, err = nmt_train(tmp_path, spec, capsys, "--data.valid", valid)
    assert_error(code, err, "no valid pairs left after cleaning (2 read; dropped: {'empty': 2})", "data.valid")
    assert not (tmp_path / "run").exists()


def test_config_unknown_key_and_wrong_type(tmp_path, capsys):
    spec = pair_files(tmp_path, good_bytes(0), good_bytes(1))
    code, err = nmt_train(tmp_path, spec, capsys, "--optim.learning_rate", "1")
    assert_error(code, err, "unknown config key 'optim.learning_rate'")
    assert_error(*nmt_train(tmp_path, spec, capsys, "--max_tokens", "lots"), "'max_tokens'", "expected int")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from nmt import train
    from tests.conftest import tiny_config
    tmp = tmp_path_factory.mktemp("bad-model")
    pair_files(tmp, good_bytes(0), good_bytes(1))
    cfg = tiny_config(tmp, tmp, max_steps=2, eval_every=2, save_every=2)
    cfg.data = DataConfig(train=str(tmp / "train"), src_lang="en", tgt_lang="de", cache_dir=str(tmp / "cache"),
                          valid_ratio=0.2, test_ratio=0.1)
    cfg.tokenizer = TOK
    result = train(cfg)
    reset_accelerate_state()
    return result.model_dir


@pytest.mark.parametrize("damage, needle", [
    (lambda d: (d / "config.json").unlink(), "config.json: missing"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json: not valid JSON"),
    (lambda d: (d / "config.json").write_text("[" * 100_000), "config.json: not a JSON file nmt reads (its values nest"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), "cannot read the weights"),
    (lambda d: (d / "model.safetensors").unlink(), "cannot read the weights"),
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
    (lambda d: (d / "tokenizer.json").write_text("[]"), "not a readable tokenizer file"),
])
def test_model_dir_with_missing_or_corrupt_file(model_dir, tmp_path, capsys, damage, needle):
    import shutil
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    damage(broken)
    assert_error(main(["translate", str(broken)]), capsys.readouterr().err, needle)


def test_tokenizer_that_does_not_match_the_model(model_dir, tmp_path, capsys):
    import shutil

    from nmt.tokenizer import TokenizerConfig as _  # noqa: F401
    from nmt.tokenizer import train_tokenizer
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    other = train_tokenizer(["completely different words here"] * 20, TokenizerConfig(vocab_size=40, min_frequency=1))
    other.save(str(broken / "tokenizer.json"))
    assert_error(main(["translate", str(broken)]), capsys.readouterr().err, "does not match the model")


# --- SKIP: dropped and counted -----------------------------------------------------------------------

@pytest.mark.parametrize("src, tgt, reason", [
    (b"a\x00b c\n", b"d e\n", "nul_byte"),
    ("x" * 100_000 + "\n", "y\n", "too_long"),
    ("word " * 300 + "\n", "wort\n", "too_long"),
    (b"   \t \n", b"text\n", "empty"),
])
def test_counted_skips(tmp_path, src, tgt, reason):
    src, tgt = (s.encode() if isinstance(s, str) else s for s in (src, tgt))
    corpus = prepared(tmp_path, pair_files(tmp_path, good_bytes(0) + src, good_bytes(1) + tgt),
                      valid_ratio=0.1, test_ratio=0.1)
    assert corpus.stats.clean["dropped"] == {reason: 1}


def test_validation_and_test_pairs_the_model_cannot_take_are_dropped_and_counted_before_training(tmp_path, capsys,
                                                                                                  caplog):
    spec = pair_files(tmp_path, good_bytes(0), good_bytes(1))
    too_many_words, too_many_subwords = " ".join(["word"] * 300), " ".join(f"w{i}" for i in range(80))
    valid = write_pairs(tmp_path / "valid", GOOD[:8] + [(too_many_words, "kurz"), (too_many_subwords, "kurz")], "en", "de")
    test = write_pairs(tmp_path / "test", GOOD[8:16] + [(" ", "leer")], "en", "de")
    n_valid = 10
    code, err = nmt_train(tmp_path, spec, capsys, "--data.valid", valid, "--data.test", test, "--max_steps", "2",
                          "--eval_every", "1", "--model.max_positions", "64", "--data.max_subwords", "64")
    assert code == 0, err  # before: the 80-subword line ended the run at its first validation (and every resume)
    assert f"cleaning dropped 2 of {n_valid} valid pairs (too_long 1, too_many_subwords 1) and 1 of " in caplog.text
    stats = json.loads((tmp_path / "run" / "data.json").read_text())
    assert stats["clean_eval"]["valid"]["dropped"] == {"too_long": 1, "too_many_subwords": 1}
    assert stats["clean_eval"]["test"]["dropped"] == {"empty": 1} and stats["pairs"]["valid"] == n_valid - 2
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "valid_nll" in m] == [1, 2]


def test_long_subword_sequences_are_counted(tmp_path):
    long_src = " ".join(f"w{i}" for i in range(200))  # 200 words, many more subwords
    corpus = prepared(tmp_path, pair_files(tmp_path, good_bytes(0) + (long_src + "\n").encode(),
                                           good_bytes(1) + b"kurz\n"), valid_ratio=0.1, test_ratio=0.1,
                      max_subwords=100, max_ratio=1000.0)
    assert corpus.stats.clean["dropped"] == {"too_many_subwords": 1}


# --- WORKS -----------------------------------------------------------------------------------------

def test_crlf_bom_and_tabs_inside_fields(tmp_path):
    src = "\ufeff" + "".join(p[0] + "\r\n" for p in GOOD[:-1]) + "a\ttab inside\r\n"
    tgt = "".join(p[1] + "\r\n" for p in GOOD[:-1]) + "ein\tTab drin\r\n"
    corpus = prepared(tmp_path, pair_files(tmp_path, src.encode(), tgt.encode()), valid_ratio=0.1, test_ratio=0.1)
    texts = {s for name in ("train", "valid", "test") for s in corpus.splits[name]["src"]}
    assert GOOD[0][0] in texts and "a\ttab inside" in texts  # BOM and CR gone, the tab kept as text
    assert not any(s.endswith("\r") or s.startswith("\ufeff") for s in texts)


def test_non_latin_scripts_and_emoji(tmp_path):
    pairs = [(f"我爱你 {i} 🙂", f"Я люблю тебя {i} ❤️ مرحبا") for i in range(40)]
    corpus = prepared(tmp_path, write_pairs(tmp_path / "u", pairs, "en", "de"), valid_ratio=0.1, test_ratio=0.1)
    tok = corpus.tokenizer
    for _, tgt in pairs[:5]:
        assert tok.decode_tgt(tok.encode_tgt([tgt]))[0] == tgt  # round trip, nothing lost to <unk>
    assert tok.unknown_rate([p[0] for p in pairs]) == 0.0


# --- long inputs at translation time ---------------------------------------------------------------

def test_a_sentence_longer_than_the_model_is_truncated_or_split(model_dir, caplog):
    from nmt import Translator
    tr = Translator.from_pretrained(model_dir)
    very_long = " ".join(["sentence number 7 is here ."] * 400)  # ~2,400 words > max_positions subwords
    out = tr.translate([very_long, "sentence number 1 is here ."], beam_size=2, max_new_tokens=20)
    assert len(out) == 2 and "truncated to model.max_positions" in caplog.text
    split = tr.translate([very_long], beam_size=1, max_new_tokens=5, long_inputs="split")
    assert len(split) == 1 and "translating it in" in caplog.text


def test_one_bad_line_does_not_lose_the_others(model_dir, monkeypatch, caplog):
    from nmt import Translator
    tr = Translator.from_pretrained(model_dir)
    real = Translator.translations

    def flaky(self, texts, *args, **kw):
        if any("POISON" in t for t in texts):
            raise RuntimeError("simulated out of memory")
        return real(self, texts, *args, **kw)

    monkeypatch.setattr(Translator, "translations", flaky)
    lines = [f"sentence number {i} is here ." for i in range(5)]
    lines[2] = "POISON line"
    out = list(tr.translate_stream(lines, chunk_size=4, beam_size=1, max_new_tokens=8))
    good = tr.translate([lines[i] for i in (0, 1, 3, 4)], beam_size=1, max_new_tokens=8)
    assert out == [good[0], good[1], "", good[2], good[3]]  # only the bad line is empty, order kept
    assert "input line 3 could not be translated" in caplog.text



# --- exceptions from deeper layers, as a new user meets them: one line naming the input, exit 2 -------------

def test_negative_learning_rate_is_refused_before_any_work(tmp_path, capsys):
    spec = pair_files(tmp_path, good_bytes(0), good_bytes(1))
    code, err = nmt_train(tmp_path, spec, capsys, "--optim.lr", "-0.001")  # was torch.optim's ValueError
    assert_error(code, err, "'optim.lr'", "-0.001", "outside the allowed range [0, 1]")
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("pairs, key", [(1, "data.valid"), (2, "data.test")])
def test_corpus_too_small_to_carve_validation_and_test_from(tmp_path, capsys, pairs, key):
    spec = pair_files(tmp_path, good_bytes(0)[: good_bytes(0).index(b"\n") + 1] * pairs,
                      good_bytes(1)[: good_bytes(1).index(b"\n") + 1] * pairs)
    code, err = nmt_train(tmp_path, spec, capsys, "--data.dedupe", "false")  # was the splitter's ValueError
    assert_error(code, err, f"'{key}'", "too few to carve", f"give {key}")


@pytest.mark.parametrize("flags, needles", [
    (["--model.d_ff", "128"], ["(64, 32) in the checkpoint but (128, 32)", "changed: model.d_ff 64 -> 128"]),
    (["--model.n_decoder_layers", "2"], ["missing weights", "changed: model.n_decoder_layers 1 -> 2"]),
])
def test_resume_with_a_changed_model_size(model_dir, tmp_path, capsys, flags, needles):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(model_dir.parent, run)
    argv = ["train", "--config", str(run / "config.yaml"), "--output_dir", str(run), "--resume", "latest", *flags]
    code = main(argv)  # the checkpoint's config names the change before any weight is loaded
    key, old, new = flags[0][2:], needles[1].split()[-3], flags[1]
    assert_error(code, capsys.readouterr().err, "step_2 was written by another run configuration",
                 f"{key}: {old} -> {new}", "--resume-with-changes")
    code = main([*argv, "--resume-with-changes"])  # was torch's state-dict size mismatch
    assert_error(code, capsys.readouterr().err, "cannot resume from", "step_2", *needles, "config.yaml",
                 "new output_dir")


def test_translate_input_that_is_not_utf8(model_dir, tmp_path, capsys, monkeypatch):
    import io
    import sys

    bad = tmp_path / "in.txt"
    bad.write_bytes(b"sentence number 1 is here .\ncaf\xe9\n")
    assert_error(main(["translate", str(model_dir), "--input", str(bad)]), capsys.readouterr().err,
                 "in.txt:2: not valid UTF-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(bad.read_bytes())))
    assert_error(main(["translate", str(model_dir)]), capsys.readouterr().err, "stdin:2: not valid UTF-8")
    code = main(["evaluate", str(model_dir), "--src", str(bad), "--ref", str(bad)])
    assert_error(code, capsys.readouterr().err, "in.txt:2: not valid UTF-8")


def test_a_bom_on_line_1_is_dropped_by_translate_evaluate_and_score(model_dir, tmp_path, capsys, monkeypatch):
    import os
    import sys

    plain, bom = tmp_path / "plain.txt", tmp_path / "bom.txt"
    plain.write_text("".join(p[0] + "\n" for p in GOOD[:3]), encoding="utf-8")
    bom.write_bytes("\ufeff".encode() + plain.read_bytes())

    def out(*argv) -> str:
        assert main([str(a) for a in argv]) == 0
        return capsys.readouterr().out

    nbest = ["--beam", "2", "--nbest", "2"]  # with scores: a line 1 read with its BOM (an <unk>) scores otherwise
    expected = out("translate", model_dir, "--input", plain, *nbest)
    assert out("translate", model_dir, "--input", bom, *nbest) == expected
    read, write = os.pipe()
    os.write(write, bom.read_bytes())
    os.close(write)
    with open(read, "rb") as pipe:
        monkeypatch.setattr(sys, "stdin", pipe)
        assert out("translate", model_dir, *nbest) == expected  # a pipe, read as its lines arrive
    assert out("score", model_dir, "--src", bom, "--tgt", bom) == out("score", model_dir, "--src", plain, "--tgt", plain)
    out("translate", model_dir, "--input", plain, "--output", tmp_path / "hyps.txt")
    ref = tmp_path / "ref.txt"
    ref.write_bytes("\ufeff".encode() + (tmp_path / "hyps.txt").read_bytes())  # the translations, with a BOM
    assert "chrF 100.00" in out("evaluate", model_dir, "--src", bom, "--ref", ref)  # the BOM, a character, dropped


def test_translate_input_that_is_missing_and_output_that_is_a_folder(model_dir, tmp_path, capsys):
    code = main(["translate", str(model_dir), "--input", str(tmp_path / "nope.txt")])
    assert_error(code, capsys.readouterr().err, "nope.txt: No such file or directory")
    (tmp_path / "in.txt").write_text("sentence number 1 is here .\n")
    code = main(["translate", str(model_dir), "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path)])
    assert_error(code, capsys.readouterr().err, f"--output {tmp_path}: is a folder")


def test_a_bad_search_setting_fails_once_not_on_every_line(model_dir):
    from nmt import Translator
    from nmt.errors import NmtError

    tr = Translator.from_pretrained(model_dir)
    with pytest.raises(NmtError, match=r"'beam_size': 0 is outside the allowed range \[1, 1000\]"):
        list(tr.translate_stream(["sentence number 1 is here ."] * 3, beam_size=0))
    with pytest.raises(NmtError, match="nbest"):
        tr.translations(["sentence number 1 is here ."], beam_size=2, nbest=3)
