"""nmt: neural machine translation on Hugging Face Accelerate, from one CPU to many GPUs.

The public API: configs, the model, training and translation. Everything else is internal.
"""

from nmt.config import DataConfig, ModelConfig, OptimConfig, TokenizerConfig, TrainConfig, load_config
from nmt.errors import NmtError
from nmt.launch import launch
from nmt.model import Seq2SeqTransformer
from nmt.sampling import SamplingConfig
from nmt.search import SearchConfig
from nmt.train import TrainResult, train
from nmt.translate import Translator

__all__ = [
    "DataConfig", "ModelConfig", "NmtError", "OptimConfig", "SamplingConfig", "SearchConfig",
    "Seq2SeqTransformer", "TokenizerConfig",
    "TrainConfig", "TrainResult", "Translator", "launch", "load_config", "train",
]
__version__ = "0.1.0"
