"""nmt: neural machine translation on Hugging Face Accelerate, from one CPU to many GPUs.

The public API: configs, the model, training and translation. Everything else is internal.
Each public name is imported from its module on first use (PEP 562), so `import nmt`, `nmt --help` and
`nmt info` do not pay for torch, Accelerate or datasets.
"""

import importlib
import sys
import types

_HOMES = {  # public name -> the module that defines it
    "DataConfig": "nmt.config", "FinetuneConfig": "nmt.config", "ModelConfig": "nmt.config", "OptimConfig": "nmt.config",
    "TokenizerConfig": "nmt.config", "TrainConfig": "nmt.config", "load_config": "nmt.config",
    "NmtError": "nmt.errors", "SamplingConfig": "nmt.decoding", "launch": "nmt.launch",
    "Seq2SeqTransformer": "nmt.model", "open_model": "nmt.loading", "SearchConfig": "nmt.decoding",
    "TrainResult": "nmt.train", "train": "nmt.train", "Translator": "nmt.translate", "Translation": "nmt.translate",
}
__all__ = sorted(_HOMES)
__version__ = "0.1.0"


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'nmt' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later uses find it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


class _Package(types.ModuleType):
    """`nmt.train` and `nmt.launch` are the functions, although modules of those names exist: importing such a
    module makes the import system set it as the package's attribute, which must not hide the function."""

    def __setattr__(self, name: str, value) -> None:
        if name in ("train", "launch") and isinstance(value, types.ModuleType):
            return  # sys.modules["nmt.train"] still holds the module; `nmt.train` resolves to the function
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
