"""Start a training function on several processes that form ONE process group, from Python or a notebook.

Usage from a notebook (or any script)::

    from nmt import launch          # or: from nmt.launch import launch
    launch(train, (cfg,), num_processes=2)

``train`` must be a plain function defined at the top level of an importable module or of the notebook
(not a lambda, not a nested function, not a bound method of an object that cannot be pickled): the processes
are started with ``fork`` where the platform has it, but ``spawn`` (Windows, ROCm/XPU in accelerate) pickles
the function and its arguments. ``train`` must create its ``Accelerator`` itself; do not create one (and do
not touch CUDA) in the notebook before calling ``launch``, because forked children cannot re-initialize CUDA.

Why not ``accelerate.notebook_launcher`` everywhere: on a machine without GPUs,
``notebook_launcher(fn, num_processes=2)`` prints "Launching training on 2 CUDAs", starts two processes and
sets RANK/WORLD_SIZE, but ``PartialState()``/``Accelerator()`` in each of them report
``DistributedType.NO``, process 0 of 1: two independent runs that shard nothing and write the same files
(checked with accelerate 1.15, torch 2.13). On CPU this module therefore starts the processes itself, like
``accelerate.debug_launcher`` does, sets ``ACCELERATE_USE_CPU`` and initializes ``PartialState(cpu=True)``
in every child before ``train`` runs, so ranks, world size and the gloo group are right whether ``train``
uses ``Accelerator()``, ``PartialState()`` or ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nmt.compat import (
    accelerate_state_is_empty,
    default_store,
    forget_parent_compile_threads,
    reset_accelerate_state,
)

_MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it: bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _gpu_count() -> int:
    # torch.cuda.device_count() asks NVML and creates no CUDA context, so forking afterwards stays possible;
    # torch.cuda.is_available() calls cudaGetDeviceCount, which initialises the driver and poisons the fork.
    return torch.cuda.device_count()


def launch(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    port: int | None = None,
) -> None:
    """Run function(*args) on num_processes processes forming ONE process group: on GPUs via
    accelerate.notebook_launcher; on a CPU-only machine via real multi-process gloo DDP (as
    accelerate.debug_launcher does, with a free port and ACCELERATE_USE_CPU), so rank/world are right.
    Example (notebook cell): ``from nmt import launch; launch(train, (cfg,), num_processes=2)``.

    Args:
        function: the training function, defined at the top level of a module or notebook (see the module
            docstring). It receives ``*args``; its return value is discarded. It must build its own
            ``Accelerator`` (which then sees the right rank, world size and mixed precision).
        args: positional arguments for ``function``.
        num_processes: how many processes. ``None``: one per visible GPU, or 1 without GPUs. With 1,
            ``function`` runs in this process (no subprocess, no process group); afterwards this process's
            accelerate state is reset if it was empty before, so a later call may use other settings.
            On GPUs at most the number of visible GPUs; on CPU any number (each process gets
            ``physical cores // num_processes`` torch threads unless OMP_NUM_THREADS is set).
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``; passed to the processes as
            ``ACCELERATE_MIXED_PRECISION``, which ``Accelerator()`` reads when not given one explicitly.
        port: rendezvous port on 127.0.0.1. ``None``: a free port chosen by the OS.

    Raises:
        ValueError: num_processes < 1, more processes than GPUs, or an unknown mixed_precision.
        RuntimeError: this process is already part of a torch.distributed group.
        torch.multiprocessing.ProcessRaisedException / ProcessExitedException (CPU) or RuntimeError /
        ChildFailedError (GPU): a process failed; the other processes are terminated.
    """
    mixed_precision, num_processes, n_gpus = _checked(mixed_precision, num_processes)
    if num_processes == 1:
        return _run_in_process(function, tuple(args), mixed_precision)
    start = _launch_gpus if n_gpus else _launch_cpu
    start(function, tuple(args), num_processes, mixed_precision, free_port() if port is None else port)


def _checked(mixed_precision: str, num_processes: int | None) -> tuple[str, int, int]:
    """(mixed_precision, num_processes, visible GPUs) of a launch request, or the error that refuses it."""
    mixed_precision = str(mixed_precision).lower()
    if mixed_precision not in _MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision must be one of {_MIXED_PRECISIONS}, got {mixed_precision!r}")
    n_gpus = _gpu_count()
    if num_processes is None:
        num_processes = n_gpus or 1
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
    if num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError(
            "launch() was called from a process that is already in a torch.distributed process group; "
            "call it from a plain notebook kernel or script"
        )
    if num_processes > 1 and n_gpus and num_processes > n_gpus:
        raise ValueError(
            f"num_processes={num_processes} but only {n_gpus} GPU(s) are visible; "
            "use at most one process per GPU"
        )
    return mixed_precision, num_processes, n_gpus


def _run_in_process(function: Callable[..., Any], args: tuple, mixed_precision: str) -> None:
    from accelerate.utils import patch_environment

    was_empty = accelerate_state_is_empty()
    try:
        with patch_environment(accelerate_mixed_precision=mixed_precision):
            function(*args)
    finally:
        if was_empty:
            reset_accelerate_state()


def _launch_gpus(function: Callable[..., Any], args: tuple, num_processes: int, mixed_precision: str, port: int) -> None:
    from accelerate import notebook_launcher

    notebook_launcher(
        functools.partial(_gpu_worker, function),
        args,
        num_processes=num_processes,
        mixed_precision=mixed_precision,
        use_port=str(port),
    )


def _start_clean() -> None:
    """In a forked child: forget the parent's accelerate singletons and torch.compile's pool without threads."""
    reset_accelerate_state()
    forget_parent_compile_threads()


def _gpu_worker(function: Callable[..., Any], *args: Any) -> None:
    _start_clean()
    function(*args)


def _launch_cpu(function: Callable[..., Any], args: tuple, num_processes: int, mixed_precision: str, port: int) -> None:
    from torch.multiprocessing import start_processes

    start_method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    ranks = start_processes(
        _cpu_worker,
        args=(function, args, num_processes, port, mixed_precision),
        nprocs=num_processes,
        start_method=start_method,
        join=False,
    )
    try:  # join: waits for all; if one raises, the others are terminated and the error is re-raised here
        # in short waits: a Ctrl-C that the kernel hands to another of this process's threads is only seen by this
        # thread once its wait returns
        while not ranks.join(timeout=0.5):
            pass
    finally:  # interrupted (Ctrl-C in a notebook, a test's timeout): no rank outlives the launch
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _cpu_worker(
    index: int, function: Callable[..., Any], args: tuple, world_size: int, port: int, mixed_precision: str
) -> None:
    # Only this child's environment is changed; the parent's os.environ stays as it was.
    os.environ.update(
        {
            "RANK": str(index),
            "LOCAL_RANK": str(index),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "ACCELERATE_USE_CPU": "true",
            "ACCELERATE_MIXED_PRECISION": mixed_precision,
        }
    )
    if sys.platform.startswith("linux"):
        # gloo otherwise picks the interface of the host name, which may not reach 127.0.0.1.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _start_clean()
    from accelerate import PartialState

    # Forms the gloo group (MULTI_CPU). Later PartialState() / Accelerator() calls in `function` reuse this
    # state; without it a bare PartialState() would report process 0 of 1 here.
    PartialState(cpu=True)
    function(*args)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


_prepared_calls = [0]  # main_process_first calls so far in this process: the same count on every rank


@contextlib.contextmanager
def main_process_first(local: bool = False, poll_s: float = 0.5) -> Iterator[None]:
    """The main process runs the block first (fills a cache); the others run it once it has finished.

    Unlike `Accelerator.main_process_first`, the others wait by polling the process group's key-value store,
    not inside a collective, so however long the main process takes (a cold preparation of tens of millions
    of pairs), nothing reaches the process group timeout (`dist_timeout_minutes`). If the main process fails
    in the block, the others stop with an error too.

    Args:
        local: True when the cache is node-local: each node's local main process runs first, and waits for
            nobody. False (a cache every node sees): only the global main process runs first.
        poll_s: seconds between two looks at the store.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    from accelerate import PartialState

    state = PartialState()
    leader = state.process_index - state.local_process_index if local else 0
    _prepared_calls[0] += 1
    key = f"nmt/main_first/{_prepared_calls[0]}/{leader}"
    store = default_store()
    if state.process_index == leader:
        try:
            yield
        except BaseException:
            store.set(key, "failed")
            raise
        store.set(key, "done")
        return
    while not store.check([key]):
        time.sleep(poll_s)
    if store.get(key) != b"done":
        from nmt.errors import NmtError

        raise NmtError(f"process {leader} failed while preparing the data (its error is above); nothing to do here")
    yield
