"""`nmt.train`: the public entry to training. `train(cfg)` and `TrainResult` live in `nmt.training.run`
and `nmt.training.state`; the jobs of a run in the other modules of `nmt.training`."""

from nmt.training.run import train
from nmt.training.state import TrainResult, TrainState

__all__ = ["TrainResult", "TrainState", "train"]
