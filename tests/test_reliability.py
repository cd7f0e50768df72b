"""Preemption, kills and numerical faults lose nothing; checkpoints never run code when loaded."""

import json
import os
import pickle
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nmt import Seq2SeqTransformer, train
from nmt.checkpoint import COMPLETE, list_checkpoints
from nmt.cli import main
from nmt.compat import reset_accelerate_state
from nmt.errors import NmtError
from nmt.loading import open_model
from tests.conftest import ShortOfMemory
from tests.helpers import losses, nmt_cmd, signal_tree, start, train_args, wait_for_step

ROOT = Path(__file__).parent.parent


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def launch_cmd(*args) -> list:
    return ["-m", "accelerate.commands.launch", "--config_file", ROOT / "accelerate_configs" / "cpu_2proc.yaml",
            ROOT / "run.py", *args]


def assert_same_params(a: Path, b: Path) -> None:
    pa, pb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_sigkill_at_a_random_step_then_resume_equals_uninterrupted(corpus_dir, tmp_path, processes):
    steps = 10
    cmd = nmt_cmd if processes == 1 else launch_cmd
    whole = start(cmd(*train_args(corpus_dir, tmp_path, "whole", steps)), tmp_path)
    killed = start(cmd(*train_args(corpus_dir, tmp_path, "killed", steps)), tmp_path)
    kill_at = random.Random().randint(3, 8)
    wait_for_step(tmp_path / "killed", kill_at, killed)
    signal_tree(killed.pid, signal.SIGKILL)  # every rank and the launcher, no chance to clean up
    killed.wait()
    assert whole.wait(timeout=300) == 0, whole.stderr.read()[-2000:]
    survivor = list_checkpoints(tmp_path / "killed")[-1]
    resumed = start(cmd(*train_args(corpus_dir, tmp_path, "killed", steps), "--resume", "latest"), tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    a, b = losses(tmp_path / "whole"), losses(tmp_path / "killed")
    assert max(b) == max(a) == steps  # same global step count
    resume_step = int(survivor.name.split("_")[1])
    for s in range(resume_step + 1, steps + 1):
        assert b[s] == a[s], f"step {s}: the same batches in the same order give the same loss"
    # bitwise equal with dropout on: data order, RNG streams and optimizer state all restored exactly
    assert_same_params(tmp_path / "whole" / "checkpoints" / f"step_{steps}",
                       tmp_path / "killed" / "checkpoints" / f"step_{steps}")


@pytest.mark.slow
def test_sigterm_finishes_the_step_checkpoints_and_exits_zero(corpus_dir, tmp_path):
    proc = start(nmt_cmd(*train_args(corpus_dir, tmp_path, "run", 500)), tmp_path)
    wait_for_step(tmp_path / "run", 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err
    last = list_checkpoints(tmp_path / "run")[-1]
    step = json.loads((last / COMPLETE).read_text())["step"]
    assert step == max(losses(tmp_path / "run"))  # the step in flight was finished and saved
    assert "--resume latest" in out.splitlines()[-1] and f"after step {step}" in out


@pytest.mark.slow
def test_second_signal_exits_at_once(corpus_dir, tmp_path):
    # a bigger model, so the step in flight and its checkpoint take long enough to be interrupted
    args = train_args(corpus_dir, tmp_path, "run", 500) + ["--model.preset", "small", "--max_tokens", "6000"]
    proc = start(nmt_cmd(*args), tmp_path)
    wait_for_step(tmp_path / "run", 1, proc)
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:  # wait until the first signal is being handled
        if "SIGINT received" in line:
            break
    time.sleep(1.5)  # past the echo window: this is a person pressing Ctrl-C again
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    for d in list_checkpoints(tmp_path / "run"):
        assert (d / COMPLETE).is_file()  # whatever was cut off is not taken as a checkpoint


def test_a_repeat_within_a_second_is_the_same_signal(monkeypatch):
    """Under SLURM + torchrun a worker gets SIGTERM twice in a few milliseconds: still one graceful stop."""
    from nmt.training.loop import StopSignals

    exits = []
    monkeypatch.setattr(sys.modules["nmt.training.loop"].os, "_exit", exits.append)
    stop = StopSignals()
    stop._handle(signal.SIGTERM, None)
    stop._handle(signal.SIGTERM, None)
    assert stop.received == "SIGTERM" and exits == []
    stop.at -= 2 * stop.echo_s
    stop._handle(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGTERM]


class SometimesNaN(torch.nn.Module):
    """Wraps a model; its forward returns NaN logits on the chosen calls (counted from 1)."""

    def __init__(self, inner, bad_calls):
        super().__init__()
        self.inner, self.bad, self.calls = inner, set(bad_calls), 0
        self.pad_id, self.bos_id, self.eos_id = 0, 2, 3

    def forward(self, src_ids, tgt_in_ids):
        logits = self.inner(src_ids, tgt_in_ids)
        if self.training:
            self.calls += 1
            if self.calls in self.bad or "all" in self.bad:
                return logits * float("nan")
        return logits


def test_nonfinite_steps_are_skipped_and_counted(tiny_cfg):
    from nmt import ModelConfig
    tiny_cfg.max_steps, tiny_cfg.log_every = 8, 8
    model = SometimesNaN(Seq2SeqTransformer(ModelConfig.preset("tiny", src_vocab_size=300, tgt_vocab_size=300)),
                         bad_calls={3, 5})
    train(tiny_cfg, model=model)
    rows = [json.loads(x) for x in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "loss" in r)
    assert row["skipped_steps"] == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_many_nonfinite_steps_in_a_row_stop_with_a_checkpoint(tiny_cfg):
    from nmt import ModelConfig
    tiny_cfg.max_bad_steps = 3
    model = SometimesNaN(Seq2SeqTransformer(ModelConfig.preset("tiny", src_vocab_size=300, tgt_vocab_size=300)),
                         bad_calls={"all"})
    with pytest.raises(NmtError, match="3 steps in a row had a non-finite loss"):
        train(tiny_cfg, model=model)
    assert [p.name for p in list_checkpoints(tiny_cfg.output_dir)] == ["step_3"]


def test_a_micro_batch_out_of_memory_makes_no_update_and_training_goes_on(tiny_cfg, caplog):
    """One process: a forward and a backward that ran out of memory (the latter after the decoder's gradients were
    done) each skip their step's update, said with the micro-batch's size, counted, and the run goes on."""
    tiny_cfg.max_steps, tiny_cfg.log_every, tiny_cfg.save_every = 8, 8, 8
    with ShortOfMemory(forward={3}, late={5}):
        train(tiny_cfg)
    rows = [json.loads(x) for x in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert next(r for r in rows if "loss" in r)["oom_steps"] == 2
    adam = load_file(Path(tiny_cfg.output_dir) / "checkpoints" / "step_8" / "optimizer.safetensors")
    assert adam["state.0.step"].item() == 6  # AdamW's own count: two of the 8 steps made no update
    said = [r.getMessage() for r in caplog.records if "out of memory" in r.getMessage()]
    assert len([m for m in said if m.startswith("process 0: out of memory in a micro-batch of ")]) == 2
    assert "sentences," in said[0] and "tokens (padded " in said[0]


def test_many_out_of_memory_steps_in_a_row_stop_naming_max_tokens(tiny_cfg):
    tiny_cfg.max_bad_steps = 3
    with ShortOfMemory(forward="all"), pytest.raises(NmtError, match="3 steps in a row ran out of memory.*lower "
                                                                        "max_tokens \\(now 400 "):
        train(tiny_cfg)
    assert [p.name for p in list_checkpoints(tiny_cfg.output_dir)] == ["step_3"]


class Boom:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/tmp/nmt-pickle-ran")


def test_malicious_pickle_in_a_model_dir_is_never_run(tmp_path):
    MARKER.unlink(missing_ok=True)
    from nmt import ModelConfig
    model = Seq2SeqTransformer(ModelConfig.preset("tiny", src_vocab_size=50, tgt_vocab_size=50))
    model.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))  # planted beside: never read
    open_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(pickle.dumps(Boom()))  # planted in place of the weights
    with pytest.raises(NmtError, match="cannot read the weights"):
        open_model(tmp_path)
    assert not MARKER.exists()


def test_a_pickle_in_a_checkpoint_is_never_unpickled_and_an_old_layout_is_refused_saying_how_to_convert(
        corpus_dir, tmp_path, capsys, caplog):
    MARKER.unlink(missing_ok=True)
    assert main(["train", *map(str, train_args(corpus_dir, tmp_path, "run", 4))]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    for name in ("optimizer.bin", "random_states_0.pkl"):  # planted beside nmt's own files: damage, never opened
        (checkpoints / "step_4" / name).write_bytes(pickle.dumps(Boom()))
    reset_accelerate_state()
    again = [*map(str, train_args(corpus_dir, tmp_path, "run", 6)), "--resume", "latest"]
    assert main(["train", *again]) == 0, capsys.readouterr().err
    assert "step_4 is damaged: optimizer.bin is a pickle, which nmt never reads" in caplog.text
    assert f"falling back to {checkpoints / 'step_2'}" in caplog.text
    for step in list_checkpoints(tmp_path / "run"):  # Accelerate's old layout in every checkpoint
        (step / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    reset_accelerate_state()
    capsys.readouterr()
    assert main(["train", *map(str, train_args(corpus_dir, tmp_path, "run", 8)), "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "pytorch_model.bin is a pickle, which nmt never reads" in lines[0]
    assert f"--init_from {tmp_path / 'run' / 'best'}" in lines[0]  # how to go on from it
    assert not MARKER.exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_on_two_processes_saves_one_checkpoint_and_resumes_bit_exactly(corpus_dir, tmp_path):
    steps = 20
    whole = start(launch_cmd(*train_args(corpus_dir, tmp_path, "whole", steps)), tmp_path)
    run = start(launch_cmd(*train_args(corpus_dir, tmp_path, "run", 500)), tmp_path)
    import psutil  # accelerate's own dependency

    wait_for_step(tmp_path / "run", 3, run)
    workers = [p for p in psutil.Process(run.pid).children(recursive=True) if "run.py" in " ".join(p.cmdline())]
    assert len(workers) == 2
    for worker in workers:  # as torchrun forwards it (torchrun itself exits 1 when the signal reaches it too)
        worker.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=240)
    assert run.returncode == 0, err[-3000:]  # torchrun exits 0 only when both workers did
    assert "Traceback" not in err and err.count("SIGTERM received") == 2  # each rank, once
    last = list_checkpoints(tmp_path / "run")[-1]
    info = json.loads((last / COMPLETE).read_text())
    assert info["num_processes"] == 2 and info["step"] == max(losses(tmp_path / "run")) < steps
    names = {p.name for p in last.iterdir()}
    assert {"random_states_0.safetensors", "random_states_1.safetensors"} <= names  # each rank's, no pickle
    assert not any(n.endswith((".bin", ".pkl")) for n in names)
    assert whole.wait(timeout=300) == 0, whole.stderr.read()[-2000:]
    resumed = start(launch_cmd(*train_args(corpus_dir, tmp_path, "run", steps), "--resume", "auto"), tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert_same_params(tmp_path / "whole" / "checkpoints" / f"step_{steps}",
                       tmp_path / "run" / "checkpoints" / f"step_{steps}")


def test_a_signal_during_validation_stops_between_its_batches(tiny_cfg, monkeypatch):
    import nmt.training.evaluation as evaluation

    real, seen = evaluation.eval_batches, []

    def signalled_at_the_second_batch(*args, **kwargs):
        for i, batch in enumerate(real(*args, **kwargs)):
            if i == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # torchrun gives 30 s before SIGKILL: do not finish validating
            seen.append(i)
            yield batch

    monkeypatch.setattr(evaluation, "eval_batches", signalled_at_the_second_batch)
    tiny_cfg.max_steps, tiny_cfg.eval_every, tiny_cfg.save_every, tiny_cfg.max_tokens = 50, 2, 50, 150
    tiny_cfg.log_every = 1
    result = train(tiny_cfg)
    assert result.stopped_by == "SIGTERM" and result.steps == 2
    assert seen == [0, 1]  # no validation batch after the signal (of the loss pass; decoding never began)
    assert [p.name for p in list_checkpoints(tiny_cfg.output_dir)] == ["step_2"]
    rows = [json.loads(x) for x in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # training rows only: the cut validation logs nothing
    assert not (Path(tiny_cfg.output_dir) / "best").exists()
