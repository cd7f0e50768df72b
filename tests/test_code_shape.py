"""The shape the house style asks of training code and the modules listed here: modules under ~350 lines,
functions under ~40, calls with at most 5 positional arguments (benchmarks/code_shape.py prints the figures for
all of nmt/)."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from code_shape import function_lengths  # noqa: E402

PACKAGES = [path for package in ("training", "commands") for path in sorted((ROOT / "nmt" / package).glob("*.py"))]
HELD = PACKAGES + [ROOT / "nmt" / f for f in (
    "objective.py", "compat.py", "train.py", "search.py", "decoder.py", "sampling.py", "ensemble.py", "score.py",
    "cache.py", "fastlinear.py", "translate.py", "__init__.py", "launch.py", "info.py", "model_dir.py", "average.py",
    "checkpoint.py", "tokenizer.py", "cli.py", "tables.py", "readers.py", "encoding.py", "data.py",
    "dropout_epochs.py", "strict.py", "config_reference.py", "config.py",
    "check_report.py", "layers.py", "model.py", "check.py")]
LONG_MODULES: list[Path] = []  # over 350 lines; functions held
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_POSITIONAL = 350, 40, 5


@pytest.mark.parametrize("path", HELD + LONG_MODULES, ids=lambda p: p.name)
def test_training_modules_stay_small(path):
    if path not in LONG_MODULES:
        assert len(path.read_text(encoding="utf-8").splitlines()) <= MAX_MODULE_LINES
    long = [(n, name) for n, name in function_lengths(path) if n > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines: {long}"
    calls = [node for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.Call)]
    crowded = [ast.unparse(c)[:60] for c in calls if len(c.args) > MAX_POSITIONAL]
    assert not crowded, f"{path.name}: calls with more than {MAX_POSITIONAL} positional arguments: {crowded}"


def test_function_lengths_are_measured(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    return 1\n\n\nclass C:\n    def g(self):\n        x = 1\n        return x\n")
    assert function_lengths(src) == [(2, "f"), (3, "C.g")]


def test_the_script_lists_modules_and_longest_functions():
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "code_shape.py"), "--top", "3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    assert any(line.endswith("nmt/training/run.py") for line in out)
    assert out[-4] == "longest 3 functions:" and all(int(line.split()[0]) > 0 for line in out[-3:])
