"""The training loop (nmt.training.loop) as a run meets it: the learning-rate schedules and where they end a run,
early stopping and a limit named when it ends the run, the progress line and the metrics rows, one optimizer step
(the device read once, nothing copied from the host), and the run's mixed precision: the launcher's when it chose
one; under a time budget bf16 where the device multiplies it in hardware; fp32 otherwise (`nmt check` and the plan
time steps in the precision training will use)."""

import dataclasses
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)

from nmt import train
from nmt.compat import reset_accelerate_state
from nmt.tools.check import preflight
from nmt.training import loop, run
from nmt.training.loop import OneDevice, inverse_sqrt, linear_decay, run_precision
from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def test_inverse_sqrt_schedule():
    f = inverse_sqrt(4)
    assert [round(f(s), 3) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, round((4 / 5) ** 0.5, 3), round((4 / 6) ** 0.5, 3)]


def test_linear_decay_schedule():
    f = linear_decay(2, 6)
    assert [round(f(s), 3) for s in range(8)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert linear_decay(10, 4)(3) > 0  # a warmup longer than the run still trains before the end
    assert [linear_decay(1, 1)(s) for s in range(2)] == [1.0, 0.0]  # a one-step run


def test_a_linear_schedule_ends_training_where_its_lr_reaches_zero(tiny_cfg):
    """optim.decay_steps bounds the run (lr 0 after it); left null it is the run's own length."""
    tiny_cfg.optim.schedule, tiny_cfg.optim.decay_steps, tiny_cfg.max_steps = "linear", 5, 100
    tiny_cfg.optim.warmup_steps, tiny_cfg.log_every = 2, 1
    assert train(tiny_cfg).steps == 5
    rows = [json.loads(x) for x in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert lrs and lrs[-1] < max(lrs)


def test_a_linear_schedule_under_a_time_budget_ends_at_the_planned_steps(tiny_cfg, capsys):
    """optim.schedule linear with max_minutes and the rest planned: the plan times steps, fills decay_steps, and
    the run ends there (or at the time limit, if it comes first)."""
    from nmt.config import OptimConfig

    tiny_cfg.optim = OptimConfig(schedule="linear")
    tiny_cfg.max_steps, tiny_cfg.max_minutes, tiny_cfg.save_every = None, 0.05, None
    result = train(tiny_cfg)
    plan = json.loads((Path(tiny_cfg.output_dir) / "plan.json").read_text())
    assert "optim.decay_steps" in capsys.readouterr().out and 1 <= result.steps <= plan["chosen"]["optim.decay_steps"]


def test_early_stopping_with_patience(tiny_cfg):
    tiny_cfg.max_steps, tiny_cfg.eval_every, tiny_cfg.patience = 60, 2, 1
    tiny_cfg.optim.lr = 0.0  # nothing changes, so the second validation cannot improve on the first
    result = train(tiny_cfg)
    assert result.steps == 4  # validations at 2 (best) and 4 (no better): patience 1 is used up


def test_progress_line_and_one_line_validation(tiny_cfg, capsys, caplog, monkeypatch):
    """On a terminal the main process keeps one live line (steps done/total, elapsed<ETA, epoch, loss, lr, target
    tokens/s); each validation prints one compact line; checkpoints of the tied embeddings print no warning."""
    import re

    monkeypatch.setattr("nmt.training.loop.stderr_is_terminal", lambda: True)
    tiny_cfg.max_steps, tiny_cfg.eval_every, tiny_cfg.save_every = 4, 2, 2
    with caplog.at_level("WARNING"):
        train(tiny_cfg)
    assert not [r for r in caplog.records if "shared tensor" in r.getMessage()]
    assert not logging.getLogger("accelerate.utils.other").filters  # muted only while saving, then restored
    err = capsys.readouterr().err
    bar = [s for s in re.split(r"[\r\n]", err) if s.startswith("train:")][-1]  # the line as it was left
    m = re.search(r"\| (\d+)/(\d+) \[[\d:]+<([\d:]+),\s+[\d.]+(?:step/s|s/step), epoch=(\d+), loss=([\d.]+), "
                  r"lr=([\d.e+-]+), tok/s=(\d+), mem=[\d.]+G\]$", bar)
    assert m, bar
    assert (m[1], m[2], m[3]) == ("4", "4", "00:00") and float(m[5]) > 0 and float(m[6]) > 0 and int(m[7]) > 0
    valid = [line for line in err.splitlines() if line.startswith("valid @")]
    assert [line.split(":")[0] for line in valid] == ["valid @ step 2", "valid @ step 4"]
    for line in valid:
        assert re.fullmatch(r"valid @ step \d: valid_nll [\d.]+ valid_ppl [\d.]+ bleu [\d.]+ chrf [\d.]+( \(best\))?", line)


def test_progress_off_a_terminal_is_plain_lines_every_log_every(tiny_cfg, capsys, monkeypatch):
    """stderr is not a terminal (captured here, as under SLURM or nohup): one plain line every log_every steps,
    no carriage returns or bar redraws; each with the process's peak memory, as metrics.jsonl's rows have it.
    The CUDA allocator is set to grow its segments unless the user's PYTORCH_ALLOC_CONF says otherwise."""
    import json
    import re

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    tiny_cfg.max_steps, tiny_cfg.log_every = 6, 2
    train(tiny_cfg)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("train:")]
    assert [line.split()[2] for line in lines] == ["2/6", "4/6", "6/6"]
    assert re.fullmatch(r"train: step 6/6 \(100%\) \[[\d:]+<00:00\] epoch=\d+ loss=[\d.]+ lr=[\d.e+-]+ tok/s=\d+ "
                        r"mem=[\d.]+G", lines[-1]), lines[-1]
    rows = [json.loads(line) for line in (Path(tiny_cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    peaks = [row["peak_memory_gib"] for row in rows if "loss" in row]
    assert len(peaks) == 3 and 0 < peaks[0] <= peaks[1] <= peaks[2]  # a peak: it never falls
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")
    from nmt.training.run import expandable_segments

    expandable_segments()
    assert os.environ["PYTORCH_ALLOC_CONF"] == "backend:cudaMallocAsync"  # the user's setting wins


def test_progress_total_comes_from_the_time_budget(tiny_cfg, capsys):
    """max_minutes ends the run long before max_steps: the progress total is what the budget allows, not
    max_steps, and the last line reaches it."""
    tiny_cfg.max_steps, tiny_cfg.max_minutes, tiny_cfg.log_every = 100_000, 0.05, 1
    result = train(tiny_cfg)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train:")]
    done, total = map(int, lines[-1].split()[2].split("/"))
    assert done == result.steps <= total < 100_000  # the total follows the re-timed plan's estimate
    assert all(int(line.split()[2].split("/")[1]) < 100_000 for line in lines[1:])


def test_budget_total_projects_the_steps_left_in_the_budget():
    from nmt.training.loop import budget_total

    assert budget_total(100_000, 0, 0, 0.0, 25) == 100_000  # no step done: no rate yet
    assert budget_total(100_000, 10, 10, 60.0, None) == 100_000  # no budget
    assert budget_total(100_000, 10, 10, 60.0, 25) == 10 + 24 * 60 * 10 // 60  # 10 steps a minute, 24 minutes left
    assert budget_total(200, 10, 10, 60.0, 25) == 200  # max_steps comes first
    assert budget_total(100_000, 30, 10, 60.0, 1) == 30  # resumed at step 20, the budget spent


def test_a_limit_set_in_the_config_is_named_when_it_ends_the_run(tiny_cfg, capsys):
    from nmt.cli import main
    from nmt.config import save_yaml

    tiny_cfg.max_steps, tiny_cfg.max_epochs, tiny_cfg.max_minutes = None, 1, 10
    save_yaml(tiny_cfg, Path(tiny_cfg.output_dir).parent / "c.yaml")
    assert main(["train", "--config", str(Path(tiny_cfg.output_dir).parent / "c.yaml")]) == 0
    head = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("nmt: trained "))
    assert " of 10 minutes; stopped: max_epochs 1, set in the config" in head and "(1.0 epochs)" in head


def test_an_optimizer_step_reads_the_device_once_whatever_its_micro_batches():
    """train_step over 3 micro-batches of the plain objective (a GPU's): the micro-batches read nothing (token
    counts and loss sums stay tensors), and the step's figures are read once, with the gradient norm."""
    from helpers import HostSyncs, src_batch, tgt_in_batch, tiny_model

    from nmt.config import TrainConfig
    from nmt.model import Seq2SeqLoss
    from nmt.training.loop import OneDevice, make_optim, train_step

    gen = torch.Generator().manual_seed(0)
    model = tiny_model(vocab=30, layers=1, dropout=0.1).train()
    objective = Seq2SeqLoss(model, 0.1)
    cfg = TrainConfig()
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 10
    optim = make_optim(objective, cfg)
    window = []
    for lengths in ([5, 3], [7, 2, 4], [3]):
        tgt = tgt_in_batch(gen, lengths, 30)
        window.append({"src_ids": src_batch(gen, lengths, 30), "tgt_in_ids": tgt,
                       "labels": torch.cat([tgt[:, 1:], torch.zeros_like(tgt[:, :1])], 1)})
    with HostSyncs() as syncs:
        stats = train_step(OneDevice(torch.device("cpu"), accum_steps=3), objective, optim, window)
    assert syncs.calls == ["tolist"]
    assert stats.finite and stats.tokens == sum(int(b["labels"].ne(0).sum()) for b in window)


def test_an_optimizer_step_off_the_host_reads_once_copies_nothing_from_it_and_mixes_no_devices():
    """The same step as a GPU runs it (the objective as training builds it, AdamW unfused where the device has no
    fused kernel), on `meta`:
    shapes without values, so a read of a value, a copy from host memory (which makes a GPU's host wait) or a
    tensor of another device shows itself (`helpers.OffHost`). The one read is the step's figures."""
    from helpers import OffHost, src_batch, tgt_in_batch, tiny_model

    from nmt.config import TrainConfig
    from nmt.kernels import FusedSeq2SeqLoss
    from nmt.training.loop import OneDevice, make_objective, make_optim, train_step

    gen, meta = torch.Generator().manual_seed(0), torch.device("meta")
    cfg = TrainConfig()
    objective = make_objective(tiny_model(vocab=30, dropout=0.1).train().to(meta), cfg)
    assert type(objective) is FusedSeq2SeqLoss
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 10
    optim = make_optim(objective, cfg)
    window = []
    for lengths in ([5, 3], [7, 2, 4]):
        tgt = tgt_in_batch(gen, lengths, 30)
        batch = {"src_ids": src_batch(gen, lengths, 30), "tgt_in_ids": tgt,
                 "labels": torch.cat([tgt[:, 1:], torch.zeros_like(tgt[:, :1])], 1)}
        window.append({k: v.to(meta) for k, v in batch.items()})
    for stop in (False, True):
        with OffHost() as off:
            train_step(OneDevice(meta, accum_steps=2), objective, optim, window, stop=stop)
        assert (off.reads, off.copies, off.mixes) == (["tolist"], [], [])


# --- the run's mixed precision -----------------------------------------------------------------------------------


@pytest.fixture
def precision_cfg(corpus_dir, tmp_path):
    return tiny_config(corpus_dir, tmp_path)


@pytest.fixture
def unlaunched(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("minutes", [None, 25.0])
def test_bf16_only_for_a_time_budget_on_hardware_that_has_it(precision_cfg, unlaunched, monkeypatch, native, minutes):
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: native)
    expected = "bf16" if native and minutes else "no"
    precision, why = run_precision(dataclasses.replace(precision_cfg, max_minutes=minutes), "cpu")
    assert precision == expected and (why is not None) == (expected == "bf16")  # the plan prints why it chose bf16


@pytest.mark.parametrize("bf16_units", [True, False])
@pytest.mark.parametrize("minutes", [None, 25.0])
def test_a_gpu_trains_in_bf16_where_it_has_the_units_else_fp16(precision_cfg, unlaunched, monkeypatch, bf16_units,
                                                                minutes):
    """Issue 46, part 1: on a GPU nmt trains mixed, budget or not: bf16 with bf16 units, fp16 (scaled) without;
    bf16 that torch only emulates (V100, T4) does not count. The device's answers are faked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16_units or
                        including_emulation)
    assert loop.native_bf16("cuda") == bf16_units
    precision, why = run_precision(dataclasses.replace(precision_cfg, max_minutes=minutes), "cuda")
    assert precision == ("bf16" if bf16_units else "fp16") and ("bf16 units" in why)


@pytest.mark.parametrize("launched", ["no", "FP16", "bf16"])
def test_the_launchers_choice_wins(precision_cfg, monkeypatch, launched):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: True)
    assert run_precision(dataclasses.replace(precision_cfg, max_minutes=25.0), "cpu") == (launched.lower(), None)


def test_the_accelerator_trains_in_the_chosen_precision(precision_cfg, unlaunched, monkeypatch, capsys):
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: True)
    reset_accelerate_state()
    try:
        timed = dataclasses.replace(precision_cfg, max_minutes=25.0)
        assert run.make_accelerator(timed, run_precision(timed, "cpu")[0]).mixed_precision == "bf16"
        reset_accelerate_state()
        assert run.make_accelerator(precision_cfg, run_precision(precision_cfg, "cpu")[0]).mixed_precision == "no"
    finally:
        reset_accelerate_state()


def test_validation_decodes_in_the_training_precision(precision_cfg, monkeypatch):
    """Issue 46, part 1: a run in bf16 decodes its validation under the same autocast (it decoded in fp32)."""
    import nmt.training.evaluation as evaluation

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    search, seen = evaluation.search_encoded, []
    monkeypatch.setattr(evaluation, "search_encoded", lambda *a, **kw: seen.append(
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None) or search(*a, **kw))
    reset_accelerate_state()
    try:
        train(dataclasses.replace(precision_cfg, max_steps=4, eval_every=2))
    finally:
        reset_accelerate_state()
    assert seen and set(seen) == {torch.bfloat16}, seen


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("no", None)])
def test_one_device_steps_run_the_forward_under_autocast(precision, dtype):
    seen = []
    one = OneDevice(torch.device("cpu"), mixed_precision=precision)
    with one.accumulate(None):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        x = torch.ones(2, 2) @ torch.ones(2, 2)
    assert seen == [dtype] and x.dtype == (dtype or torch.float32)
    assert not torch.is_autocast_enabled("cpu")  # only inside the micro-batch


def test_check_probes_in_the_precision_training_will_use(precision_cfg, unlaunched, monkeypatch):
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: True)
    seen = []
    real = loop.train_step

    def spy(accelerator, *args, **kwargs):
        seen.append(accelerator.mixed_precision)
        return real(accelerator, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", spy)
    report = preflight(dataclasses.replace(precision_cfg, max_minutes=5.0), probe_steps=1, device="cpu")
    assert report.precision == "bf16" and set(seen) == {"bf16"}
    assert " s/step on cpu in bf16 " in next(line for line in report.lines() if line.startswith("time"))
