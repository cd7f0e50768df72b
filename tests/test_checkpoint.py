"""nmt.checkpoint: complete step_N folders only, `latest`, atomic publishing and retention."""

import json
import os

import pytest

from nmt.checkpoint import (
    COMPLETE,
    list_checkpoints,
    mark_complete,
    prune,
    publish,
    read_info,
    remove_temporaries,
    resolve_resume,
    temp_dir_for,
)
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
