"""`nmt.train`: the public entry to training. `train(cfg)` lives in `nmt.training.run`, `TrainResult` and
`TrainState` in `nmt.training.state`; the loop in `nmt.training.loop`, validation in `nmt.training.evaluation`."""

from nmt.training.run import train
from nmt.training.state import TrainResult, TrainState

__all__ = ["TrainResult", "TrainState", "train"]
