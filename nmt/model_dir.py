"""The files of a model directory, named once, and reading its JSON with named errors (no torch needed).

A model directory (output_dir/model, output_dir/best, `nmt average -o DIR`) holds config.json (the ModelConfig),
model.safetensors (the weights), the tokenizer JSON, and when training wrote them training.json (what the run was and
scored) and search.json (the tuned alpha); a LoRA run's also its adapter's two files. This module imports neither
torch nor tokenizers, so `nmt info` and the path checks of nmt.validate can name these files cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path

from nmt.config import ModelConfig, from_dict
from nmt.errors import NmtError

CONFIG_FILE = "config.json"  # the ModelConfig as JSON
WEIGHTS_FILE = "model.safetensors"  # the weights (a shared embedding stored once)
SUMMARY_FILE = "training.json"  # step, best validation metrics, data, command line of the run
SEARCH_FILE = "search.json"  # the alpha tuned on validation by training's tune_alpha
LANGUAGES_FILE = "languages.json"  # a multilingual model's language pairs and the target languages one may ask for
JOINT_FILE = "tokenizer.json"  # one tokenizer for both languages
SRC_FILE, TGT_FILE = "tokenizer.src.json", "tokenizer.tgt.json"  # separate vocabularies
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA run's adapter: peft's LoraConfig (nmt.adapters)
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the LoRA matrices; model.safetensors holds the base weights


def read_json(path: Path) -> dict:
    """A JSON object from `path`; a file that is not one is an NmtError naming it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NmtError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise NmtError(f"{path}: expected a JSON object")
    return data


def languages_record(pairs: list[str], targets: list[str], tags: list[str]) -> dict:
    """What languages.json holds: the pairs trained ("en-de"), the target languages, and their source-side tags."""
    return {"pairs": pairs, "target_languages": targets, "tags": dict(zip(targets, tags)) if tags else {}}


def read_languages(directory: str | Path) -> dict | None:
    """A model directory's languages.json (`languages_record`), or None where training wrote none."""
    path = Path(directory) / LANGUAGES_FILE
    return read_json(path) if path.is_file() else None


def load_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a model directory (its config.json), checked like any config."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise NmtError(f"{path}: missing; {directory} is not an nmt model directory (give output_dir/model)")
    try:
        return from_dict(ModelConfig, read_json(path), "model")
    except NmtError as e:
        raise NmtError(f"{path}: {e}") from None
