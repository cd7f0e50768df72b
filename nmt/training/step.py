"""One optimizer step, shared by training and `nmt check`'s timed probe, and the optimizer and schedule it steps.

`train_step` runs on an `Accelerator`, or on `OneDevice`: the same calls without Accelerate, for the probe.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from dataclasses import dataclass

import torch

from nmt.compat import mkldnn_bf16_supported
from nmt.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one optimizer step reports; loss and nll are per real target token over all processes."""

    loss: float
    nll: float
    tokens: int  # real target tokens of the step, all processes
    grad_norm: float | None
    finite: bool  # False: the loss or gradient was not finite and no update was made
    stop: bool  # some process asked to stop after this step


class OneDevice:
    """The part of `Accelerator` that `train_step` uses, for one process on one device without Accelerate
    (no gradient scaler; bf16/fp16 as autocast around each micro-batch): what `nmt check` and the plan time."""

    num_processes, scaler = 1, None

    def __init__(self, device: torch.device, accum_steps: int = 1, mixed_precision: str = "no"):
        self.device, self.accum_steps, self.micro = torch.device(device), accum_steps, 0
        self.mixed_precision = mixed_precision

    @property
    def sync_gradients(self) -> bool:
        return self.micro % self.accum_steps == 0

    @contextlib.contextmanager
    def accumulate(self, model):
        self.micro += 1
        with autocast(self.device, self.mixed_precision):
            yield

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.accum_steps).backward()  # as Accelerator.backward under accumulation

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)


@dataclass
class Optim:
    """The optimizer, its schedule and the clipping threshold a step applies."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    clip_norm: float | None = None


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (frozen ones, `finetune`, are left out: no update, no weight decay);
    the fused kernel where this torch has one for the device."""
    o = cfg.optim
    kwargs = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, **kwargs)


def inverse_sqrt(warmup: int):
    """lr factor: linear warmup to 1 over `warmup` steps, then sqrt(warmup / step)."""
    warmup = max(warmup, 1)
    return lambda step: min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))


def linear_decay(warmup: int, decay_steps: int):
    """lr factor: linear warmup to 1 over `warmup` steps, then linearly down to 0 at step `decay_steps` (the
    budgeted-training schedule: Li et al. 2020 find it best when the number of steps is known in advance)."""
    warmup = max(min(warmup, decay_steps - 1), 1)
    span = max(decay_steps - warmup, 1)
    return lambda step: max(0.0, min((step + 1) / warmup, (decay_steps - step) / span))


def schedule_of(cfg: TrainConfig):
    """The config's lr factor per step; `linear` needs optim.decay_steps (the plan or the run fills it)."""
    o = cfg.optim
    if o.schedule == "linear":
        if o.decay_steps is None:
            raise ValueError("optim.schedule linear needs optim.decay_steps")
        return linear_decay(o.warmup_steps, o.decay_steps)
    return inverse_sqrt(o.warmup_steps)


def make_optim(model: torch.nn.Module, cfg: TrainConfig) -> Optim:
    """AdamW with the config's warmup and schedule and clipping, as training steps it."""
    optimizer = make_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(cfg))
    return Optim(optimizer, scheduler, cfg.optim.clip_norm)


def set_schedule(optim: Optim, cfg: TrainConfig) -> None:
    """Step the lr by `cfg`'s schedule from now on (a re-planned warmup or end); the step count stays."""
    scheduler = getattr(optim.scheduler, "scheduler", optim.scheduler)  # under Accelerate: the wrapped LambdaLR
    scheduler.lr_lambdas = [schedule_of(cfg)]


def default_device(device: str | None = None) -> torch.device:
    """`device`, by default the first GPU, else the CPU: where the plan's timing and `nmt check`'s probe run."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def native_bf16(device_type: str) -> bool:
    """Whether `device_type` multiplies bf16 in hardware: a GPU that supports it, or a CPU with oneDNN's bf16
    kernels (AVX512-BF16 or AMX)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device_type == "cpu" and mkldnn_bf16_supported()


def run_precision(cfg: TrainConfig, device_type: str) -> str:
    """The mixed precision a run trains in: the launcher's when it chose one (`accelerate launch`, a profile,
    ACCELERATE_MIXED_PRECISION); else, under a time budget (max_minutes), bf16 where the device multiplies it in
    hardware: more steps in the same minutes (1.55x on a 2-core AVX512-BF16 CPU, benchmarks/train_speed.py),
    which validated better (docs/results.md); else fp32 ("no")."""
    launched = launched_precision()
    if launched is not None:
        return launched
    return "bf16" if cfg.max_minutes is not None and native_bf16(device_type) else "no"


def launched_precision() -> str | None:
    """The mixed precision the launcher chose (`accelerate launch`, a profile, ACCELERATE_MIXED_PRECISION); None:
    none chosen, nmt chooses (`run_precision`)."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() or None


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """What Accelerate wraps a prepared model's forward in, for `OneDevice` steps (the plan's and check's timing)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


@functools.cache
def warn_if_bf16_is_slow(device_type: str, mixed_precision: str, main: bool = True) -> None:
    """Once per process: bf16 autocast on a CPU without bf16 matmul kernels (oneDNN's need AVX512 or AMX;
    otherwise torch multiplies bf16 in a plain loop, 1-2 GFLOP/s against ~30 in fp32 on one AVX2 core)."""
    if main and device_type == "cpu" and mixed_precision == "bf16" and not mkldnn_bf16_supported():
        log.warning("mixed_precision bf16 on a CPU without bf16 matmul units (no AVX512/AMX): training runs "
                    "~15x slower than in fp32; use an fp32 profile (accelerate_configs/cpu.yaml)")


def train_step(accelerator, objective, optim: Optim, window: list[dict], stop: bool = False) -> StepStats:
    """One optimizer step of `objective` (a `Seq2SeqLoss`, prepared or not) over this process's micro-batches.

    Each micro-batch's summed loss is divided by the target tokens of the whole step on all processes;
    DDP's mean over processes and accelerate's division by accum_steps are undone by the factor, so
    the gradient equals the one-process, no-accumulation gradient of the same global batch.
    A step whose gradient is not finite makes no update (under fp16 the loss scaler skips it and
    lowers its scale). `stop` (this process wants to stop) is shared with all processes.
    """
    objective.train()
    warn_if_bf16_is_slow(accelerator.device.type, str(accelerator.mixed_precision),
                         getattr(accelerator, "is_main_process", True))
    pad_id = _pad_id(accelerator, objective)
    local = sum(int(b["labels"].ne(pad_id).sum()) for b in window)
    n_tokens = int(accelerator.reduce(torch.tensor(local, device=accelerator.device), "sum"))
    scale = accelerator.num_processes * len(window) / max(n_tokens, 1)
    loss_sum = nll_sum = 0.0
    grad_norm, finite = None, True
    for batch in window:
        with accelerator.accumulate(objective):
            sums = objective(batch["src_ids"], batch["tgt_in_ids"], batch["labels"])
            accelerator.backward(sums.loss * scale)
            loss_sum, nll_sum = loss_sum + float(sums.loss.detach()), nll_sum + float(sums.nll)
            if accelerator.sync_gradients:
                grad_norm, finite = _update(accelerator, objective, optim)
    totals = accelerator.reduce(torch.tensor([loss_sum, nll_sum, float(stop)], device=accelerator.device), "sum")
    return StepStats(loss=float(totals[0]) / max(n_tokens, 1), nll=float(totals[1]) / max(n_tokens, 1),
                     tokens=n_tokens, grad_norm=None if grad_norm is None else float(grad_norm), finite=finite,
                     stop=bool(totals[2] > 0))


def _update(accelerator, objective, optim: Optim) -> tuple[torch.Tensor | None, bool]:
    """Clip, step and zero the gradients; (gradient norm, whether the update was made)."""
    grad_norm = accelerator.clip_grad_norm_(objective.parameters(), optim.clip_norm or math.inf)
    finite = grad_norm is None or math.isfinite(float(grad_norm))  # the same on every process
    if finite or accelerator.scaler is not None:
        optim.optimizer.step()
        optim.scheduler.step()
        finite = finite and not getattr(optim.optimizer, "step_was_skipped", False)
    optim.optimizer.zero_grad(set_to_none=True)
    return grad_norm, finite


def _pad_id(accelerator, objective) -> int:
    unwrap = getattr(accelerator, "unwrap_model", None)
    return (unwrap(objective) if unwrap else objective).pad_id
