"""nmt.checkpoint: complete step_N folders only, `latest`, atomic publishing and retention; a checkpoint's training
state in safetensors and JSON, and a tampered state file is damage."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import losses, train_args
from safetensors.torch import load_file, save_file

from nmt.checkpoint import (
    COMPLETE,
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    WEIGHTS_FILE,
    list_checkpoints,
    mark_complete,
    prune,
    publish,
    read_info,
    remove_temporaries,
    resolve_resume,
    rng_file,
    temp_dir_for,
)
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.errors import NmtError


def test_half_written_checkpoint_is_never_latest(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    for name, complete in (("step_2", True), ("step_4", True), ("step_6", False), (".tmp-step_8", True)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / COMPLETE).write_text(json.dumps({"step": int(name.split("_")[1])}))
    assert resolve_resume("latest", tmp_path).name == "step_4"
    assert "incomplete" in caplog.text
    with pytest.raises(NmtError, match="not a complete nmt checkpoint"):
        resolve_resume(str(root / "step_6"), tmp_path)


def test_retention_keeps_the_newest_and_best(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        (root / f"step_{step}").mkdir(parents=True)
        (root / f"step_{step}" / COMPLETE).write_text("{}")
    (tmp_path / "best").mkdir()
    prune(tmp_path, keep_last=0)  # even 0 keeps the last good one
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_6"] and (tmp_path / "best").is_dir()


def test_publish_replaces_the_old_folder_and_leaves_no_temporary_one(tmp_path):
    final = tmp_path / "checkpoints" / "step_4"
    for content in ("old", "new"):
        tmp = temp_dir_for(final)
        tmp.mkdir(parents=True)
        (tmp / "weights").write_text(content)
        mark_complete(tmp, {"step": 4, "content": content})
        assert not final.exists() or (final / "weights").read_text() == "old"  # in place only once published
        publish(tmp, final)
    assert (final / "weights").read_text() == "new" and read_info(final) == {"step": 4, "content": "new"}
    assert sorted(p.name for p in final.parent.iterdir()) == ["step_4"]  # no .tmp- or .old- left behind
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4"]


def test_resume_latest_without_checkpoints_and_an_unreadable_info_are_named(tmp_path):
    with pytest.raises(NmtError, match="no checkpoint in"):
        resolve_resume("latest", tmp_path)
    broken = tmp_path / "checkpoints" / "step_2"
    broken.mkdir(parents=True)
    (broken / COMPLETE).write_text("{not json")
    assert resolve_resume(str(broken), tmp_path) == broken
    with pytest.raises(NmtError, match="unreadable"):
        read_info(broken)


def test_checkpoints_are_listed_by_step_number_not_by_name(tmp_path):
    for step in (10, 2, 100):
        folder = tmp_path / "checkpoints" / f"step_{step}"
        folder.mkdir(parents=True)
        mark_complete(folder, {"step": step})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_2", "step_10", "step_100"]
    prune(tmp_path, keep_last=2)
    assert [json.loads((p / COMPLETE).read_text())["step"] for p in list_checkpoints(tmp_path)] == [10, 100]


def test_temporary_names_are_each_writers_own_and_a_killed_writers_are_removed(tmp_path):
    final = tmp_path / "checkpoints" / "step_4"
    mine, again = temp_dir_for(final), temp_dir_for(final)
    assert mine != again and mine.parent == final.parent and f"-{os.getpid()}-" in mine.name
    left = [mine, tmp_path / ".tmp-best-123-abcd", tmp_path / "checkpoints" / ".old-step_2-123-abcd"]
    for d in [*left, final, tmp_path / "best"]:
        d.mkdir(parents=True)
    remove_temporaries(tmp_path)  # what a killed run was writing; nothing else
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["best", "checkpoints", "step_4"]


def _tamper_optimizer(step: Path) -> None:
    """A well-formed optimizer.safetensors whose first moment of one parameter has another shape."""
    from safetensors import safe_open

    with safe_open(str(step / OPTIMIZER_FILE), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(step / OPTIMIZER_FILE)
    tensors["state.0.exp_avg"] = torch.zeros(3)
    save_file(tensors, str(step / OPTIMIZER_FILE), metadata=meta)


def _tamper_schedule(step: Path) -> None:
    state = json.loads((step / SCHEDULER_FILE).read_text())
    (step / SCHEDULER_FILE).write_text(json.dumps({**state, "last_epoch": "4"}))


def _tamper_random_states(step: Path) -> None:
    tensors = load_file(step / rng_file(0))
    from safetensors import safe_open

    with safe_open(str(step / rng_file(0)), framework="pt") as f:
        meta = f.metadata()
    save_file({**tensors, "torch": tensors["torch"][:-8]}, str(step / rng_file(0)), metadata=meta)


@pytest.mark.slow
def test_a_tampered_optimizer_schedule_or_random_state_falls_back_and_alone_is_one_line(corpus_dir, tmp_path, capsys,
                                                                                         caplog):
    args = [str(a) for a in train_args(corpus_dir, tmp_path, "run", 4)]
    assert main(["train", *args]) == 0
    first = tmp_path / "run"
    step_4 = first / "checkpoints" / "step_4"
    assert sorted(p.name for p in step_4.iterdir()) == sorted(
        [COMPLETE, WEIGHTS_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, rng_file(0), "tokenizer.json"])  # no pickle
    cases = {"optimizer.safetensors state 0.exp_avg is (3,)": _tamper_optimizer,
             "scheduler.json: its state.last_epoch is str, not int": _tamper_schedule,
             "random_states_0.safetensors cannot be restored: torch is not": _tamper_random_states}
    for i, (named, tamper) in enumerate(cases.items()):
        out = tmp_path / f"case{i}"
        shutil.copytree(first, out)
        tamper(out / "checkpoints" / "step_4")
        reset_accelerate_state()
        caplog.clear()
        run_args = [str(a) for a in train_args(corpus_dir, tmp_path, f"case{i}", 6)]
        assert main(["train", *run_args, "--resume", "latest"]) == 0, capsys.readouterr().err
        assert f"step_4 is damaged: {named}" in caplog.text, caplog.text
        assert f"falling back to {out / 'checkpoints' / 'step_2'}" in caplog.text
        assert max(losses(out)) == 6
    shutil.rmtree(first / "checkpoints" / "step_2")  # nothing to fall back to: one line, exit 2
    _tamper_optimizer(step_4)
    reset_accelerate_state()
    capsys.readouterr()
    assert main(["train", *[str(a) for a in train_args(corpus_dir, tmp_path, "run", 6)], "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "step_4 is damaged: optimizer.safetensors state 0.exp_avg is (3,)" in lines[0], lines[0]


def test_a_sharded_run_whose_checkpoints_would_be_pickles_is_refused_before_any_work():
    """DeepSpeed's checkpoints and FSDP1's are pickles; FSDP2's are gathered into nmt's own files. (On a CPU
    accelerate runs FSDP as DDP, so the launch is stood in for by its distributed type.)"""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from nmt.training.state import check_checkpointable

    with pytest.raises(NmtError, match=r"DeepSpeed: its checkpoints are pickles.*fsdp.yaml"):
        check_checkpointable(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED))
    with pytest.raises(NmtError, match=r"FSDP version 1.*fsdp_version: 2"):
        check_checkpointable(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False))
    check_checkpointable(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True))  # FSDP2 trains
    check_checkpointable(SimpleNamespace(distributed_type=DistributedType.MULTI_GPU))  # DDP trains
