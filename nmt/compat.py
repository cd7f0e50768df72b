"""Every private or text-matched use of a third-party library, in one place, each checked by tests/test_compat.py.

Checked against accelerate 1.15.0, torch 2.13.0, datasets 5.2.0 and uvicorn 0.54.0; `private` turns a gone or changed
private API into one error naming the installed version and the checked one. When one of those tests fails after an
upgrade, fix it here (and only here). Libraries are imported inside the functions: this module stays cheap.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import sys


@contextlib.contextmanager
def private(library: str, what: str, checked: str):
    """Inside the block, a private API of `library` that is gone or changed (AttributeError, TypeError, ImportError)
    becomes one NmtError naming it, the installed version and the one `what` was checked against."""
    try:
        yield
    except (AttributeError, TypeError, ImportError) as e:
        from importlib.metadata import version

        from nmt.errors import NmtError

        raise NmtError(f"{library} {version(library)} changed {what}, which nmt uses as {library} {checked} has it "
                       f"({type(e).__name__}: {e}); install {library}=={checked}.* or report it") from None


def accelerate_state_exists() -> bool:
    """Whether accelerate's process-wide PartialState has been created (accelerate 1.15.0: the Borg dict
    `PartialState._shared_state` is empty until then; there is no public query)."""
    from accelerate.state import PartialState

    with private("accelerate", "PartialState._shared_state", "1.15"):
        return bool(PartialState._shared_state)


def accelerate_state_is_empty() -> bool:
    """No PartialState, AcceleratorState or GradientState exists in this process (accelerate 1.15.0)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    with private("accelerate", "the states' _shared_state", "1.15"):
        return not (PartialState._shared_state or AcceleratorState._shared_state or GradientState._shared_state)


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons (PartialState, AcceleratorState, GradientState), so another
    Accelerator may start with other settings. accelerate 1.15.0: `_reset_state` is private (its own tests use it)."""
    from accelerate.state import AcceleratorState, GradientState

    with private("accelerate", "AcceleratorState._reset_state", "1.15"):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def forget_parent_compile_threads() -> None:
    """In a forked child: drop the thread pool that torch.compile's CPU backend inherited from its parent.

    torch 2.13's inductor compiles C++ kernels on `AsyncCompile.pool()`, a ThreadPoolExecutor cached for the
    process; its `after_fork` hook resets the process pool but not this one. A child forked after the parent
    compiled anything inherits the executor without its threads, so its first uncached kernel waits forever
    (a 2-process `compile: true` run launched from a notebook or test that had compiled before hung in CI)."""
    if "torch._inductor.async_compile" not in sys.modules:  # the parent never compiled: nothing inherited
        return
    from torch._inductor.async_compile import AsyncCompile

    with private("torch", "torch._inductor.async_compile.AsyncCompile.pool", "2.13"):
        AsyncCompile.pool.cache_clear()


def fused_devices() -> tuple[str, ...]:
    """The device types this torch has a fused AdamW kernel for (a fused optimizer on another, `meta` say, fails
    only at its first step)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch that moved it: the two this project runs on
        return ("cuda", "cpu")
    return tuple(_get_fused_kernels_supported_devices())


def mkldnn_bf16_supported() -> bool:
    """Whether this CPU has oneDNN bf16 matmul kernels (AVX512-BF16 or AMX). torch 2.13.0: only the private
    op `torch.ops.mkldnn._is_mkldnn_bf16_supported` answers it."""
    import torch

    with private("torch", "torch.ops.mkldnn._is_mkldnn_bf16_supported", "2.13"):
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def mkldnn_packed_linear_available() -> bool:
    """Whether oneDNN's packed linear ops exist (torch 2.13.0: the private `torch.ops.mkldnn._reorder_linear_weight`
    and `_linear_pointwise`, what inductor's CPU freezing uses; there is no public equivalent)."""
    import torch

    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def mkldnn_pack_linear_weight(weight):
    """weight (N, K) reordered into oneDNN's blocked layout for `mkldnn_packed_linear` (torch 2.13.0)."""
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(weight)


def mkldnn_packed_linear(x, packed, bias, relu: bool):
    """x (..., K) @ packed^T + bias -> (..., N), then ReLU if `relu`, fused (torch 2.13.0 `_linear_pointwise`)."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr="relu" if relu else "none", scalars=[], algorithm="")


def default_store():
    """The key-value store of torch.distributed's default process group, which every rank already shares (torch
    2.13.0: the private `distributed_c10d._get_default_store`; a public `TCPStore` would be a new connection)."""
    import torch.distributed as dist

    with private("torch", "distributed_c10d._get_default_store", "2.13"):
        return dist.distributed_c10d._get_default_store()


def set_process_group_timeout(timeout) -> None:
    """Give the default process group, made before (by `nmt.launch` or the user) with torch's default timeout, the
    run's collective timeout `timeout` (a timedelta): init_process_group takes it only at creation (torch 2.13.0:
    the private `distributed_c10d._set_pg_timeout`)."""
    import torch.distributed as dist

    with private("torch", "distributed_c10d._set_pg_timeout", "2.13"):
        dist.distributed_c10d._set_pg_timeout(timeout)


def generator_yielded_nothing(error: Exception) -> bool:
    """Whether `Dataset.from_generator` failed because the generator yielded no rows (datasets 5.2.0 says so only
    in the text of its error: "... corresponds to no data")."""
    return "corresponds to no data" in str(error)


# torch 2.13.0, Module.load_state_dict: the text of the RuntimeError for weights that do not fit the module
_SIZE_MISMATCH = re.compile(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) "
                            r"from checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)")
_KEYS = re.compile(r"(Missing|Unexpected) key\(s\) in state_dict: ([^\n]*)")


def state_dict_mismatch(error: RuntimeError) -> str | None:
    """What `load_state_dict`'s RuntimeError says does not fit, e.g. "decoder.x.weight is (64, 32) in the checkpoint
    but (64, 64) in the model", "missing weights ..."; None for another error (torch 2.13.0's message text)."""
    text = str(error)
    if (m := _SIZE_MISMATCH.search(text)) is not None:
        return f"{m[1]} is ({m[2]}) in the checkpoint but ({m[3]}) in the model"
    if (m := _KEYS.search(text)) is not None:
        return f"{m[1].lower()} weights {m[2][:150]}"
    return None


def tensor_version(t) -> int:
    """The counter torch bumps at each in-place change of a tensor (torch 2.13.0: `Tensor._version`, what autograd
    checks saved tensors with; not public API). Called on every packed linear: no `private` frame around it."""
    return t._version


def dataset_fingerprint(ds) -> str:
    """The content hash datasets keeps for a Dataset (datasets 5.2.0: the private `_fingerprint`, also what
    `map(new_fingerprint=...)` chains from)."""
    with private("datasets", "Dataset._fingerprint", "5.2"):
        return ds._fingerprint


def dataset_indices(ds):
    """The rows of the Arrow table under `ds` (`ds.data.table`) that a Dataset selects, as a NumPy array, or None
    when it selects all in order (datasets 5.2.0: the private `_indices` table that select, train_test_split and
    shuffle keep; the public row access reads it one row at a time)."""
    with private("datasets", "Dataset._indices", "5.2"):
        return None if ds._indices is None else ds._indices.column(0).to_numpy()


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim(0)`; a no-op where the C library has
    none). Training steps on batches of ever other shapes, in bf16 above all, leave freed blocks scattered over
    glibc's heap, which keeps them mapped: a 10M-parameter model's RSS rose from 1.2 to 4.2 GiB over 1,500 bf16
    steps without it, and stayed at 1.25 GiB calling it every 50 steps (about 2 ms a call)."""
    if (trim := _malloc_trim()) is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own C library: glibc on Linux
    except (OSError, AttributeError):  # macOS, musl, Windows
        return None


ONEDNN_PRIMITIVES = 64  # compiled oneDNN primitives kept per cache (the libraries' default: 1,024)


def bound_onednn_primitive_caches(capacity: int = ONEDNN_PRIMITIVES) -> None:
    """Keep at most `capacity` compiled oneDNN primitives in each of the two caches that hold them: oneDNN's own
    (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and the one PyTorch's oneDNN wrapper, ideep, keeps in front of it
    (LRU_CACHE_CAPACITY); a variable the user set is left as it is.

    A primitive is compiled for every new matrix shape, and both caches keep the last 1,024 by default. On the CPU,
    bf16 training (autocast's matmuls) and packed-linear decoding go through oneDNN, and their shapes change with
    nearly every batch (the real-token count of a packed batch, a search's rows and lengths), so the caches fill
    with primitives seldom used again: 400 bf16 linears of 400 row counts left 237 MiB resident with the defaults,
    40 MiB with 64 kept in each. Compiling anew costs no measurable step time (a training step takes the same with
    oneDNN's cache off), so small caches keep the reuse within a step and drop the rest.
    Both are read once, when the first primitive is made (torch 2.13.0): call this before that (nmt's training and
    `Translator` do); later calls change nothing. A capacity of 0 is refused: ideep crashes on an empty cache."""
    if capacity < 1:
        raise ValueError("keep at least one primitive: ideep's cache of capacity 0 crashes the process")
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


def uncompiled(module):
    """`module` without torch.compile's wrapper (an OptimizedModule keeps the module it compiled as `_orig_mod`,
    as accelerate's unwrap_model reads it; torch 2.13)."""
    from accelerate.utils import is_compiled_module

    return module._orig_mod if is_compiled_module(module) else module


def is_fsdp(accelerator) -> bool:
    """Whether the run shards with FSDP (accelerate 1.15.0: `DistributedType.FSDP`, versions 1 and 2)."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def uvicorn_protocol_with_header_deadline(seconds: float) -> type:
    """uvicorn's h11 protocol class, closing a connection whose next request's headers have not all arrived within
    `seconds` of the connection opening or of its previous response: uvicorn times out only idle keep-alive
    connections, so a client trickling header bytes would hold a connection for ever. uvicorn 0.54.0:
    `uvicorn.protocols.http.h11_impl.H11Protocol` and its `cycle` (the current request, set when its headers are
    complete), `transport`, `loop`, `connection_made` and `on_response_complete` are not public API."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if int(uvicorn.__version__.split(".")[0]) != 0 or int(uvicorn.__version__.split(".")[1]) < 30:
        logging.getLogger(__name__).warning("uvicorn %s is untested here; slow request headers are not cut off",
                                            uvicorn.__version__)
        return H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            self.loop.call_later(seconds, self._expire, self.cycle)

        def _expire(self, cycle) -> None:
            idle = cycle is None or cycle.response_complete  # not inside a request whose headers came
            if self.cycle is cycle and idle and not self.transport.is_closing():  # and no new one since
                self.transport.close()

    return HeaderDeadlineProtocol


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far, recompilations included (torch 2.13: dynamo's
    counters["stats"]["unique_graphs"]; there is no public count)."""
    from torch._dynamo.utils import counters

    with private("torch", "torch._dynamo.utils.counters", "2.13"):
        return int(counters["stats"]["unique_graphs"])
