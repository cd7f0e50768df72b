"""What a run carries from job to job: `TrainState` (saved in checkpoints), `Run` (the run's context) and
`TrainResult` (what `train` returns)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nmt.objective import unwrap_objective

if TYPE_CHECKING:
    from nmt.config import TrainConfig
    from nmt.data import Corpus


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
    sampler: dict = field(default_factory=dict)  # TokenBatchSampler.state_dict(): epoch and position


@dataclass
class Run:
    """One training run's context, handed to every job instead of long argument lists."""

    accelerator: object  # accelerate.Accelerator
    cfg: TrainConfig
    corpus: Corpus
    objective: object  # the prepared Seq2SeqLoss (wrapped by DDP/FSDP on several processes)
    state: TrainState = field(default_factory=TrainState)
    # a stop signal arrived: validation gives up between two batches (set by the loop)
    stop_requested: Callable[[], bool] = field(default=lambda: False, repr=False)

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def model(self):
        """The plain model (no DDP/FSDP/compile wrapper, no objective): what search and saving use."""
        return unwrap_objective(self.accelerator.unwrap_model(self.objective))

    @property
    def pad_id(self) -> int:
        return self.accelerator.unwrap_model(self.objective).pad_id

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

    def summary(self) -> str:
        """One line for the terminal."""
        if self.stopped_by:
            return (f"stopped by {self.stopped_by} after step {self.steps}; checkpoint {self.checkpoint}. "
                    "Resume: run the same command with --resume latest (or auto; without --overwrite)")
        best = ", ".join(f"{k} {v:.2f}" for k, v in self.best.items() if isinstance(v, float))
        return f"model saved to {self.model_dir} after {self.steps} steps; best validation: {best}"
