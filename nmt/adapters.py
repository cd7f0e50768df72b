"""Parameter-efficient fine-tuning: named parts of a model kept fixed (`finetune.freeze`), and LoRA adapters
through peft (`finetune.lora_r`).

A frozen parameter has requires_grad False and is left out of the optimizer, so neither its gradient nor weight
decay ever touches it: it stays bit-identical. LoRA is injected into the model in place (peft's
`inject_adapter_in_model`): the model keeps its class, its encode/decode for search and its tied embeddings, and
every projection it adapts becomes peft's LoRA layer around the original (nmt.layers calls its projections as
modules, so the low-rank term takes part). Only the adapter is trained.

A LoRA run's model directory is its base model directory (config.json, the unchanged base weights in
model.safetensors, the tokenizer) plus peft's adapter files, adapter_config.json and adapter_model.safetensors
(keys as `PeftModel.save_pretrained` writes them). `Seq2SeqTransformer.from_pretrained` merges the adapter in
when it finds one, so translate, evaluate and serve take such a directory as it is; `merge_adapter_dir`
(`nmt merge-adapter`) writes the merged weights as a plain model directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from nmt.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from nmt.config import FinetuneConfig
from nmt.errors import NmtError

ADAPTER = "default"  # the adapter's name inside the model (peft's default)
PEFT_PREFIX = "base_model.model."  # how PeftModel.save_pretrained names the keys: from the PeftModel's root
BASE_LAYER = ".base_layer"  # the original module inside a peft LoRA layer (`get_base_layer()`)
PIP = "pip install 'nmt[lora]'"


def _peft(what: str):
    try:
        import peft
    except ImportError:
        raise NmtError(f"{what} needs peft: {PIP}") from None
    return peft


# --- freezing named parts ----------------------------------------------------------------------------------------


def in_part(name: str, part: str) -> bool:
    """Whether parameter `name` of nmt's model belongs to the part `part` of `finetune.freeze`. The target
    embedding is also the output projection (tied), so freezing embeddings fixes the output layer too."""
    first = name.split(".", 1)[0]
    if part == "embeddings":
        return first in ("src_embed", "tgt_embed")
    if part == "encoder":
        return first in ("encoder", "enc_norm")
    if part == "decoder":
        return first in ("decoder", "dec_norm")
    if part == "cross_attention":  # each decoder layer's attention to the encoder, and its norm
        return first == "decoder" and (".cross_attn." in name or ".sub_cross." in name)
    raise NmtError(f"finetune.freeze: unknown part {part!r}")


def freeze(model: torch.nn.Module, parts: list[str]) -> list[str]:
    """Set requires_grad False on the parameters of `parts`; the names frozen. A part that matches nothing (a
    model of your own with other names) is an error."""
    frozen = []
    for part in parts:
        names = [n for n, p in model.named_parameters(remove_duplicate=False) if in_part(n, part)]
        if not names:
            raise NmtError(f"finetune.freeze: {part!r} matches no parameter of {type(model).__name__} "
                           "(nmt's model names them src_embed/tgt_embed, encoder, decoder)")
        frozen += names
    named = dict(model.named_parameters(remove_duplicate=False))
    for name in frozen:
        named[name].requires_grad_(False)
    if not any(p.requires_grad for p in model.parameters()):
        raise NmtError(f"finetune.freeze: {parts} freezes every parameter; leave at least one part to train")
    return frozen


# --- LoRA ----------------------------------------------------------------------------------------------------------


def lora_config(cfg: FinetuneConfig):
    return _peft("finetune.lora_r").LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                               target_modules=list(cfg.lora_targets), bias="none")


def add_lora(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.nn.Module:
    """LoRA layers around the linears `cfg.lora_targets` names (in place); only they train from here on."""
    peft = _peft("finetune.lora_r")
    try:
        peft.inject_adapter_in_model(lora_config(cfg), model, adapter_name=ADAPTER)
    except ValueError as e:  # target modules not found in the model
        raise NmtError(f"finetune.lora_targets {list(cfg.lora_targets)}: {e}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def apply_finetune(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.nn.Module:
    """The model as `cfg` fine-tunes it: parts frozen, or LoRA adapters added (config.py forbids both at once)."""
    if cfg.freeze:
        freeze(model, cfg.freeze)
    if cfg.lora_r:
        add_lora(model, cfg)
    return model


def split_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """The state dict `weights` of a LoRA model as (base weights named as in the plain model, adapter weights
    named as peft's adapter file names them)."""
    peft = _peft("a LoRA model")
    adapter = peft.get_peft_model_state_dict(model, state_dict=weights, adapter_name=ADAPTER)
    base = {k.replace(BASE_LAYER, ""): v for k, v in weights.items() if ".lora_" not in k}
    return base, {PEFT_PREFIX + k: v for k, v in adapter.items()}


def save_adapted(model: torch.nn.Module, directory: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
    """A LoRA model (weights: its state dict, gathered) as a model directory: the base model's config.json and
    model.safetensors, plus the adapter's config and weights. The tokenizer and summary are the caller's."""
    from safetensors.torch import save_file

    base, adapter = split_weights(model, weights if weights is not None else model.state_dict())
    model.save_pretrained(directory, state_dict=base)
    model.peft_config[ADAPTER].save_pretrained(str(directory))
    save_file({k: v.detach().contiguous().cpu() for k, v in adapter.items()}, str(directory / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})


def has_adapter(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def load_adapter(model: torch.nn.Module, directory: str | Path, merge: bool = True) -> torch.nn.Module:
    """`model` (the base weights of `directory`) with the adapter of `directory`: merged into the base weights
    (a plain model, as fast as one), or kept as LoRA layers (`merge=False`: the model as it trained)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    peft = _peft(f"{directory} holds a LoRA adapter ({ADAPTER_CONFIG}); loading it")
    try:
        config = peft.LoraConfig.from_pretrained(str(directory))
        state = load_file(str(directory / ADAPTER_WEIGHTS))
    except (OSError, ValueError, TypeError, json.JSONDecodeError, SafetensorError) as e:
        raise NmtError(f"{directory}: cannot read its adapter ({e}); copy {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
                       "from the run's model/ again") from None
    tuner = peft.LoraModel(model, config, ADAPTER)
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()}
    expected = set(peft.get_peft_model_state_dict(model, adapter_name=ADAPTER))
    if set(state) != expected:
        odd = sorted(set(state) ^ expected)[:3]
        raise NmtError(f"{directory / ADAPTER_WEIGHTS}: its tensors are not those of {ADAPTER_CONFIG}'s adapter "
                       f"(e.g. {odd}); copy both files from the same run")
    peft.set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    if not merge:
        return model
    merged = tuner.merge_and_unload()
    if hasattr(merged, "peft_config"):
        del merged.peft_config
    return merged


def merge_adapter_dir(source: str | Path, out: str | Path, force: bool = False) -> Path:
    """A plain model directory `out` with the adapter of `source` (a LoRA run's model/, or the run folder) merged
    into its weights; the tokenizer, training.json and search.json are copied as they are (the merged model
    computes what the adapted one did). Written whole or not at all; an existing non-empty `out` only with `force`."""
    from nmt.checkpoint import SEARCH_FILE, SUMMARY_FILE, check_output_dir, tokenizer_files, write_directory
    from nmt.model import Seq2SeqTransformer

    source, out = Path(source), Path(out)
    if not has_adapter(source) and has_adapter(source / "model"):
        source = source / "model"
    if not has_adapter(source):
        raise NmtError(f"{source}: no {ADAPTER_CONFIG}; give the model/ of a LoRA run (finetune.lora_r > 0) or "
                       "its run folder")
    check_output_dir(out, [source], force, "OUT")
    model = Seq2SeqTransformer.from_pretrained(source)  # merged

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        for path in [*tokenizer_files(source), source / SUMMARY_FILE, source / SEARCH_FILE]:
            if path.is_file():
                shutil.copy2(path, tmp / path.name)

    return write_directory(out, write)
