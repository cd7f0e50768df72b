"""The training loop: steps until done, with accumulation windows, stop signals, a time budget, early
stopping, the progress line, and when to log, validate and checkpoint."""

from __future__ import annotations

import math
import os
import signal
import sys
import time

from accelerate.logging import get_logger

from nmt import checkpoint as ckpt
from nmt.compat import release_free_memory
from nmt.config import save_yaml
from nmt.errors import NmtError
from nmt.plan import TRAIN_SHARE, retime, retime_line
from nmt.training import step
from nmt.training.evaluation import bleu_due, evaluate_and_keep_best
from nmt.training.progress import Progress, TokenRate
from nmt.training.state import Run, log_metrics, save_checkpoint, save_plan
from nmt.training.step import Optim, StepStats

log = get_logger(__name__)
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


def micro_batches(loader):
    """Endless micro-batches; each pass over the loader finishes an epoch (the sampler advances it)."""
    while True:
        yield from loader


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


class Loop:
    """Trains `run` until a step limit, a stop signal, the time budget or patience ends it."""

    def __init__(self, run: Run, optim: Optim, loader, sampler):
        self.run, self.optim, self.loader, self.sampler = run, optim, loader, sampler
        self.total, self.limit = step_limit(run, sampler)
        self.meter, self.rate = Meter(), TokenRate()
        self.stopped_by: str | None = None
        self.session = Session()  # this process's steps, for re-timing the plan

    @property
    def expected(self) -> int:
        """The steps the progress bar counts to: the step limit, else the plan's estimate for the budget."""
        planned = self.run.plan.steps if self.run.plan and self.run.plan.steps else self.run.state.step + 1
        return self.total if self.total is not None else planned

    def __call__(self, signals: StopSignals) -> str | None:
        """Returns why it stopped early ("SIGTERM", "SIGINT", "time", "patience"), or None (a step limit)."""
        batches, state = micro_batches(self.loader), self.run.state
        bar = Progress(self.run.accelerator, self.expected, state.step, self.budget_left_minutes(),
                       self.run.cfg.log_every)
        self.run.stop_requested = lambda: signals.received is not None
        try:
            while (self.total is None or state.step < self.total) and self.stopped_by is None:
                self.one_step(batches, signals, bar)
                self.after_step(signals)
                if self.session.due(state.step, self.run):
                    self.retime(bar)
        finally:
            self.run.stop_requested = lambda: False
            bar.close()
        self.run.stop_reason = self.reason()
        self.run.epochs = self.sampler.epoch + self.sampler.step_in_epoch / self.sampler.steps_per_epoch()
        return self.stopped_by

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
        """The plan's steps again at the speed of this run's own steps (all processes agree: the main
        process's figure is shared), saved so that a resume continues the same plan."""
        from accelerate.utils import broadcast_object_list

        run = self.run
        box = [(self.session.seconds_per_step(), run.elapsed(), self.session.validation_s)]
        if run.accelerator.num_processes > 1:
            broadcast_object_list(box)  # every process then plans the same cadence
        planned_s = None
        if run.plan.steps and run.plan.minutes:
            planned_s = 60 * run.plan.minutes * TRAIN_SHARE / run.plan.steps
        run.cfg, run.plan = retime(run.cfg, run.plan, run.state.step, *box[0])
        step.set_schedule(self.optim, run.cfg)
        self.total, self.limit = step_limit(run, self.sampler)
        bar.total = self.expected
        if run.is_main:
            print(retime_line(run.plan, planned_s), file=sys.stderr, flush=True)
            save_plan(run.plan, run.out)
            save_yaml(run.cfg, run.out / "config.yaml")

    def one_step(self, batches, signals: StopSignals, bar: Progress) -> None:
        run, state, cfg = self.run, self.run.state, self.run.cfg
        step_start = time.perf_counter()
        window = [to_device(next(batches), run.accelerator.device) for _ in range(cfg.accum_steps)]
        out_of_time = self.out_of_time()
        stop = bool(signals.received) or out_of_time
        stats = step.train_step(run.accelerator, run.objective, self.optim, window, stop=stop)  # as nmt check times it
        state.step += 1
        state.tokens_seen += stats.tokens
        state.sampler = self.sampler.state_dict()
        state.elapsed_s = run.elapsed()
        self.session.stepped(time.perf_counter() - step_start)
        note_finite(run, stats.finite)
        self.meter.add(stats)
        bar.update(state.step, {"epoch": self.sampler.epoch, "loss": f"{stats.loss:.3f}", "lr": f"{self.lr:.2e}",
                                "tok/s": self.rate.update(stats.tokens, time.perf_counter() - step_start)})
        if stats.stop:  # any process was signalled or is out of time: all stop after this same step
            self.stopped_by = signals.received or ("time" if out_of_time else "SIGTERM")

    @property
    def lr(self) -> float:
        return self.optim.scheduler.get_last_lr()[0]

    def after_step(self, signals: StopSignals) -> None:
        """Log, validate (and stop early on patience) and checkpoint, as the step number says."""
        run, state, cfg = self.run, self.run.state, self.run.cfg
        last = state.step == self.total or self.stopped_by == "time"
        if state.step % cfg.log_every == 0 or last:
            log_metrics(run, {**self.meter.flush(), "lr": self.lr, "epoch": self.sampler.epoch,
                              "skipped_steps": state.skipped_steps})
        if (state.step % cfg.eval_every == 0 or last) and self.stopped_by in (None, "time"):
            started, decodes = time.perf_counter(), bleu_due(cfg, state.step) or last  # the last one always scores
            kept = evaluate_and_keep_best(run, decodes)
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


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
