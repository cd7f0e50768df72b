"""nmt.launch.launch: several processes form ONE process group, also on a machine without GPUs."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest
import torch
from accelerate.state import PartialState

from nmt.compat import accelerate_state_exists, accelerate_state_is_empty
from nmt.launch import free_port, launch

# the module, also when nmt/__init__.py re-exports the function as `nmt.launch`
nmt_launch = importlib.import_module("nmt.launch")

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only code path")


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


# Functions run in the child processes: top level, so that they also work with the spawn start method.


def _record(out_dir: str) -> None:
    from accelerate import Accelerator

    s = PartialState()  # bare, before any Accelerator: the case notebook_launcher gets wrong on CPU
    accelerator = Accelerator()
    t = torch.tensor([float(s.process_index + 1)])
    torch.distributed.all_reduce(t)
    rec = {
        "rank": s.process_index,
        "world": s.num_processes,
        "type": str(s.distributed_type),
        "acc_rank": accelerator.process_index,
        "acc_world": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "allreduce": t.item(),
        "pid": os.getpid(),
    }
    Path(out_dir, f"rank{s.process_index}.json").write_text(json.dumps(rec))


def _fail_on_rank1() -> None:
    s = PartialState()
    if s.process_index == 1:
        raise KeyError("boom on rank 1")
    torch.distributed.all_reduce(torch.ones(1))  # rank 0 would wait here forever if rank 1's error were lost


def _record_notebook_launcher(out_dir: str) -> None:
    s = PartialState()
    t = torch.tensor([float(s.process_index + 1)])
    torch.distributed.all_reduce(t)  # notebook_launcher's children do share a group...
    rec = {"rank": s.process_index, "world": s.num_processes, "type": str(s.distributed_type), "allreduce": t.item()}
    Path(out_dir, f"envrank{os.environ['RANK']}.json").write_text(json.dumps(rec))
    torch.distributed.destroy_process_group()  # a gloo group left alive at exit can abort a rank (seen in CI)


def _read(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out_dir.glob("*.json"))]


@needs_cpu_only
@pytest.mark.multiprocess
def test_two_cpu_processes_form_one_group(tmp_path):
    env_before = dict(os.environ)
    for mixed_precision in ("no", "bf16"):  # twice in a row: a fresh port each time
        out = tmp_path / mixed_precision
        out.mkdir()
        launch(_record, (str(out),), num_processes=2, mixed_precision=mixed_precision)
        records = _read(out)
        assert sorted(r["rank"] for r in records) == [0, 1]
        assert {r["world"] for r in records} == {2}
        assert {r["type"] for r in records} == {"DistributedType.MULTI_CPU"}
        assert sorted(r["acc_rank"] for r in records) == [0, 1]
        assert {r["acc_world"] for r in records} == {2}
        assert {r["allreduce"] for r in records} == {3.0}  # 1 + 2: one group, not two rank-0 runs
        assert {r["mixed_precision"] for r in records} == {mixed_precision}
        assert len({r["pid"] for r in records}) == 2 and os.getpid() not in {r["pid"] for r in records}
    # The parent is left as it was: no accelerate state, no distributed environment variables.
    assert accelerate_state_is_empty()
    assert not torch.distributed.is_initialized()
    assert dict(os.environ) == env_before


@needs_cpu_only
@pytest.mark.multiprocess
def test_failure_in_one_rank_is_raised_and_does_not_hang():
    from torch.multiprocessing import ProcessRaisedException

    with pytest.raises(ProcessRaisedException, match="boom on rank 1"):
        launch(_fail_on_rank1, num_processes=2)


def _compile_something_new(out_dir: str) -> None:
    rank = PartialState().process_index
    twice = torch.compile(lambda x: (x.cos() * 3 - 1).tanh())  # not the parent's function: new kernels to build
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(float(twice(torch.ones(4)).sum())))


@needs_cpu_only
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_ranks_compile_after_the_parent_compiled(tmp_path, monkeypatch):
    """A notebook that compiled something, then launches a compiling run: every rank builds its kernels (the forked
    ranks inherited torch.compile's thread pool without its threads; with an empty kernel cache they waited for
    it forever, as in CI)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "kernels"))  # empty: nothing comes from disk
    torch.compile(lambda x: (x.sin() * 2 + 1).relu())(torch.ones(4))
    launch(_compile_something_new, (str(tmp_path),), num_processes=2)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [
        pytest.approx(float(torch.tanh(torch.ones(4).cos() * 3 - 1).sum()))] * 2


def _sleep_forever(out_dir: str) -> None:
    import time

    Path(out_dir, f"{os.getpid()}.pid").touch()
    while True:
        time.sleep(1)


@needs_cpu_only
@pytest.mark.multiprocess
def test_an_interrupted_launch_leaves_no_rank_behind(tmp_path):
    """Ctrl-C in a notebook (or a test's timeout) while the ranks run: the interruption reaches the caller and
    every rank is gone, none left holding a port, a core or a process group."""
    import signal
    import threading
    import time

    def ctrl_c_once_both_run():
        while len(list(tmp_path.glob("*.pid"))) < 2:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends: KeyboardInterrupt in the caller's thread

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a plain interpreter's, as a notebook's
    threading.Thread(target=ctrl_c_once_both_run, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch(_sleep_forever, (str(tmp_path),), num_processes=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # reaped, not a zombie: gone from the process table
            os.kill(pid, 0)


@needs_cpu_only
@pytest.mark.multiprocess
def test_notebook_launcher_trap_on_cpu(tmp_path):
    """Why nmt.launch exists: accelerate.notebook_launcher(fn, num_processes=2) on a machine without GPUs starts
    2 processes (RANK 0 and 1, sharing a gloo group), but accelerate's state in each says process 0 of 1,
    DistributedType.NO: two independent runs writing the same files. If this starts failing, accelerate fixed it."""
    from accelerate import notebook_launcher

    notebook_launcher(_record_notebook_launcher, (str(tmp_path),), num_processes=2, use_port=str(free_port()))
    records = _read(tmp_path)
    assert len(records) == 2
    assert [(r["rank"], r["world"], r["type"]) for r in records] == [(0, 1, "DistributedType.NO")] * 2
    assert {r["allreduce"] for r in records} == {2.0}


def test_one_process_runs_in_process_and_resets_state():
    from accelerate import Accelerator

    seen = []

    def train(tag):  # a closure is fine here: nothing is forked or pickled with one process
        acc = Accelerator()
        seen.append((tag, os.getpid(), acc.num_processes, acc.mixed_precision))

    env_before = dict(os.environ)
    launch(train, ("a",), num_processes=1, mixed_precision="bf16")
    assert accelerate_state_is_empty()
    launch(train, ("b",), num_processes=1)  # other settings: no "AcceleratorState already initialized" error
    assert seen == [("a", os.getpid(), 1, "bf16"), ("b", os.getpid(), 1, "no")]
    assert dict(os.environ) == env_before


def test_one_process_keeps_state_that_existed_before():
    PartialState(cpu=True)
    launch(lambda: None, num_processes=1)
    assert accelerate_state_exists()


def test_default_num_processes_without_gpus_is_one(monkeypatch):
    monkeypatch.setattr(nmt_launch, "_gpu_count", lambda: 0)
    pids = []
    launch(lambda: pids.append(os.getpid()))
    assert pids == [os.getpid()]


@pytest.mark.parametrize("kwargs", [{"num_processes": 0}, {"num_processes": 2.0}, {"mixed_precision": "fp32"}])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        launch(lambda: None, **kwargs)


def test_gpu_path_uses_notebook_launcher(monkeypatch):
    """With GPUs, launch() hands over to accelerate.notebook_launcher (simulated here: no GPU needed), and
    counts the GPUs without initialising CUDA, which would poison the fork ("Cannot re-initialize CUDA in
    forked subprocess"): only torch.cuda.device_count(), which asks NVML, is allowed before it."""
    import accelerate

    def poisons_fork(*args):
        raise AssertionError("CUDA initialised before notebook_launcher forks")

    for name in ("is_available", "init", "_lazy_init", "current_device", "is_bf16_supported"):
        monkeypatch.setattr(torch.cuda, name, poisons_fork)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", poisons_fork, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    calls = []

    def fake_notebook_launcher(function, args, num_processes, mixed_precision, use_port):
        calls.append((num_processes, mixed_precision, use_port))
        PartialState(cpu=True)  # a state the child must not inherit
        function(*args)

    monkeypatch.setattr(accelerate, "notebook_launcher", fake_notebook_launcher)
    got = []

    def train(x):
        got.append((x, accelerate_state_exists()))

    launch(train, (7,), mixed_precision="bf16", port=12345)
    launch(train, (8,), num_processes=2)
    assert calls[0] == (4, "bf16", "12345")  # None -> one process per GPU
    assert calls[1][:2] == (2, "no") and calls[1][2].isdigit() and int(calls[1][2]) > 0
    assert got == [(7, False), (8, False)]  # the child starts from a clean accelerate state
    with pytest.raises(ValueError, match="GPU"):
        launch(train, num_processes=5)


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
