"""nmt.validate: a run's paths and settings judged before any work (each path kind, each path key, the output
folder, a config changed in Python after it was built): one line naming the key, never a traceback. (What a resume
with another model size is told: test_bad_input, beside the trained model it resumes.)"""

import re
from pathlib import Path

import pytest
from helpers import assert_error, good_bytes, nmt_train, pair_files

from nmt.cli import main
from nmt.config import DataConfig

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


# --- every path key with a missing path, a file and a folder of the wrong kind ---------------------------


def path_keys():
    from nmt.config import PATH, TrainConfig, walk

    return [(key, f.metadata[PATH]) for key, f, _ in walk(TrainConfig()) if PATH in f.metadata]


def place(tmp_path, case: str) -> Path:
    """A path that is missing, a plain file, a plain folder, or below a file."""
    path = tmp_path / f"p-{case}"
    if case == "file":
        path.write_text("not what was asked for\n")
    elif case == "folder":
        path.mkdir()
    elif case == "under_a_file":
        (tmp_path / "a-file").write_text("x\n")
        path = tmp_path / "a-file" / "inside"
    return path


# what each kind of path key makes of each case: None = accepted, else words of the message
EXPECTED = {
    "folder": {"missing": None, "file": "is a file, not a folder", "folder": None, "under_a_file": "is a file"},
    "corpus": {"missing": "data file not found", "file": "data file not found", "folder": "not one written by "
               "Dataset.save_to_disk", "under_a_file": "data file not found"},
    "checkpoint": {"missing": "does not exist", "file": "is a file, not a folder", "folder": "not a complete nmt "
                   "checkpoint", "under_a_file": "does not exist"},
    "model": {"missing": "does not exist", "file": "is a file, not a folder", "folder": "not an nmt model directory",
              "under_a_file": "does not exist"},
}


def right_path(tmp_path, kind: str) -> Path:
    """A path each kind accepts."""
    from nmt.checkpoint import COMPLETE

    if kind == "corpus":
        return pair_files(tmp_path, good_bytes(0), good_bytes(1))
    if kind == "folder":
        return tmp_path / "out"
    path = tmp_path / kind
    path.mkdir()
    files = [COMPLETE] if kind == "checkpoint" else ["config.json", "model.safetensors", "tokenizer.json"]
    for name in files:
        (path / name).write_text("{}")
    return path


@pytest.mark.parametrize("case", ["missing", "file", "folder", "under_a_file", "right"])
@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_every_path_kind_judges_each_case(tmp_path, kind, case):
    """Each kind of nmt.config.PATH_KINDS, also those no key uses yet, through its check in nmt.validate."""
    from nmt.config import PATH_KINDS, TrainConfig
    from nmt.errors import NmtError
    from nmt.validate import PATH_CHECKS

    assert set(PATH_KINDS) == set(PATH_CHECKS) == set(EXPECTED)
    cfg = TrainConfig(data=DataConfig(src_lang="en", tgt_lang="de"))
    if case == "right":
        PATH_CHECKS[kind]("some.key", right_path(tmp_path, kind), cfg)
        return
    needle = EXPECTED[kind][case]
    if needle is None:
        PATH_CHECKS[kind]("some.key", place(tmp_path, case), cfg)
        return
    with pytest.raises(NmtError, match=re.escape(needle)) as e:
        PATH_CHECKS[kind]("some.key", place(tmp_path, case), cfg)
    assert str(e.value).startswith("config key 'some.key': ")


@pytest.mark.parametrize("case", ["missing", "file", "folder", "under_a_file"])
@pytest.mark.parametrize("key, kind", path_keys(), ids=[k for k, _ in path_keys()])
def test_every_path_key_names_a_path_of_the_wrong_kind(tmp_path, key, kind, case):
    from nmt.config import TrainConfig, from_dict, set_path
    from nmt.errors import NmtError
    from nmt.validate import check_paths

    assert kind in EXPECTED, f"{key}: a new path kind {kind!r} needs its row in EXPECTED"
    path = place(tmp_path, case)
    data = {"output_dir": str(tmp_path / "run"), "data": {"cache_dir": str(tmp_path / "cache")}}
    set_path(data, key, str(path))
    cfg = from_dict(TrainConfig, data)
    needle = EXPECTED[kind][case]
    if needle is None:
        check_paths(cfg)
        return
    with pytest.raises(NmtError) as e:
        check_paths(cfg)
    message = str(e.value)
    assert f"config key '{key}'" in message and needle in message and "\n" not in message, message


@pytest.mark.parametrize("key, kind", path_keys(), ids=[k for k, _ in path_keys()])
def test_every_path_key_accepts_the_right_thing(tmp_path, key, kind):
    from nmt.config import TrainConfig, from_dict, set_path
    from nmt.validate import check_paths

    data = {"data": {"src_lang": "en", "tgt_lang": "de"}}
    set_path(data, key, str(right_path(tmp_path, kind)))
    check_paths(from_dict(TrainConfig, data))  # raises if refused


def test_a_prefix_whose_language_file_is_a_folder(tmp_path, capsys):
    (tmp_path / "c.en").mkdir()
    (tmp_path / "c.de").write_text("x\n")
    assert_error(*nmt_train(tmp_path, tmp_path / "c", capsys), "'data.train'", "c.en is a folder")


# --- the output folder, a config changed after it was checked, a resume with another model size -----------

def test_a_config_changed_in_python_is_checked_when_training_starts(tmp_path):
    from nmt import train
    from nmt.config import TrainConfig
    from nmt.errors import NmtError

    cfg = TrainConfig(output_dir=str(tmp_path / "run"), max_steps=1)
    cfg.optim.lr = -1.0  # after construction: __post_init__ never saw it
    with pytest.raises(NmtError, match=r"'optim\.lr': -1\.0 is outside"):
        train(cfg)


def test_output_dir_that_is_the_working_directory_with_overwrite(tmp_path, capsys, monkeypatch):
    spec = pair_files(tmp_path, good_bytes(0), good_bytes(1))
    work = tmp_path / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("years of work")
    monkeypatch.chdir(work)
    argv = ["train", "--data.train", str(spec), "--data.src_lang", "en", "--data.tgt_lang", "de", "--max_steps", "1",
            "--data.cache_dir", str(tmp_path / "cache"), "--overwrite"]
    for out, what in ((".", "is the working directory"), ("..", "holds the working directory")):
        code = main([*argv, "--output_dir", out])  # before: "PosixPath('.') has an empty name", exit 1
        assert_error(code, capsys.readouterr().err, f"'output_dir': {out} {what}", "--output_dir runs/NAME")
    assert sorted(p.name for p in work.iterdir()) == ["thesis.tex"]


def test_output_dir_that_is_a_file(tmp_path, capsys):
    spec = pair_files(tmp_path, good_bytes(0), good_bytes(1))
    (tmp_path / "taken").write_text("my notes\n")
    code, err = nmt_train(tmp_path, spec, capsys, "--output_dir", tmp_path / "taken")  # was FileExistsError
    assert_error(code, err, "'output_dir'", "taken is a file, not a folder")
    assert (tmp_path / "taken").read_text() == "my notes\n"
