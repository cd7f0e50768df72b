"""Run directories: a used output_dir is never mixed with a fresh run, `--resume auto`, a checkpoint resumes only
its own run, and a damaged newest checkpoint falls back to the previous one, bit-exactly."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nmt import train
from nmt.checkpoint import COMPLETE, list_checkpoints
from nmt.cli import main
from nmt.errors import NmtError

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def steps_logged(out: str) -> list[int]:
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


def test_a_fresh_run_into_a_used_output_dir_is_refused(tiny_cfg, capsys):
    out = Path(tiny_cfg.output_dir)
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
    with pytest.raises(NmtError, match=r"already holds a run.*--resume latest.*--resume auto.*--overwrite"):
        train(tiny_cfg)
    assert (out / "metrics.jsonl").read_text() == '{"step": 5, "loss": 1.0}\n'  # untouched
    assert main(["train", "--output_dir", str(out)]) == 2  # the CLI: one line, no traceback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err


def test_resume_auto_refuses_a_folder_that_holds_no_run(tiny_cfg):
    out = Path(tiny_cfg.output_dir)
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    tiny_cfg.resume = "auto"
    with pytest.raises(NmtError, match="holds files but no nmt run"):
        train(tiny_cfg)
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_moves_the_old_run_aside(tiny_cfg):
    out = Path(tiny_cfg.output_dir)
    (out / "checkpoints" / "step_50").mkdir(parents=True)
    (out / "checkpoints" / "step_50" / COMPLETE).write_text("{}")  # the old run's higher step: pruned first if mixed
    tiny_cfg.max_steps, tiny_cfg.save_every, tiny_cfg.overwrite = 2, 1, True
    result = train(tiny_cfg)
    aside = [p for p in out.parent.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and (aside[0] / "checkpoints" / "step_50" / COMPLETE).is_file()
    assert [p.name for p in list_checkpoints(out)] == ["step_1", "step_2"] and result.steps == 2
    with pytest.raises(NmtError, match="cannot go with resume"):
        type(tiny_cfg)(overwrite=True, resume="auto")


def test_resume_auto_starts_fresh_then_continues_and_refuses_another_run(tiny_cfg, fresh_accelerate_state):
    tiny_cfg.resume, tiny_cfg.max_steps, tiny_cfg.save_every, tiny_cfg.log_every = "auto", 2, 2, 1
    assert train(tiny_cfg).steps == 2  # no checkpoint yet: a fresh start
    fresh_accelerate_state()
    tiny_cfg.max_steps, tiny_cfg.eval_every = 3, 1  # budget and logging may change freely
    assert train(tiny_cfg).steps == 3
    assert steps_logged(tiny_cfg.output_dir) == [1, 2, 3]  # continued at 2: no step trained twice
    fresh_accelerate_state()
    tiny_cfg.max_tokens, tiny_cfg.model.dropout = 500, 0.3
    with pytest.raises(NmtError, match=r"another run configuration \(model.dropout: 0.0 -> 0.3; max_tokens: 400 -> 500\)"
                                       r".*--resume-with-changes"):
        train(tiny_cfg)


def test_resume_with_changes_continues_a_changed_run(tiny_cfg, fresh_accelerate_state, caplog):
    tiny_cfg.max_steps, tiny_cfg.save_every = 2, 2
    train(tiny_cfg)
    fresh_accelerate_state()
    tiny_cfg.resume, tiny_cfg.max_steps, tiny_cfg.max_tokens, tiny_cfg.resume_with_changes = "latest", 3, 500, True
    assert train(tiny_cfg).steps == 3
    assert "max_tokens: 400 -> 500" in caplog.text


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_bit_exactly(tiny_cfg, fresh_accelerate_state,
                                                                               caplog):
    tiny_cfg.max_steps, tiny_cfg.save_every, tiny_cfg.eval_every, tiny_cfg.model.dropout = 4, 2, 100, 0.1
    train(tiny_cfg)
    first = Path(tiny_cfg.output_dir)
    newest = list_checkpoints(first)[-1]
    assert newest.name == "step_4"
    files = sorted(p.name for p in newest.iterdir())
    assert {"model.safetensors", "optimizer.safetensors", "scheduler.json", "random_states_0.safetensors",
            COMPLETE} <= set(files)

    def resumed(name: str, damaged: str | None) -> dict:
        out = first.parent / name
        shutil.copytree(first, out)
        if damaged:
            truncate(out / "checkpoints" / "step_4" / damaged)
        else:
            shutil.rmtree(out / "checkpoints" / "step_4")  # a run that resumes at step_2 directly
        fresh_accelerate_state()
        cfg = type(tiny_cfg)(**{**tiny_cfg.__dict__, "output_dir": str(out), "resume": "latest", "max_steps": 6})
        train(cfg)
        return load_file(out / "checkpoints" / "step_6" / "model.safetensors")

    direct = resumed("direct", None)
    for name in files:
        caplog.clear()
        weights = resumed(f"cut-{name}", name)
        assert f"step_4 is damaged: {name}" in caplog.text and "falling back to" in caplog.text, name
        assert all(torch.equal(weights[k], direct[k]) for k in direct), name
    truncate(first / "checkpoints" / "step_4" / "optimizer.safetensors")
    fresh_accelerate_state()
    tiny_cfg.resume, tiny_cfg.max_steps = str(first / "checkpoints" / "step_4"), 6  # asked for by name: stop, naming
    with pytest.raises(NmtError, match=r"step_4 is damaged: optimizer.safetensors is cut short.*--resume .*step_2"):
        train(tiny_cfg)
