"""nmt.textfiles: nothing a user has is lost. An output is replaced only when it is whole (its permissions kept, no
temporary file left), an output that is one of the inputs (also through a link, stdin or a model file) is refused
before anything is written; lines are counted as a file holds them. (A big translation killed midway and continued,
`ResumableOutput`: tests/test_translate.py, beside the translator it runs.)"""

import os
import sys
from pathlib import Path

import pytest

from nmt.textfiles import count_lines


def same_file_cases(model: Path, d: Path) -> dict:
    """name -> (argv, the file that must stay as it is, words of the message)."""
    text = d / "in.txt"
    (d / "link.txt").symlink_to(text)
    os.link(text, d / "hard.txt")
    files = ["--src", str(text), "--ref", str(d / "ref.txt")]
    return {
        "translate --output the input": (["translate", model, "--input", text, "--output", text], text, "--input"),
        "translate --output a symlink to it": (["translate", model, "--input", text, "--output", d / "link.txt"],
                                               text, "--input"),
        "translate --output a hard link to it": (["translate", model, "--input", text, "--output", d / "hard.txt"],
                                                 text, "--input"),
        "translate --output the file on stdin": (["translate", model, "--output", text], text, "stdin"),
        "translate --output a model file": (["translate", model, "--input", text, "--output", model / "config.json"],
                                            model / "config.json", "config.json of MODEL_DIR"),
        "translate --attention a model file": (["translate", model, "--input", text, "--attention",
                                                model / "tokenizer.json"], model / "tokenizer.json", "MODEL_DIR"),
        "evaluate --output the reference": (["evaluate", model, *files, "--output", d / "ref.txt"], d / "ref.txt",
                                            "--ref"),
        "score --output the source": (["score", model, "--src", text, "--tgt", d / "ref.txt", "--output", text],
                                      text, "--src"),
    }


SAME_FILE_CASES = ["translate --output the input", "translate --output a symlink to it",
                   "translate --output a hard link to it", "translate --output the file on stdin",
                   "translate --output a model file",
                   "translate --attention a model file", "evaluate --output the reference", "score --output the source"]


@pytest.mark.parametrize("case", SAME_FILE_CASES)
def test_an_output_that_is_one_of_the_inputs_is_refused_and_left_alone(random_model, tmp_path, capsys, monkeypatch,
                                                                       case):
    from nmt.cli import main

    (tmp_path / "in.txt").write_text("the dog sleeps .\na cat\n")
    (tmp_path / "ref.txt").write_text("le chien dort .\nun chat\n")
    argv, kept, needle = same_file_cases(random_model, tmp_path)[case]
    before = Path(kept).read_bytes()
    stdin = open(tmp_path / "in.txt", encoding="utf-8")  # `< in.txt`
    monkeypatch.setattr(sys, "stdin", stdin)
    with stdin:
        assert main([str(a) for a in argv]) == 2  # before: the input opened for writing first, left empty, exit 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "writing it would destroy the input" in err[0] and needle in err[0], err
    assert Path(kept).read_bytes() == before


def test_an_output_is_replaced_only_when_complete(random_model, tmp_path, capsys):
    from nmt.cli import main

    out = tmp_path / "out.txt"
    out.write_text("yesterday's translations\n")
    out.chmod(0o640)
    (tmp_path / "in.txt").write_bytes(b"the dog sleeps .\ncaf\xe9\n")  # line 2 fails when it is read
    argv = ["translate", str(random_model), "--beam", "1", "--input", str(tmp_path / "in.txt"), "--output", str(out)]
    assert main(argv) == 2 and "in.txt:2: not valid UTF-8" in capsys.readouterr().err
    assert out.read_text() == "yesterday's translations\n"
    (tmp_path / "in.txt").write_text("the dog sleeps .\na cat\n")
    assert main(argv) == 0
    assert len(out.read_text().splitlines()) == 2 and out.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]  # no temporary file left


def test_count_lines_without_final_newline(tmp_path):
    (tmp_path / "f").write_bytes(b"a\nb")
    assert count_lines(tmp_path / "f") == 2
