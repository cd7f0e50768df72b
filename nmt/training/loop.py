"""The training loop: steps until done, and the one optimizer step it takes.

- `Loop`: steps with accumulation windows, stop signals, a time budget and early stopping, and when to log,
  validate and checkpoint (`StopSignals` around it, `step_limit` for where it ends). `Prefetcher` fetches and
  collates the next windows on a background thread while a step computes.
- One optimizer step (`train_step`), shared by training and `nmt check`'s timed probe, and the optimizer and
  schedule it steps. It runs on an `Accelerator`, or on `OneDevice`: the same calls without Accelerate, for the
  probe; the mixed precision a run trains in (`run_precision`).
- The main process's progress report (`Progress`): a live tqdm line on a terminal, one plain line every
  `log_every` steps otherwise (SLURM logs, nohup, a pipe), with the total and ETA taken from the time budget when
  there is one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
from accelerate.logging import get_logger

from nmt import checkpoint as ckpt
from nmt.compat import fused_devices, mkldnn_bf16_supported, release_free_memory
from nmt.config import OptimConfig, TrainConfig
from nmt.errors import NmtError
from nmt.kernels import use_fused_loss
from nmt.model import Seq2SeqLoss
from nmt.plan import TRAIN_SHARE, Measured, precision_for, retime, retime_line
from nmt.training.evaluation import bleu_due, evaluate_and_keep_best, validate_start
from nmt.training.state import Run, log_metrics, save_checkpoint, save_plan

log = get_logger(__name__)
plain_log = logging.getLogger(__name__)  # for what runs without Accelerate too (nmt check's probe): no process check
RELEASE_EVERY = 50  # steps between two hand-backs of the C heap's free pages


class StopSignals:
    """SIGTERM/SIGINT (preemption, Ctrl-C): the first asks the loop to stop after the current step and
    checkpoint; a second one exits at once. Only installed in the main thread.

    A repeat within `echo_s` seconds counts as the same event: under SLURM every process gets SIGTERM and
    the launcher (torchrun) forwards its own copy to the workers a moment later.
    """

    echo_s = 1.0

    def __init__(self):
        self.received: str | None = None
        self.at = 0.0
        self.previous: dict = {}

    def __enter__(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            if time.monotonic() - self.at < self.echo_s:
                return
            os._exit(128 + signum)
        self.received, self.at = signal.Signals(signum).name, time.monotonic()
        print(f"\nnmt: {self.received} received: finishing this step and saving a checkpoint "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def arrived(self) -> bool:
        """Whether a stop signal arrived: a validation asks between two batches."""
        return self.received is not None


@dataclass(frozen=True)
class Outcome:
    """How a run's loop ended."""

    stopped_by: str | None  # why it stopped early ("SIGTERM", "SIGINT", "time", "patience"), None at a step limit
    reason: str  # the same in words, or the step limit reached, for the summary
    epochs: float  # epochs of data the steps consumed


class Loop:
    """Trains `run` until a step limit, a stop signal, the time budget or patience ends it."""

    def __init__(self, run: Run, optim: Optim, loader, sampler):
        self.run, self.optim, self.loader, self.sampler = run, optim, loader, sampler
        self.total, self.limit = step_limit(run, sampler)
        self.meter, self.rate = Meter(), TokenRate()
        self.stopped_by: str | None = None
        self.session = Session()  # this process's steps, for re-timing the plan
        self.start = sampler.state_dict()  # where this session's data starts (its prefetcher fetches ahead of it)

    @property
    def expected(self) -> int:
        """The steps the progress bar counts to: the step limit, else the plan's estimate for the budget."""
        planned = self.run.plan.steps if self.run.plan and self.run.plan.steps else self.run.state.step + 1
        return self.total if self.total is not None else planned

    def __call__(self, signals: StopSignals) -> Outcome:
        """Steps until the run ends; how it ended."""
        state = self.run.state
        bar = Progress(self.run.accelerator, self.expected, state.step, self.budget_left_minutes(),
                       self.run.cfg.log_every)
        batches = Prefetcher(self.loader, self.sampler, self.run.cfg.accum_steps,
                             pin=self.run.accelerator.device.type == "cuda")
        try:
            if self.run.cfg.init_from and state.step == 0 and not state.start:  # once: a resume has it in its state
                self.validate_start(signals)
            while (self.total is None or state.step < self.total) and self.stopped_by is None:
                self.step(batches, signals, bar)
                if self.session.due(state.step, self.run):
                    self.retime(bar)
        finally:
            batches.close()
            bar.close()
        epoch, step_in_epoch = self.consumed
        return Outcome(self.stopped_by, self.reason(), epoch + step_in_epoch / self.sampler.steps_per_epoch(epoch))

    @property
    def consumed(self) -> tuple[int, int]:
        """(epoch, step in it) of the data the steps so far consumed (the sampler itself has fetched further)."""
        position = self.run.state.sampler or self.start
        return int(position["epoch"]), int(position["step_in_epoch"])

    def validate_start(self, signals: StopSignals) -> None:
        """Fine-tuning: the starting model validated and kept as the first best before step 1 (timed like any
        validation, for the budget); a stop signal meanwhile saves the step-0 checkpoint and ends the run."""
        started = time.perf_counter()
        if validate_start(self.run, signals.arrived):
            self.session.validated(time.perf_counter() - started)
        else:
            self.stopped_by = signals.received or "SIGTERM"
            self.run.state.sampler = self.sampler.state_dict()
            save_checkpoint(self.run)

    def budget_left_minutes(self) -> float | None:
        cfg = self.run.cfg
        return None if cfg.max_minutes is None else cfg.max_minutes - self.run.elapsed() / 60

    def out_of_time(self) -> bool:
        """The time budget is spent, keeping back what the run's last validation (and the average's, when it
        averages) will take, once a validation has been timed."""
        cfg = self.run.cfg
        if cfg.max_minutes is None:
            return False
        reserve = (self.session.validation_s or 0.0) * (2 if (cfg.average_last or 0) > 1 else 1)
        return self.run.elapsed() + reserve > 60 * cfg.max_minutes

    def reason(self) -> str:
        return {"time": "the time budget is spent", "patience": f"no better validation in {self.run.cfg.patience} "
                "validations (patience)", "SIGTERM": "SIGTERM", "SIGINT": "SIGINT"}.get(
                    self.stopped_by, self.limit or "")

    def retime(self, bar: Progress) -> None:
        """The plan again at the speed of this run's own steps (all processes agree: the main process's figure is
        shared), saved so that a resume continues the same plan. The run's settings and the schedule follow the
        plan (`Run.follow`, `Schedule.follow`); nothing here edits a config."""
        from accelerate.utils import broadcast_object_list

        run = self.run
        box = [Measured(run.state.step, self.session.seconds_per_step(), run.elapsed(), self.session.validation_s)]
        if run.accelerator.num_processes > 1:
            broadcast_object_list(box)  # every process then plans the same cadence
        planned_s = None
        if run.plan.steps and run.plan.minutes:
            planned_s = 60 * run.plan.minutes * TRAIN_SHARE / run.plan.steps
        run.follow(retime(run.plan, box[0], run.resolved))
        self.optim.schedule.follow(run.cfg.optim)
        self.total, self.limit = step_limit(run, self.sampler)
        bar.total = self.expected
        if run.is_main:
            print(retime_line(run.plan, planned_s), file=sys.stderr, flush=True)
            save_plan(run.plan, run.out)

    @property
    def lr(self) -> float:
        return self.optim.scheduler.get_last_lr()[0]

    def step(self, batches: Prefetcher, signals: StopSignals, bar: Progress) -> None:
        """One step of the run, top to bottom: the next window, the optimizer step, the run's counts and progress
        line, then what the step number makes due: a log entry, a validation (and an early stop on patience), a
        checkpoint."""
        run, state, cfg = self.run, self.run.state, self.run.cfg

        # the next window (fetched and collated ahead on the prefetcher's thread), onto the device
        step_start = time.perf_counter()
        fetched, position = batches.next()
        window = [to_device(batch, run.accelerator.device) for batch in fetched]

        # the optimizer step, as nmt check times it; a signal or the spent budget stops every process after it
        out_of_time = self.out_of_time()
        stats = train_step(run.accelerator, run.objective, self.optim, window,
                           stop=bool(signals.received) or out_of_time)
        if stats.stop:  # any process was signalled or is out of time: all stop after this same step
            self.stopped_by = signals.received or ("time" if out_of_time else "SIGTERM")

        # the run's counts (what a checkpoint records) and the progress line
        state.step += 1
        state.tokens_seen += stats.tokens
        state.sampler = position  # what this step consumed: a resume fetches the next window
        state.elapsed_s = run.elapsed()
        self.session.stepped(time.perf_counter() - step_start)
        note_finite(run, stats.finite)
        note_out_of_memory(run, stats.out_of_memory)
        if not stats.out_of_memory:
            self.meter.add(stats)
        bar.update(state.step, {"epoch": self.consumed[0], "loss": f"{stats.loss:.3f}", "lr": f"{self.lr:.2e}",
                                "tok/s": self.rate.update(stats.tokens, time.perf_counter() - step_start),
                                "mem": f"{peak_memory_gib(run.accelerator.device):.2f}G"})

        # log, validate and checkpoint as the step number says; the run's last step does all three
        last = state.step == self.total or self.stopped_by == "time"
        if state.step % cfg.log_every == 0 or last:
            log_metrics(run, {**self.meter.flush(), "lr": self.lr, "epoch": self.consumed[0],
                              "peak_memory_gib": round(peak_memory_gib(run.accelerator.device), 3),
                              "skipped_steps": state.skipped_steps, "oom_steps": state.oom_steps})
        if (state.step % cfg.eval_every == 0 or last) and self.stopped_by in (None, "time"):
            started, decodes = time.perf_counter(), bleu_due(cfg, state.step) or last  # the last one always scores
            kept = evaluate_and_keep_best(run, decodes, signals.arrived)
            if decodes:
                self.session.validated(time.perf_counter() - started)
            if not kept:  # a signal came during validation: save now, on every process
                self.stopped_by = signals.received or "SIGTERM"
            elif cfg.patience is not None and state.evals_since_best >= cfg.patience and not last:
                self.stopped_by = "patience"  # no better validation score for `patience` evaluations
                log.info(f"early stop at step {state.step}: best was step {state.best_step}", main_process_only=True)
        if state.step % cfg.save_every == 0 or last or self.stopped_by:
            save_checkpoint(run)
        if state.step % RELEASE_EVERY == 0:
            release_free_memory()  # resident memory stays flat over the steps (see compat.release_free_memory)


def step_limit(run: Run, sampler) -> tuple[int | None, str | None]:
    """The step the run ends at and why, from max_steps, max_epochs and a linear schedule's end (the least of
    those set); (None, None): only the time budget, early stopping or a signal ends it."""
    cfg, chosen = run.cfg, run.plan.chosen if run.plan else {}

    def by(key: str) -> str:
        return "chosen by the plan" if key in chosen else "set in the config"

    limits = []
    if cfg.max_steps:
        limits.append((cfg.max_steps, f"max_steps {cfg.max_steps:,}, {by('max_steps')}"))
    if cfg.max_epochs:
        # epoch 0's steps: under BPE-dropout epochs differ by a few steps, and a resumed run must count the same total
        limits.append((cfg.max_epochs * sampler.steps_per_epoch(0), f"max_epochs {cfg.max_epochs}, {by('max_epochs')}"))
    if cfg.optim.schedule == "linear" and cfg.optim.decay_steps:
        limits.append((cfg.optim.decay_steps, f"the linear schedule's end at optim.decay_steps {cfg.optim.decay_steps:,}"))
    return min(limits) if limits else (None, None)


def micro_batches(loader):
    """Endless micro-batches; each pass over the loader finishes an epoch (the sampler advances it)."""
    while True:
        yield from loader


class Prefetcher:
    """The training windows (`accum_steps` collated micro-batches each), fetched and collated on a background thread
    up to `depth` windows ahead of the step that uses them, so that reading and padding a batch overlaps the step
    before it; with `pin`, into page-locked memory, from which `to_device`'s copy to a GPU does not block.

    Each window comes with the sampler's position after it (`next`): the checkpoint records the data the steps
    consumed, not what the thread has fetched, so a resumed run starts at the next window and equals an
    uninterrupted one. Nothing here draws from torch's or Python's global random state (BPE-dropout segments with
    its own seeded generator, reading the epoch of the batch it fetches), so fetching on another thread changes no
    number. An error while fetching is raised by `next`, in the loop's thread."""

    def __init__(self, loader, sampler, accum_steps: int, pin: bool = False, depth: int = 2):
        self.loader, self.sampler, self.accum_steps, self.pin = loader, sampler, accum_steps, pin
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._fill, name="nmt-prefetch", daemon=True)
        self.thread.start()

    def _fill(self) -> None:
        try:
            batches = micro_batches(self.loader)
            while not self.stopping.is_set():
                window = [next(batches) for _ in range(self.accum_steps)]
                if self.pin:
                    window = [{k: v.pin_memory() for k, v in batch.items()} for batch in window]
                self._put((window, self.sampler.state_dict(), None))
        except BaseException as error:  # noqa: BLE001 - raised again in the loop's thread by `next`
            self._put((None, None, error))

    def _put(self, item) -> None:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> tuple[list[dict], dict]:
        """The next window and the sampler's position after it."""
        window, position, error = self.queue.get()
        if error is not None:
            raise error
        return window, position

    def close(self) -> None:
        """Stops the thread (a window it is fetching is dropped)."""
        self.stopping.set()
        self.thread.join()


def peak_memory_gib(device: torch.device) -> float:
    """The most memory this process has held so far, GiB: on a GPU its tensors (torch's allocator), elsewhere the
    process's peak resident size (a CPU run's tensors and all the rest)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class Meter:
    """Averages of training statistics between two log lines, and throughput."""

    def __init__(self):
        self.start, self.loss, self.nll, self.tokens, self.steps = time.perf_counter(), 0.0, 0.0, 0, 0

    def add(self, stats: StepStats) -> None:
        self.loss += stats.loss * stats.tokens
        self.nll += stats.nll * stats.tokens
        self.tokens += stats.tokens
        self.steps += 1

    def flush(self) -> dict:
        elapsed = time.perf_counter() - self.start
        n = max(self.tokens, 1)
        out = {"loss": self.loss / n, "nll": self.nll / n, "ppl": math.exp(min(self.nll / n, 50)),
               "tokens_per_s": self.tokens / max(elapsed, 1e-9), "steps_per_s": self.steps / max(elapsed, 1e-9)}
        self.__init__()
        return out


class Session:
    """The wall time of this session's training steps, their data loading included, validation and checkpoints
    not (TRAIN_SHARE leaves them their share): the real speed the plan is re-timed with, once, after RETIME_STEPS
    steps."""

    RETIME_STEPS = 50  # steps timed (after the first, which warms up), fewer for a short plan

    def __init__(self):
        self.seconds, self.steps = 0.0, 0
        self.validation_s: float | None = None  # the latest validation that decoded: what the next will take

    def validated(self, seconds: float) -> None:
        self.validation_s = seconds  # the first includes decoding's warm-up; later ones are the better guess

    def stepped(self, seconds: float) -> None:
        self.steps += 1
        if self.steps > 1:  # the first step warms up allocator and kernels
            self.seconds += seconds

    def seconds_per_step(self) -> float:
        return self.seconds / max(self.steps - 1, 1)

    def due(self, step: int, run: Run) -> bool:
        """Re-time now: under a time budget, once enough steps are timed, and again once a validation that decoded
        is (each at most once in a run, a resumed one included)."""
        plan = run.plan
        if run.cfg.max_minutes is None or plan is None or not plan.minutes or self.steps < 2:
            return False
        if plan.retimed is None:
            return self.steps - 1 >= max(5, min(self.RETIME_STEPS, (plan.steps or 0) // 20))
        return plan.retimed.get("validation_s") is None and self.validation_s is not None


def note_finite(run: Run, finite: bool) -> None:
    """Count skipped (non-finite) steps; too many in a row stop training with a checkpoint and a message."""
    state = run.state
    if finite:
        state.bad_in_row = 0
        return
    state.skipped_steps += 1
    state.bad_in_row += 1
    log.warning(f"step {state.step}: non-finite loss or gradient, update skipped "
                f"({state.skipped_steps} so far, {state.bad_in_row} in a row)", main_process_only=True)
    if state.bad_in_row >= run.cfg.max_bad_steps:
        save_checkpoint(run)
        raise NmtError(f"stopped at step {state.step}: {state.bad_in_row} steps in a row had a non-finite loss or "
                       f"gradient (the weights are those of the last good step, saved in "
                       f"{ckpt.checkpoints_dir(run.out)}); lower optim.lr, check the data, or use bf16 "
                       "instead of fp16")


def note_out_of_memory(run: Run, processes: int) -> None:
    """Count steps skipped because a micro-batch ran out of memory (on `processes` processes); too many in a row
    stop training with a checkpoint and a message naming max_tokens."""
    state = run.state
    if not processes:
        state.oom_in_row = 0
        return
    state.oom_steps += 1
    state.oom_in_row += 1
    log.warning(f"step {state.step}: out of memory on {processes} of {run.accelerator.num_processes} processes, "
                f"update skipped on every process ({state.oom_steps} so far, {state.oom_in_row} in a row)",
                main_process_only=True)
    if state.oom_in_row >= run.cfg.max_bad_steps:
        save_checkpoint(run)
        raise NmtError(f"stopped at step {state.step}: {state.oom_in_row} steps in a row ran out of memory (the "
                       f"weights of the last step that fitted are saved in {ckpt.checkpoints_dir(run.out)}); lower "
                       f"max_tokens (now {run.cfg.max_tokens:,} padded tokens a micro-batch) and raise accum_steps "
                       f"(now {run.cfg.accum_steps}) to keep the batch, then resume")


# --- one optimizer step -----------------------------------------------------------------------------------------


def make_objective(model: torch.nn.Module, cfg: TrainConfig, flat_state_dict: bool = True,
                   compile_now: bool = True) -> Seq2SeqLoss:
    """The training objective of `model`: `Seq2SeqLoss`, compiled whole (`fullgraph`) when `cfg.compile` says so
    (here, or by the caller once DDP wraps it: `compile_now` False), else through the fused cross-entropy of
    `nmt.kernels` on every device (docs/results.md: faster on a CPU, and a third of the plain loss's peak memory
    over fp32 logits, two thirds over bf16 ones: `benchmarks/memory.py --loss`).
    (A CPU variant that projected and scored only the real target positions was measured on Tatoeba's bucketed
    batches, 2.8% padding: +4% in fp32, -3% in bf16, within the runs' spread; it is gone.)"""
    objective = Seq2SeqLoss(model, cfg.optim.label_smoothing, flat_state_dict=flat_state_dict)
    if cfg.compile:
        if compile_now:  # in place: the module keeps its type, state_dict keys and save/load
            # dynamic from the first call: batches change shape every step, so a first graph for one shape would be
            # compiled only to be replaced by a dynamic one at the second (the same steady state, one compile less)
            objective.compile(fullgraph=True, dynamic=True)
    else:
        use_fused_loss(objective)
    return objective


@dataclass
class StepStats:
    """What one optimizer step reports; loss and nll are per real target token over all processes."""

    loss: float
    nll: float
    tokens: int  # real target tokens of the step, all processes
    grad_norm: float | None
    finite: bool  # False: the loss or gradient was not finite and no update was made
    stop: bool  # some process asked to stop after this step
    out_of_memory: int = 0  # processes whose micro-batch ran out of memory (no update was made)


def train_step(accelerator, objective, optim: Optim, window: list[dict], stop: bool = False) -> StepStats:
    """One optimizer step of `objective` (a `Seq2SeqLoss`, prepared or not) over this process's micro-batches
    `window`, read top to bottom: the step's token count, each micro-batch's forward and backward, the clipped
    gradient and the step's figures, the update.

    Each micro-batch's summed loss is divided by the target tokens of the whole step on all processes;
    DDP's mean over processes and accelerate's division by accum_steps are undone by the factor, so
    the gradient equals the one-process, no-accumulation gradient of the same global batch.
    A step whose gradient is not finite makes no update (under fp16 the loss scaler skips it and
    lowers its scale). `stop` (this process wants to stop) is shared with all processes.
    A micro-batch that runs out of memory on any process makes no update on every process (`_out_of_memory`).

    The micro-batches never read the device from the host (a GPU would wait for it each time): token counts and
    loss sums stay tensors, and the step's figures are read once, with the gradient norm, before the update.
    """
    objective.train()
    warn_if_bf16_is_slow(accelerator.device.type, str(accelerator.mixed_precision),
                         getattr(accelerator, "is_main_process", True))
    pad_id, device = _pad_id(accelerator, objective), accelerator.device

    # the step's real target tokens on all processes, which every micro-batch's loss is divided by
    local = torch.stack([b["labels"].ne(pad_id).sum() for b in window]).sum().to(device)
    n_tokens = accelerator.reduce(local, "sum")
    scale = accelerator.num_processes * len(window) / n_tokens.clamp(min=1)
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, nll, stop, OOMs: made there, not copied there
    if stop:
        sums[2] = 1.0  # a fill on the device: no copy from host memory, which a GPU's host would wait for

    # forward and backward of each micro-batch; the last one's backward all-reduces the gradients (DDP)
    failed = None
    for batch in window:
        with accelerator.accumulate(objective):
            if failed is None:
                try:
                    out = objective(batch["src_ids"], batch["tgt_in_ids"], batch["labels"])
                    accelerator.backward(out.loss * scale)
                    sums[:2] += torch.stack([out.loss.detach(), out.nll]).double()
                except torch.OutOfMemoryError:
                    failed = batch
                if failed is not None:  # outside the handler: its traceback held the step's tensors
                    out = None
                    _out_of_memory(accelerator, objective, failed, pad_id)
                    sums[3] = 1.0
            if failed is not None and accelerator.sync_gradients and accelerator.num_processes > 1:
                _rejoin(accelerator, objective, failed, pad_id)

    # clip, and read the step's figures with the gradient norm: the step's one read of the device
    grad_norm = accelerator.clip_grad_norm_(objective.parameters(), optim.clip_norm or math.inf)
    totals = accelerator.reduce(sums, "sum")
    norm = torch.full((), math.nan, device=totals.device) if grad_norm is None else grad_norm.detach()
    loss, nll, stopping, ooms, tokens, norm = torch.cat(
        [totals, n_tokens.reshape(1).double(), norm.reshape(1).double()]).tolist()
    finite = grad_norm is None or math.isfinite(norm)  # the same on every process

    # the update: none where a micro-batch ran out of memory on any process (the gradient is not the batch's)
    if ooms:
        if accelerator.scaler is not None:  # clipping unscaled the gradients: the scaler expects an update
            accelerator.scaler.update(new_scale=accelerator.scaler.get_scale())  # its scale kept
        finite = True
    elif finite or accelerator.scaler is not None:  # fp16's scaler skips a step that is not finite itself
        optim.optimizer.step()
        optim.scheduler.step()
        finite = finite and not getattr(optim.optimizer, "step_was_skipped", False)
    optim.optimizer.zero_grad(set_to_none=True)
    tokens = int(tokens)
    return StepStats(loss=loss / max(tokens, 1), nll=nll / max(tokens, 1), tokens=tokens,
                     grad_norm=None if grad_norm is None or ooms else norm, finite=finite, stop=stopping > 0,
                     out_of_memory=int(ooms))


def _out_of_memory(accelerator, objective, batch: dict, pad_id: int) -> None:
    """This process's micro-batch `batch` ran out of memory: said with its size, its gradient dropped and the
    device's cached blocks released. The rest of the window is skipped, and the flag in the step's sums makes
    every process skip the update."""
    _drop_gradients(objective)
    if (backend := getattr(torch, accelerator.device.type, None)) is not None and hasattr(backend, "empty_cache"):
        backend.empty_cache()
    rank = getattr(accelerator, "process_index", 0)
    plain_log.warning(f"process {rank}: out of memory in a micro-batch of {_size(batch, pad_id)}; "
                      "this step makes no update on any process")


def _drop_gradients(objective) -> None:
    for p in objective.parameters():
        p.grad = None


def _size(batch: dict, pad_id: int) -> str:
    src, tgt = batch["src_ids"], batch["labels"]
    return (f"{src.shape[0]} sentences, {int(src.ne(pad_id).sum()) + int(tgt.ne(pad_id).sum()):,} tokens "
            f"(padded {src.shape[0]}x{src.shape[1]} source, {tgt.shape[0]}x{tgt.shape[1]} target)")


def _rejoin(accelerator, objective, batch: dict, pad_id: int) -> None:
    """Under DDP the window's last backward all-reduces the gradients: a process whose micro-batch ran out of
    memory runs it again on one sentence's first two tokens, weighted zero, so that its all-reduce meets the
    others' and the run goes on. Once some of its gradients were done before the error, DDP has begun sharing
    them and cannot take that back: the process then stops, naming the fix (under a launcher the others are then
    stopped; on their own they fail at their next collective)."""
    tiny = {k: batch[k][:1, :2] for k in ("src_ids", "tgt_in_ids", "labels")}
    ddp = getattr(objective, "_orig_mod", objective)  # torch.compile(DDP(objective)) under compile: true
    if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        ddp.require_forward_param_sync = False  # its buffers were broadcast before the failed pass: not twice
    try:
        out = objective(tiny["src_ids"], tiny["tgt_in_ids"], tiny["labels"])
        accelerator.backward(out.loss * 0.0)
    except RuntimeError as e:  # torch.OutOfMemoryError too
        raise NmtError(f"process {accelerator.process_index} ran out of memory in the backward of a micro-batch of "
                       f"{_size(batch, pad_id)} after its gradients began to be shared with the other processes, "
                       f"and cannot rejoin them ({type(e).__name__}); lower max_tokens (the padded tokens of a "
                       "micro-batch), or raise accum_steps to keep the batch") from None
    _drop_gradients(objective)


def _pad_id(accelerator, objective) -> int:
    # keep_torch_compile=False: accelerate's default re-points a compiled wrapper at the module it unwrapped,
    # which would take DDP out of torch.compile(DDP(objective)) for the rest of the run
    unwrap = getattr(accelerator, "unwrap_model", None)
    return (unwrap(objective, keep_torch_compile=False) if unwrap else objective).pad_id


# --- the optimizer and its schedule -------------------------------------------------------------------------------


class Schedule:
    """The learning-rate factor per step (warmup, then `inverse_sqrt` or `linear` decay) of the schedule settings
    in force: a re-timed plan moves them (`follow`), and a resumed run builds it from the plan it saved, so the
    factor at each step is the one the run had."""

    def __init__(self, o: OptimConfig):
        self.follow(o)

    def follow(self, o: OptimConfig) -> None:
        """From now on, the schedule that optimizer settings `o` describe (their warmup and decay steps)."""
        if o.schedule == "linear":
            if o.decay_steps is None:
                raise ValueError("optim.schedule linear needs optim.decay_steps")
            self.factor = linear_decay(o.warmup_steps, o.decay_steps)
        else:
            self.factor = inverse_sqrt(o.warmup_steps)

    def __call__(self, step: int) -> float:
        return self.factor(step)


@dataclass
class Optim:
    """The optimizer, its schedule and the clipping threshold a step applies."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler  # steps the optimizer's rate by `schedule`
    schedule: Schedule
    clip_norm: float | None = None


def make_optim(model: torch.nn.Module, cfg: TrainConfig) -> Optim:
    """AdamW with the config's warmup and schedule and clipping, as training steps it."""
    optimizer, schedule = make_optimizer(model, cfg), Schedule(cfg.optim)
    # a lambda, not the Schedule: LambdaLR would write a callable object's fields into the checkpoint
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step))
    return Optim(optimizer, scheduler, schedule, cfg.optim.clip_norm)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (frozen ones, `finetune`, are left out: no update, no weight decay);
    the fused kernel where this torch has one for the device."""
    o = cfg.optim
    kwargs = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    if all(p.device.type in fused_devices() for p in params):
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except (RuntimeError, TypeError):
            pass
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


# --- the device and precision of a step ------------------------------------------------------------------------


def default_device(device: str | None = None) -> torch.device:
    """`device`, by default the first GPU, else the CPU: where the plan's timing and `nmt check`'s probe run."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def run_precision(cfg: TrainConfig, device_type: str) -> tuple[str, str | None]:
    """The mixed precision a run on `device_type` trains in, and why when nmt chose it (`nmt.plan.precision_for`,
    the rule, given what the launcher and the device say)."""
    return precision_for(cfg.max_minutes, launched_precision(), native_bf16(device_type), gpu=device_type == "cuda")


def launched_precision() -> str | None:
    """The mixed precision the launcher chose (`accelerate launch`, a profile, ACCELERATE_MIXED_PRECISION); None:
    none chosen, nmt chooses (`run_precision`)."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() or None


def native_bf16(device_type: str) -> bool:
    """Whether `device_type` multiplies bf16 in hardware: a GPU with bf16 units (Ampere and later; torch emulates
    bf16 on older ones, which does not count), or a CPU with oneDNN's bf16 kernels (AVX512-BF16 or AMX)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return device_type == "cpu" and mkldnn_bf16_supported()


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


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """What Accelerate wraps a prepared model's forward in, for `OneDevice` steps (the plan's and check's timing)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


@functools.cache
def warn_if_bf16_is_slow(device_type: str, mixed_precision: str, main: bool = True) -> None:
    """Once per process: bf16 autocast on a CPU without bf16 matmul kernels (oneDNN's need AVX512 or AMX;
    otherwise torch multiplies bf16 in a plain loop, 1-2 GFLOP/s against ~30 in fp32 on one AVX2 core)."""
    if main and device_type == "cpu" and mixed_precision == "bf16" and not mkldnn_bf16_supported():
        plain_log.warning("mixed_precision bf16 on a CPU without bf16 matmul units (no AVX512/AMX): training runs "
                    "~15x slower than in fp32; use an fp32 profile (accelerate_configs/cpu.yaml)")


# --- the progress report ----------------------------------------------------------------------------------------


class Progress:
    """Steps done of the run's (budget-aware) total, elapsed and ETA, and the loop's latest figures.

    On a terminal: one live tqdm line, `train: 40%|...| 200/500 [01:10<01:45, 2.9step/s, epoch=3, loss=3.412,
    lr=1.2e-03, tok/s=14210]`. Elsewhere: `train: step 200/500 (40%) [01:10<01:45] epoch=3 loss=3.412
    lr=1.2e-03 tok/s=14210`, every `every` steps and at the last one, so log files stay readable.
    Other processes than the main one are silent.
    """

    def __init__(self, accelerator, total: int, initial: int, max_minutes: float | None, every: int,
                 live: bool | None = None):
        self.total, self.initial, self.max_minutes, self.every = total, initial, max_minutes, every
        self.started = time.monotonic()
        self.main = accelerator.is_main_process
        self.live = stderr_is_terminal() if live is None else live
        self.bar = None
        if self.live:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, disable=not self.main, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def update(self, step: int, postfix: dict) -> None:
        """Step `step` is done; `postfix` holds its figures (epoch, loss, lr, tok/s)."""
        elapsed = time.monotonic() - self.started
        expected = budget_total(self.total, step, step - self.initial, elapsed, self.max_minutes)
        if self.bar is not None:
            self.bar.total = expected
            # refresh=False: the line is redrawn by update() at most every 0.1 s, not on every step
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif self.main and (step % self.every == 0 or step >= expected):
            print(self.line(step, expected, elapsed, postfix), file=sys.stderr, flush=True)

    def line(self, step: int, expected: int, elapsed: float, postfix: dict) -> str:
        from tqdm import tqdm

        done = step - self.initial
        eta = (expected - step) * elapsed / done if done > 0 else float("nan")
        if self.max_minutes is not None:
            eta = min(eta, max(60 * self.max_minutes - elapsed, 0.0)) if done > 0 else 60 * self.max_minutes
        shown = tqdm.format_interval(eta) if eta == eta else "?"
        figures = " ".join(f"{k}={v}" for k, v in postfix.items())
        return (f"train: step {step}/{expected} ({step / max(expected, 1):.0%}) "
                f"[{tqdm.format_interval(elapsed)}<{shown}] {figures}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class TokenRate:
    """Target tokens per second of the training steps themselves (validation and checkpoints not counted),
    smoothed exponentially as tqdm smooths its own rate."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing, self.value = smoothing, None

    def update(self, tokens: int, seconds: float) -> str:
        now = tokens / max(seconds, 1e-9)
        self.value = now if self.value is None else self.smoothing * now + (1 - self.smoothing) * self.value
        return f"{self.value:.0f}"


def budget_total(total: int, step: int, done: int, elapsed_s: float, max_minutes: float | None) -> int:
    """The step count the run will reach: `total`, or fewer when the time budget ends it first.

    `done` steps of this session took `elapsed_s` seconds (validation and checkpoints included: they spend the
    budget too); the steps left in the budget are projected at that rate. Before a step is done the rate is
    unknown and `total` stands.
    """
    if max_minutes is None or done < 1 or elapsed_s <= 0:
        return total
    left_s = max(60 * max_minutes - elapsed_s, 0.0)
    return min(total, step + int(left_s * done / elapsed_s))


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()
