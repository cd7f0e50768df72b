"""The `nmt` command as a user meets it: one clear line and exit code 2 for every user error."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import Ran, nmt_command

from nmt.cli import overrides_from_flags

ROOT = Path(__file__).parent.parent


def run_nmt(*args, cwd=None, stdin: str | None = None) -> Ran:
    return nmt_command(*args, cwd=cwd, stdin=stdin or "")


def assert_user_error(proc: Ran, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_overrides_from_flags():
    assert overrides_from_flags(["--model.d_model", "64", "--max-steps=5", "seed=3"]) == [
        "model.d_model=64", "max_steps=5", "seed=3"]


def tiny_args(corpus_dir, tmp_path):
    return ["--data.train", corpus_dir / "train", "--data.valid", corpus_dir / "valid", "--data.test", corpus_dir / "test",
            "--data.cache_dir", tmp_path / "cache", "--output_dir", tmp_path / "run", "--model.preset", "tiny",
            "--tokenizer.vocab_size", "300", "--max_tokens", "400"]


def test_missing_file(corpus_dir, tmp_path):
    proc = run_nmt("train", *tiny_args(corpus_dir, tmp_path), "--data.train", tmp_path / "nope")
    assert_user_error(proc, "data file not found", "nope.en")
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_unknown_config_key(tmp_path, corpus_dir):
    proc = run_nmt("train", *tiny_args(corpus_dir, tmp_path), "--model.d_modle", "64")
    assert_user_error(proc, "unknown config key 'model.d_modle'")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: fast\n")
    assert_user_error(run_nmt("train", "--config", bad), "optim.lr", "expected float")


def test_resume_path_without_checkpoint(tmp_path, corpus_dir):
    proc = run_nmt("train", *tiny_args(corpus_dir, tmp_path), "--resume", tmp_path)
    assert_user_error(proc, "not a complete nmt checkpoint")


def test_translate_and_evaluate_on_a_missing_model(tmp_path):
    assert_user_error(run_nmt("translate", tmp_path, stdin="hello\n"), "config.json: missing")
    (tmp_path / "src").write_text("a\n")
    assert_user_error(run_nmt("evaluate", tmp_path, "--src", tmp_path / "src", "--ref", tmp_path / "nope"),
                      "file not found")


@pytest.fixture(scope="module")
def trained_model(corpus_dir, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cli")
    proc = run_nmt("train", *tiny_args(corpus_dir, tmp), "--max_steps", "6", "--eval_every", "6",
                   "--eval_max_sentences", "8")
    assert proc.returncode == 0, proc.stderr
    assert "nmt: trained 6 steps" in proc.stdout and "  model: " in proc.stdout
    return tmp / "run" / "model"


def test_translate_stdin_and_files(trained_model, tmp_path):
    proc = run_nmt("translate", trained_model, "--beam", "2", stdin="I am young.\nThe dog sleeps.\n")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.splitlines()) == 2
    (tmp_path / "in.txt").write_text("I am young.\n\nThe dog sleeps.\n")
    proc = run_nmt("translate", trained_model, "--input", tmp_path / "in.txt", "--output", tmp_path / "out.txt",
                   "--nbest", "2", "--beam", "2")
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "out.txt").read_text().splitlines()
    assert len(lines) == 3 and all(len(line.split("\t")) == 4 for line in lines)  # 2 x (text, score)


def test_evaluate_prints_bleu_and_chrf_with_signatures(trained_model, corpus_dir):
    proc = run_nmt("evaluate", trained_model, "--src", corpus_dir / "test.en", "--ref", corpus_dir / "test.xx",
                   "--beam", "1")
    assert proc.returncode == 0, proc.stderr
    bleu, chrf = proc.stdout.splitlines()
    assert bleu.startswith("BLEU ") and "nrefs:1" in bleu and "tok:13a" in bleu
    assert chrf.startswith("chrF ") and "nc:6" in chrf


# --- every flag range-checked where it is parsed; the boundary: one line, exit 2, traceback only under --debug ---

def numeric_flags():
    """(command, flag, action) for every option of every subcommand that takes a value of a given type."""
    from nmt.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict))
    return [(name, action.option_strings[-1], action) for name, p in sub.choices.items() for action in p._actions
            if action.type is not None and action.option_strings]


def test_every_typed_flag_is_range_checked():
    from nmt.validate import Number

    flags = numeric_flags()
    assert {("translate", "--beam"), ("translate", "--nbest"), ("check", "--probe-steps")} <= {f[:2] for f in flags}
    bare = [f"{cmd} {flag}" for cmd, flag, action in flags if not isinstance(action.type, Number)]
    assert not bare, f"give these flags a range: type=Number(int, '[lo, hi]') from nmt.validate: {bare}"


@pytest.mark.parametrize("cmd, flag, action", numeric_flags(), ids=[f"{c} {f}" for c, f, _ in numeric_flags()])
def test_each_flag_refuses_values_outside_its_range(cmd, flag, action):
    import argparse

    for text in ("0", "-1", "1e15" if action.type.kind is float else "10000000000000", "many"):
        value = None if text == "many" else action.type.kind(float(text))
        if value is not None and value in action.type.allowed:
            assert text in ("0", "-1"), f"{cmd} {flag} allows the absurd {text}"
            assert action.type(text) == value
        else:
            with pytest.raises(argparse.ArgumentTypeError, match="outside the allowed range|expected"):
                action.type(text)


def test_translate_beam_0_is_refused_with_exit_2(tmp_path):
    proc = run_nmt("translate", tmp_path, "--beam", "0", stdin="hello\n")  # before: empty output, exit 0
    assert proc.returncode == 2 and proc.stdout == ""
    assert "argument --beam: 0 is outside the allowed range [1, 1000]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(monkeypatch, capsys, tmp_path):
    import nmt.tools.info
    from nmt.cli import main

    def broken(model_dir):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(nmt.tools.info, "describe", broken)
    assert main(["info", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["nmt info: error: RuntimeError: boom (unexpected: run again with --debug for the "
                                "traceback)"]
    for argv in (["--debug", "info", str(tmp_path)], ["info", str(tmp_path), "--debug"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback" in err and 'raise RuntimeError("boom' in err and err.endswith("traceback)\n")


def test_user_errors_keep_exit_2_under_debug(tmp_path, corpus_dir):
    proc = run_nmt("train", *tiny_args(corpus_dir, tmp_path), "--optim.lr", "-1", "--debug")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "nmt.errors.NmtError" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("nmt train: error: config key 'optim.lr'")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "check"])
def test_help_lists_every_config_key_as_the_readme_table_does(command, capsys):
    """`nmt train --help`: each key with its type, default, allowed values and meaning, grouped by section, from
    nmt.config.config_fields (the source of docs/configuration.md's table, tests/test_config.py)."""
    from nmt.cli import main
    from nmt.config import config_fields, json_default

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    for key, tp, default, doc, allowed in config_fields():
        line = f"  --{key} {tp} = {'null' if default is None else json_default(default)}"
        assert line + (f"  (allowed: {allowed})" if allowed else "") + f"\n        {doc}\n" in out, key
    sections = [line for line in out.split("config keys:", 1)[1].splitlines() if line.endswith(":") and line[0] != " "]
    assert sections == ["data:", "tokenizer:", "model:", "optim:", "finetune:", "training:"]


def test_translate_from_a_pipe_answers_each_line_before_the_next_is_written(trained_model):
    import select

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "nmt.cli", "translate", str(trained_model), "--beam", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        proc.stdin.write("I am young.\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # line 2 is not written until line 1 is answered
        assert ready, "no translation of line 1 while the pipe stays open"
        first = proc.stdout.readline()
        proc.stdin.write("The dog sleeps.\n")
        proc.stdin.close()
        rest = proc.stdout.read()
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    finally:
        proc.kill()
    assert first.endswith("\n") and len(rest.splitlines()) == 1


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(random_model, tmp_path):
    """`nmt score M ... | head -1`: a closed output is a normal end for a Unix filter (issue 47, row 17): nothing on
    stderr, the status of a command ended by SIGPIPE (141), not "error: BrokenPipeError"."""
    text = tmp_path / "lines.txt"
    text.write_text("the dog sleeps .\n" * 20_000, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = (f"set -o pipefail; {sys.executable} -m nmt.cli score {random_model} --src {text} --tgt {text} "
               f"| head -1")
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=300)
    assert len(proc.stdout.splitlines()) == 1 and proc.stderr == "" and proc.returncode == 141, proc.stderr


def poisoned(monkeypatch, calls: list):
    """Translator.translations failing on any batch that holds a line with POISON; `calls` gets each batch's size."""
    from nmt.translate import Translator

    real = Translator.translations

    def translations(self, texts, *args, **kw):
        calls.append(len(texts))
        if any("POISON" in t for t in texts):
            raise RuntimeError("simulated failure")
        return real(self, texts, *args, **kw)

    monkeypatch.setattr(Translator, "translations", translations)


@pytest.mark.parametrize("how", ["--input", "file on stdin", "pipe on stdin"])
def test_a_line_that_fails_is_reported_and_the_command_exits_nonzero(trained_model, tmp_path, monkeypatch, capsys,
                                                                     caplog, how):
    from nmt.cli import main

    text = "I am young.\nThe dog sleeps.\nPOISON here\nI am young.\n"
    (tmp_path / "in.en").write_text(text, encoding="utf-8")
    calls: list[int] = []
    poisoned(monkeypatch, calls)
    args = ["translate", str(trained_model), "--beam", "1", "--output", str(tmp_path / "out")]
    if how == "--input":
        args += ["--input", str(tmp_path / "in.en")]
        stdin = open(os.devnull, encoding="utf-8")
    elif how == "file on stdin":
        stdin = open(tmp_path / "in.en", encoding="utf-8")
    else:
        read, write = os.pipe()
        os.write(write, text.encode())
        os.close(write)
        stdin = os.fdopen(read, encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    with stdin:
        assert main(args) == 1
    out = (tmp_path / "out").read_text(encoding="utf-8").split("\n")
    assert len(out) == 5 and out[2] == "" and out[0] == out[3] != "" and out[4] == ""  # line-aligned, line 3 empty
    assert "input line 3 could not be translated (simulated failure)" in caplog.text
    assert "error: 1 of 4 input lines could not be translated (line 3)" in capsys.readouterr().err
    assert calls[0] == 4  # a file, or a pipe whose lines are all there, is still translated as one batch


def test_lines_of_a_pipe_come_in_groups_as_they_arrive():
    import threading
    import time

    from nmt.translate import arrived_lines

    read, write = os.pipe()
    os.write(write, "".join(f"line {i}\n" for i in range(25)).encode() + b"no line end")  # all there at once
    os.close(write)
    with os.fdopen(read, encoding="utf-8") as stream:
        groups = list(arrived_lines(stream, limit=10))
    assert [len(g) for g in groups] == [10, 10, 6] and groups[-1][-1] == "no line end"  # capped: flat memory

    read, write = os.pipe()

    def slowly():
        for text in (b"a\n", b"b\nc", b"\n"):
            time.sleep(0.1)
            os.write(write, text)
        os.close(write)

    threading.Thread(target=slowly).start()
    with os.fdopen(read, encoding="utf-8") as stream:
        assert list(arrived_lines(stream)) == [["a"], ["b"], ["c"]]  # each as soon as its line is complete


def test_a_pipe_that_is_not_utf8_is_named_by_its_line():
    from nmt.errors import NmtError
    from nmt.translate import arrived_lines

    read, write = os.pipe()
    os.write(write, b"fine\ncaf\xe9\n")
    os.close(write)
    with os.fdopen(read, "rb") as stream, pytest.raises(NmtError, match="stdin:2: not valid UTF-8"):
        list(arrived_lines(stream))
