"""Run folders: a used output_dir is never mixed with a fresh run nor destroyed, `--resume auto`, a checkpoint
resumes only its own run, a damaged newest checkpoint falls back to the previous one bit-exactly, a resume that
holds none of a folder's checkpoints leaves it as it is, a resume on other data or a model directory with another
tokenizer is named, and one `nmt train` uses a folder at a time (a lock that a killed run gives back)."""

import hashlib
import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from helpers import nmt_cmd, start, train_args, wait_for_step
from safetensors.torch import load_file

from nmt import train
from nmt.checkpoint import COMPLETE, list_checkpoints, tokenizer_sha256
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.errors import NmtError
from nmt.training.state import lock_file

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



def args_for(corpus: Path, tmp: Path, run: str, steps: int) -> list[str]:
    return [str(a) for a in train_args(corpus, tmp, run, steps)]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` and the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def error_of(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(corpus_dir, tmp_path_factory) -> Path:
    """A run trained to its end through the CLI (2 steps): checkpoints, best/, model/, metrics.jsonl."""
    tmp = tmp_path_factory.mktemp("finished")
    reset_accelerate_state()
    assert main(["train", *args_for(corpus_dir, tmp, "run", 2)]) == 0
    reset_accelerate_state()
    return tmp / "run"


def test_resume_auto_leaves_a_run_whose_checkpoints_were_deleted_as_it_is(finished_run, corpus_dir, tmp_path,
                                                                          capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "checkpoints")  # a finished run, its checkpoints deleted to save space
    before = snapshot(run)
    assert {"config.yaml", "metrics.jsonl", "best/model.safetensors", "model/model.safetensors"} <= set(before)
    args = args_for(corpus_dir, tmp_path, "run", 2)
    assert main(["train", *args, "--resume", "auto"]) == 2
    line = error_of(capsys)
    assert "holds a run but none of its checkpoints" in line and "--overwrite" in line and "--output_dir" in line
    # a checkpoint of another run into this folder: refused alike
    other = finished_run / "checkpoints" / "step_2"
    assert main(["train", *args, "--resume", str(other)]) == 2
    assert "already holds another run" in error_of(capsys)
    assert snapshot(run) == before  # best/ and model/ kept, metrics.jsonl not cut, config.yaml not rewritten
    assert main(["train", *args, "--overwrite"]) == 0  # what the message offers: the old run moved aside, whole
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and snapshot(aside[0]) == before


def test_overwrite_refuses_to_move_aside_a_folder_holding_this_runs_input(finished_run, corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    args = args_for(corpus_dir, tmp_path, "run", 2)
    assert main(["train", *args, "--init_from", str(run / "model"), "--overwrite"]) == 2  # fine-tune into its own folder
    line = error_of(capsys)
    assert f"init_from {run / 'model'} lies inside it" in line and "--output_dir" in line
    assert snapshot(run) == before and not any(p.name.startswith("run.old-") for p in tmp_path.iterdir())


def test_runs_checkpoints_and_model_directories_record_their_data_and_tokenizer(finished_run):
    step = list_checkpoints(finished_run)[-1]
    recorded = json.loads((step / COMPLETE).read_text())["fingerprints"]
    assert set(recorded) == {"train", "valid", "test", "tokenizer"}
    assert len({recorded["train"], recorded["valid"], recorded["test"]}) == 3  # one per split
    assert recorded["tokenizer"] == tokenizer_sha256(step) == tokenizer_sha256(finished_run / "model")
    for summary in (finished_run / "data.json", finished_run / "model" / "training.json"):
        assert json.loads(summary.read_text())["fingerprints"] == recorded, summary


def swap_two_subwords(model_dir: Path) -> None:
    """Another tokenizer of the same size: two subwords trade their ids."""
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = (word for word, i in vocab.items() if i in (10, 11))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))


def test_a_model_directory_with_another_tokenizer_of_the_same_size_is_refused(finished_run, corpus_dir, tmp_path,
                                                                             capsys):
    from nmt.translate import Translator

    model = tmp_path / "model"
    shutil.copytree(finished_run / "model", model)
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    assert main(["translate", str(model), "--input", str(src)]) == 0  # as trained: it translates
    capsys.readouterr()
    swap_two_subwords(model)
    assert main(["translate", str(model), "--input", str(src)]) == 2
    line = error_of(capsys)
    assert "tokenizer.json is not the tokenizer this model was trained with" in line and "training.json" in line
    with pytest.raises(NmtError, match="not the tokenizer this model was trained with"):
        Translator.from_pretrained(model)
    assert main(["train", *args_for(corpus_dir, tmp_path, "tuned", 2), "--init-from", str(model)]) == 2
    assert "not the tokenizer this model was trained with" in error_of(capsys)
    assert not (tmp_path / "tuned").exists()


def edited_copy(corpus_dir: Path, into: Path) -> Path:
    shutil.copytree(corpus_dir, into)
    return into


def drop_first_lines(prefix: Path, n: int) -> None:
    """Edit a corpus in place: its first n pairs removed."""
    for side in ("en", "xx"):
        path = Path(f"{prefix}.{side}")
        path.write_text("".join(path.read_text(encoding="utf-8").splitlines(keepends=True)[n:]), encoding="utf-8")


def test_resume_on_edited_data_is_refused_naming_the_split(corpus_dir, tmp_path, capsys):
    data = edited_copy(corpus_dir, tmp_path / "data")
    args = args_for(data, tmp_path, "run", 2)
    assert main(["train", *args]) == 0
    run = tmp_path / "run"
    drop_first_lines(data / "train", 100)
    before = snapshot(run)
    capsys.readouterr()
    assert main(["train", *args_for(data, tmp_path, "run", 4), "--resume", "latest"]) == 2
    line = error_of(capsys)
    assert "the data changed since" in line and "step_2" in line and "--allow-data-change" in line
    assert f"train ({data / 'train'})" in line and "valid (" not in line and "test (" not in line
    assert snapshot(run) == before  # refused before the run directory was touched


def test_allow_data_change_continues_with_the_runs_own_tokenizer(corpus_dir, tmp_path, capsys, caplog):
    data = edited_copy(corpus_dir, tmp_path / "data")
    assert main(["train", *args_for(data, tmp_path, "run", 2)]) == 0
    run = tmp_path / "run"
    first = (run / "checkpoints" / "step_2" / "tokenizer.json").read_bytes()
    drop_first_lines(data / "train", 300)  # half the corpus: a tokenizer trained again would differ
    code = main(["train", *args_for(data, tmp_path, "run", 4), "--resume", "latest", "--allow-data-change"])
    assert code == 0, capsys.readouterr().err
    assert "on changed data (--allow-data-change): train (" in caplog.text
    for folder in (run / "checkpoints" / "step_4", run / "model"):
        assert (folder / "tokenizer.json").read_bytes() == first, folder  # the ids mean the same subwords
    recorded = json.loads((run / "checkpoints" / "step_4" / COMPLETE).read_text())["fingerprints"]
    assert recorded["train"] != json.loads((run / "checkpoints" / "step_2" / COMPLETE).read_text())["fingerprints"][
        "train"]  # the new data are what the run now records


@pytest.mark.slow
def test_one_run_per_folder_and_a_killed_run_gives_the_folder_back(corpus_dir, tmp_path, capsys):
    args = args_for(corpus_dir, tmp_path, "run", 500)
    first = start(nmt_cmd(*args), tmp_path)
    try:
        wait_for_step(tmp_path / "run", 3, first)  # checkpoints at steps 2 (and later)
        for extra in ([], ["--resume", "auto"], ["--overwrite"]):
            assert main(["train", *args, *extra]) == 2
            line = error_of(capsys)
            assert f"another nmt train is using output_dir {tmp_path / 'run'} (pid {first.pid})" in line, extra
    finally:
        first.send_signal(signal.SIGKILL)  # no chance to clean up
        first.wait()
    assert not any(p.name.startswith("run.old-") for p in tmp_path.iterdir())  # --overwrite moved nothing
    step = int(list_checkpoints(tmp_path / "run")[-1].name.split("_")[1])
    assert main(["train", *args_for(corpus_dir, tmp_path, "run", step + 1), "--resume", "auto"]) == 0
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]  # none left over


def claim_and_report(cfg, reports: str) -> None:  # top level: launched processes import it by name
    from accelerate import Accelerator

    from nmt.training.state import claim_output_dir

    accelerator = Accelerator(cpu=True)
    try:
        claim_output_dir(accelerator, cfg)
        outcome = "claimed"
    except NmtError as e:
        outcome = str(e)
    Path(reports, f"rank{accelerator.process_index}").write_text(outcome)


@pytest.mark.multiprocess
def test_every_process_stops_when_the_folder_is_in_use(tiny_cfg, tmp_path):
    """Only the main process tries the lock; the others must hear that it failed before any collective."""
    from filelock import FileLock

    from nmt.launch import launch

    reports = tmp_path / "reports"
    reports.mkdir()
    with FileLock(str(lock_file(Path(tiny_cfg.output_dir)))):  # another nmt train, in the launched ranks' eyes
        launch(claim_and_report, (tiny_cfg, str(reports)), num_processes=2)
    outcomes = {p.name: p.read_text() for p in reports.iterdir()}
    assert sorted(outcomes) == ["rank0", "rank1"]
    for rank, outcome in outcomes.items():
        assert outcome.startswith(f"another nmt train is using output_dir {tiny_cfg.output_dir} (pid unknown)"), rank
    assert not Path(tiny_cfg.output_dir).exists()


def test_resume_continues_at_the_saved_step(tiny_cfg):
    tiny_cfg.max_steps = 6
    train(tiny_cfg)
    reset_accelerate_state()
    tiny_cfg.max_steps, tiny_cfg.resume = 12, "latest"
    result = train(tiny_cfg)
    rows = [json.loads(line) for line in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [3, 6, 9, 12]  # no step trained twice
    assert result.steps == 12


def test_resume_without_checkpoint_is_a_clear_error(tiny_cfg):
    tiny_cfg.resume = "latest"
    with pytest.raises(NmtError, match="no checkpoint"):
        train(tiny_cfg)


@pytest.mark.parametrize("bpe_dropout, multilingual", [(None, False), (0.1, False), (0.1, True)],
                         ids=["plain", "bpe-dropout", "two-pairs-temperature-5"])
def test_resumed_run_equals_uninterrupted_run(corpus_dir, tmp_path, bpe_dropout, multilingual):
    from functools import partial

    from nmt.config import TokenizerConfig
    from tests.conftest import multilingual_config, tiny_config

    tok = TokenizerConfig(vocab_size=300, dropout=bpe_dropout)  # BPE-dropout: the same noisy segmentation too
    # max_tokens 2000: 8 (9 with BPE-dropout) steps an epoch, so the resumed half crosses into epoch 1; two pairs
    # (en->xx and xx->en weighted 1 and 0.5, tagged, mixed at temperature 5: each corpus a sample drawn anew each
    # epoch) have about 1.5 times the pairs and twice the tokens a step
    make = partial(multilingual_config, temperature=5.0, reverse_weight=0.5) if multilingual else tiny_config
    common = dict(max_steps=12, save_every=6, eval_every=100, tokenizer=tok, max_tokens=4000 if multilingual else 2000)
    whole = make(corpus_dir, tmp_path / "a", **common)
    train(whole)
    reset_accelerate_state()
    split = make(corpus_dir, tmp_path / "b", **common | {"max_steps": 6})
    train(split)
    reset_accelerate_state()
    split.max_steps, split.resume = 12, "latest"
    train(split)
    a = load_file(Path(whole.output_dir) / "checkpoints" / "step_12" / "model.safetensors")
    b = load_file(Path(split.output_dir) / "checkpoints" / "step_12" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bitwise: same data order, same RNG, same updates
