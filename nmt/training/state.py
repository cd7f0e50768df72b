"""What a run carries from job to job: `TrainState` (saved in checkpoints), `Run` (the run's context) and
`TrainResult` (what `train` returns)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nmt.model import unwrap_objective

if TYPE_CHECKING:
    from nmt.config import TrainConfig
    from nmt.data import Corpus
    from nmt.plan import Plan


@dataclass
class TrainState:
    """What the loop itself must remember across a resume, stored as JSON beside Accelerate's state.

    Not `register_for_checkpointing`: Accelerate unpickles custom objects with weights_only=False,
    so a tampered checkpoint could run code on resume. JSON cannot.
    """

    step: int = 0
    best_score: float = -math.inf  # validation BLEU, or minus the validation loss for models without search
    best_step: int = -1
    evals_since_best: int = 0  # for early stopping
    tokens_seen: int = 0
    skipped_steps: int = 0  # steps whose loss or gradient was not finite (no update made)
    bad_in_row: int = 0
    elapsed_s: float = 0.0  # wall-clock seconds of the run so far (its time budget), resumes included
    sampler: dict = field(default_factory=dict)  # TokenBatchSampler.state_dict(): epoch and position


@dataclass
class Run:
    """One training run's context, handed to every job instead of long argument lists."""

    accelerator: object  # accelerate.Accelerator
    cfg: TrainConfig
    corpus: Corpus
    objective: object  # the prepared Seq2SeqLoss (wrapped by DDP/FSDP on several processes)
    state: TrainState = field(default_factory=TrainState)
    plan: Plan | None = None  # what nmt chose for the run (nmt.plan), re-timed once under a time budget
    started: float = field(default_factory=time.monotonic)  # time.monotonic() when the run's clock started
    stop_reason: str = ""  # why training ended, for the summary (set by the loop)
    epochs: float = 0.0  # epochs trained when training ended (set by the loop)
    # a stop signal arrived: validation gives up between two batches (set by the loop)
    stop_requested: Callable[[], bool] = field(default=lambda: False, repr=False)

    def elapsed(self) -> float:
        """Seconds of the run's time budget spent (before a resume too)."""
        return time.monotonic() - self.started

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def model(self):
        """The plain model (no DDP/FSDP/compile wrapper, no objective): what search and saving use."""
        return unwrap_objective(self.accelerator.unwrap_model(self.objective))

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process


@dataclass
class TrainResult:
    model_dir: Path | None  # the final model: config.json, model.safetensors, tokenizer.json, training.json
    steps: int
    best: dict = field(default_factory=dict)  # validation metrics of the kept model
    stopped_by: str | None = None  # "SIGTERM"/"SIGINT" when a signal ended the run early (no final model)
    checkpoint: Path | None = None  # the last checkpoint written
    minutes: float | None = None  # wall-clock minutes the run spent of its budget
    max_minutes: float | None = None  # the time budget
    stop_reason: str = ""  # why training ended
    epochs: float | None = None  # epochs trained
    test: dict = field(default_factory=dict)  # the final model on the test set (beam 4): bleu, chrf, pairs
    commands: list[str] = field(default_factory=list)  # how to translate and evaluate with the model

    def summary(self) -> str:
        """What the user has, for the terminal."""
        if self.stopped_by:
            return (f"stopped by {self.stopped_by} after step {self.steps}; checkpoint {self.checkpoint}. "
                    "Resume: run the same command with --resume latest (or auto; without --overwrite)")
        digits = 2 if (self.max_minutes or self.minutes) < 1 else 1  # a budget under a minute needs hundredths
        used = f"{self.minutes:.{digits}f}" + (f" of {self.max_minutes:g}" if self.max_minutes else "")
        lines = [f"nmt: trained {self.steps:,} steps" + (f" ({self.epochs:.1f} epochs)" if self.epochs else "") +
                 f" in {used} minutes; stopped: {self.stop_reason or 'done'}"]
        valid = ", ".join(f"{k} {self.best[k]:.2f}" for k in ("bleu", "chrf", "valid_nll") if
                          isinstance(self.best.get(k), float))
        if valid:
            lines.append(f"  best validation: {valid}" + (f" (step {self.best['step']:,})" if "step" in self.best else ""))
        lines.append(f"  model: {self.model_dir}")
        if self.test:
            lines.append(f"  test (beam 4, {self.test['pairs']:,} pairs): BLEU {self.test['bleu']:.2f}, "
                         f"chrF {self.test['chrf']:.2f}")
        lines += [f"  {c}" for c in self.commands]
        return "\n".join(lines)
