"""The run's mixed precision: the launcher's when it chose one; under a time budget bf16 where the device multiplies
it in hardware; fp32 otherwise. The plan and `nmt check` time steps in the precision training will use."""

import dataclasses

import pytest
import torch
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)

from nmt.compat import reset_accelerate_state
from nmt.tools.check import preflight
from nmt.training import loop, run
from nmt.training.loop import OneDevice, run_precision
from tests.conftest import tiny_config


@pytest.fixture
def cfg(corpus_dir, tmp_path):
    return tiny_config(corpus_dir, tmp_path)


@pytest.fixture
def unlaunched(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("minutes", [None, 25.0])
def test_bf16_only_for_a_time_budget_on_hardware_that_has_it(cfg, unlaunched, monkeypatch, native, minutes):
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: native)
    expected = "bf16" if native and minutes else "no"
    precision, why = run_precision(dataclasses.replace(cfg, max_minutes=minutes), "cpu")
    assert precision == expected and (why is not None) == (expected == "bf16")  # the plan prints why it chose bf16


@pytest.mark.parametrize("launched", ["no", "FP16", "bf16"])
def test_the_launchers_choice_wins(cfg, monkeypatch, launched):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: True)
    assert run_precision(dataclasses.replace(cfg, max_minutes=25.0), "cpu") == (launched.lower(), None)


def test_the_accelerator_trains_in_the_chosen_precision(cfg, unlaunched, monkeypatch, capsys):
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: True)
    reset_accelerate_state()
    try:
        timed = dataclasses.replace(cfg, max_minutes=25.0)
        assert run.make_accelerator(timed, run_precision(timed, "cpu")[0]).mixed_precision == "bf16"
        reset_accelerate_state()
        assert run.make_accelerator(cfg, run_precision(cfg, "cpu")[0]).mixed_precision == "no"
    finally:
        reset_accelerate_state()


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("no", None)])
def test_one_device_steps_run_the_forward_under_autocast(precision, dtype):
    seen = []
    one = OneDevice(torch.device("cpu"), mixed_precision=precision)
    with one.accumulate(None):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        x = torch.ones(2, 2) @ torch.ones(2, 2)
    assert seen == [dtype] and x.dtype == (dtype or torch.float32)
    assert not torch.is_autocast_enabled("cpu")  # only inside the micro-batch


def test_check_probes_in_the_precision_training_will_use(cfg, unlaunched, monkeypatch):
    monkeypatch.setattr(loop, "native_bf16", lambda device_type: True)
    seen = []
    real = loop.train_step

    def spy(accelerator, *args, **kwargs):
        seen.append(accelerator.mixed_precision)
        return real(accelerator, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", spy)
    report = preflight(dataclasses.replace(cfg, max_minutes=5.0), probe_steps=1, device="cpu")
    assert report.precision == "bf16" and set(seen) == {"bf16"}
    assert " s/step on cpu in bf16 " in next(line for line in report.lines() if line.startswith("time"))
