"""Opening a model directory: the one loader, and the two commands that write a model directory from others.

`open_model(directory)` is how every part of nmt opens a model directory (plain, LoRA adapter, averaged, imported
from transformers): `Translator.from_pretrained`, fine-tuning's `init_from`, validation's reload, both exports,
`nmt average` and `nmt merge-adapter`. It reads JSON and safetensors only, so no code in a directory ever runs,
and it checks what it reads before it allocates: the config against the weights' header (the sizes the weights
fix, a bounded position table), every tensor's name, shape and dtype against the model the config builds, an
adapter's settings against what nmt's training writes (`nmt.adapters.adapter_settings`). The tokenizer, the tuned
search defaults and the languages are read when asked for (`ModelDirectory`), so a directory of weights alone
opens too.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from nmt.adapters import has_adapter, load_adapter, save_adapted
from nmt.checkpoint import (
    ADAPTER_CONFIG,
    CONFIG_FILE,
    LANGUAGES_FILE,
    SEARCH_FILE,
    SUMMARY_FILE,
    WEIGHTS_FILE,
    average_weights,
    check_output_dir,
    list_checkpoints,
    load_into,
    load_model_config,
    read_languages,
    search_defaults,
    tokenizer_files,
    write_directory,
)
from nmt.config import ModelConfig
from nmt.errors import NmtError
from nmt.model import Seq2SeqTransformer
from nmt.tokenizer import PairTokenizer


@dataclass
class ModelDirectory:
    """An opened model directory: its model (in eval mode only where the caller sets it), and, read on first use,
    its tokenizer (checked to fit the model), the search defaults training tuned, and its languages."""

    path: Path
    model: Seq2SeqTransformer

    @functools.cached_property
    def tokenizer(self) -> PairTokenizer:
        return PairTokenizer.load_for(self.path, self.model.cfg)

    @property
    def search(self) -> dict:
        return search_defaults(self.path)

    @property
    def languages(self) -> dict | None:
        return read_languages(self.path)


def open_model(directory: str | Path, device: str | torch.device = "cpu", cfg: ModelConfig | None = None,
               merge_adapter: bool = True) -> ModelDirectory:
    """The model directory `directory` (what `save_pretrained`, training, `nmt import` and `nmt average` write).

    `cfg` builds the model instead of the directory's config.json (the same sizes, e.g. another dropout).
    The config is checked against the safetensors header before anything of its size is allocated: the
    sizes the weights fix (vocabularies, d_model, layers, d_ff) must be the config's, the position table
    (the one tensor computed, not stored) is bounded, and then every tensor's shape and dtype must be the
    model's. A directory holding a LoRA adapter gets it merged into the weights (`merge_adapter=False`: kept as
    LoRA layers, the model as it trained). The model remembers `pretrained_from` (the directory), so training
    can check its tokenizer.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    source = "the given config" if cfg is not None else str(directory / CONFIG_FILE)
    cfg = cfg or load_model_config(directory)
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        pickled = sorted(p.name for p in directory.glob("pytorch_model*"))
        if pickled:
            raise NmtError(f"{directory}: its weights are a pickle ({pickled[0]}), which nmt never reads (loading one "
                           "can run code); a transformers model: convert it where you trust the file with python -c "
                           "\"import transformers as t; t.AutoModelForSeq2SeqLM.from_pretrained('DIR')"
                           ".save_pretrained('DIR')\" and nmt import DIR OUT; nmt's model directories hold "
                           f"{WEIGHTS_FILE}")
    stored = _stored_tensors(path)
    _check_sizes(cfg, stored, path, source)
    with torch.device(device):
        model = Seq2SeqTransformer(cfg)
    _check_tensors(model, stored, path, source)
    try:
        state = load_file(str(path), device="cpu" if torch.device(device).type == "cpu" else str(device))  # (cpu:0)
    except (SafetensorError, OSError) as e:
        raise NmtError(f"{path}: cannot read the weights ({e}); re-export the model") from None
    if model.src_embed is model.tgt_embed:
        state.setdefault("src_embed.weight", state["tgt_embed.weight"])
    model.load_state_dict(state)  # names and shapes are checked; halves are cast to float32
    if has_adapter(directory):  # (peft is imported only then)
        model = load_adapter(model, directory, merge=merge_adapter)
    model.pretrained_from = str(directory)
    return ModelDirectory(directory, model)


# --- checking a weights file against the model a config builds, from the safetensors header alone -----------

MAX_POSITION_TABLE_BYTES = 1 << 30  # the sinusoidal table: 1 GiB is 262,144 positions at d_model 1024
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors' names of the dtypes a weight may be stored in


def _stored_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of a weights file, read from its header (no tensor data)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise NmtError(f"{path}: cannot read the weights ({e}); re-export the model") from None


def _check_sizes(cfg: ModelConfig, stored: dict, path: Path, source: str) -> None:
    """The config's size fields against what the stored tensors fix, before a model of the config's size is
    built: a config.json that is not the weights' (edited, copied from another model) allocates nothing."""
    if "tgt_embed.weight" not in stored:
        raise NmtError(f"{path}: no tgt_embed.weight; it was not written by nmt (nmt average and training write "
                       "model directories)")
    def shown(key: str) -> str:
        return f"{key} has shape {list(stored[key][0])}"

    (vocab, d_model), key = stored["tgt_embed.weight"][0], "tgt_embed.weight"
    fixed = {"tgt_vocab_size": (vocab, shown(key)), "d_model": (d_model, shown(key))}
    if "src_embed.weight" in stored:
        fixed["src_vocab_size"] = (stored["src_embed.weight"][0][0], shown("src_embed.weight"))
    for side in ("encoder", "decoder"):
        layers = {k.split(".")[1] for k in stored if k.startswith(side + ".")}
        fixed[f"n_{side}_layers"] = (len(layers), f"{side}.0 to {side}.{len(layers) - 1}")
    if "encoder.0.ff.up.weight" in stored:
        fixed["d_ff"] = (stored["encoder.0.ff.up.weight"][0][0], shown("encoder.0.ff.up.weight"))
    for name, (value, evidence) in fixed.items():
        if getattr(cfg, name) != value:
            raise NmtError(f"{source}: model.{name} is {getattr(cfg, name)} but the weights in {path} have {value} "
                           f"({evidence}); copy the config.json saved with these weights")
    table = cfg.max_positions * cfg.d_model * 4
    if table > MAX_POSITION_TABLE_BYTES:
        raise NmtError(f"{source}: max_positions={cfg.max_positions} at d_model={cfg.d_model} asks for a "
                       f"{table / 2**30:.1f} GiB position table (at most {MAX_POSITION_TABLE_BYTES >> 30} GiB); "
                       "copy the config.json saved with these weights")


def _check_tensors(model: Seq2SeqTransformer, stored: dict, path: Path, source: str) -> None:
    """Every tensor of `model` stored, with its shape, as a floating-point type; nothing else stored."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.src_embed is model.tgt_embed and "src_embed.weight" not in stored:
        expected.pop("src_embed.weight")  # shared tensors are stored once
    missing, unexpected = sorted(expected.keys() - stored.keys()), sorted(stored.keys() - expected.keys())
    if missing or unexpected:
        raise NmtError(f"{path}: its tensors are not those of the model {source} describes (missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]}); copy the config.json saved with these weights")
    for key, shape in expected.items():
        file_shape, dtype = stored[key]
        if file_shape != shape:
            raise NmtError(f"{path}: {key} has shape {list(file_shape)} in the file but {list(shape)} in the model "
                           f"{source} describes; copy the config.json saved with these weights")
        if dtype not in FLOAT_DTYPES:
            raise NmtError(f"{path}: {key} is stored as {dtype}, not as floating point; re-export the model")


# --- model directories made from others: nmt average, nmt merge-adapter ------------------------------------------


def average_run(run_dir: str | Path, last: int, out: str | Path, force: bool = False) -> Path:
    """Average the last `last` checkpoints of a run into a new model directory `out`.

    The architecture and tokenizer come from the run's model/ (or best/) directory, and so does the adapter of a
    LoRA run (its checkpoints' base and LoRA weights are averaged, and written as an adapter directory again, which
    `nmt merge-adapter` merges); its search.json is not copied
    (an alpha tuned for other weights). `out` is written as a sibling temporary directory and renamed into place:
    an existing non-empty `out` only with `force`, and never one the average is read from."""

    run_dir, out = Path(run_dir), Path(out)
    found = list_checkpoints(run_dir)[-last:]
    if len(found) < 2:
        raise NmtError(f"{run_dir}: {len(found)} complete checkpoint(s) in checkpoints/; averaging needs 2 or more")
    source = next((d for d in (run_dir / "model", run_dir / "best") if d.is_dir()), None)
    if source is None:
        raise NmtError(f"{run_dir}: no model/ or best/ to take the config and tokenizer from")
    check_output_dir(out, [source, *found], force, "-o")
    adapted = has_adapter(source)  # a LoRA run: its checkpoints hold the base and LoRA layers, averaged as such
    opened = open_model(source, merge_adapter=False)
    load_into(opened.model, average_weights(found))

    def write(tmp: Path) -> None:
        if adapted:  # like the run's model/: the base weights and the averaged adapter
            save_adapted(opened.model, tmp)
        else:
            opened.model.save_pretrained(tmp)
        opened.tokenizer.save(tmp)
        summary = {"averaged": [str(d) for d in found], "from": str(source)}
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        if (source / LANGUAGES_FILE).is_file():  # a multilingual model's target languages and tags
            shutil.copy2(source / LANGUAGES_FILE, tmp / LANGUAGES_FILE)

    return write_directory(out, write)


def merge_adapter_dir(source: str | Path, out: str | Path, force: bool = False) -> Path:
    """A plain model directory `out` with the adapter of `source` (a LoRA run's model/, or the run folder) merged
    into its weights; the tokenizer, training.json and search.json are copied as they are (the merged model
    computes what the adapted one did). Written whole or not at all; an existing non-empty `out` only with `force`."""
    source, out = Path(source), Path(out)
    if not has_adapter(source) and has_adapter(source / "model"):
        source = source / "model"
    if not has_adapter(source):
        raise NmtError(f"{source}: no {ADAPTER_CONFIG}; give the model/ of a LoRA run (finetune.lora_r > 0) or "
                       "its run folder")
    check_output_dir(out, [source], force, "OUT")
    model = open_model(source).model  # merged

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        for path in [*tokenizer_files(source), source / SUMMARY_FILE, source / SEARCH_FILE]:
            if path.is_file():
                shutil.copy2(path, tmp / path.name)

    return write_directory(out, write)
