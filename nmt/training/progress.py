"""The main process's progress report: a live tqdm line on a terminal, one plain line every `log_every` steps
otherwise (SLURM logs, nohup, a pipe), with the total and ETA taken from the time budget when there is one."""

from __future__ import annotations

import sys
import time


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


class TokenRate:
    """Target tokens per second of the training steps themselves (validation and checkpoints not counted),
    smoothed exponentially as tqdm smooths its own rate."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing, self.value = smoothing, None

    def update(self, tokens: int, seconds: float) -> str:
        now = tokens / max(seconds, 1e-9)
        self.value = now if self.value is None else self.smoothing * now + (1 - self.smoothing) * self.value
        return f"{self.value:.0f}"


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
