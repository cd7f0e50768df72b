"""Parameter-efficient fine-tuning: named parts of a model kept fixed (`finetune.freeze`), and LoRA adapters
through peft (`finetune.lora_r`).

A frozen parameter has requires_grad False and is left out of the optimizer, so neither its gradient nor weight
decay ever touches it: it stays bit-identical. LoRA is injected into the model in place (peft's
`inject_adapter_in_model`): the model keeps its class, its encode/decode for search and its tied embeddings, and
every projection it adapts becomes peft's LoRA layer around the original (nmt.layers calls its projections as
modules, so the low-rank term takes part). Only the adapter is trained.

A LoRA run's model directory is its base model directory (config.json, the unchanged base weights in
model.safetensors, the tokenizer) plus peft's adapter files, adapter_config.json and adapter_model.safetensors
(keys as `PeftModel.save_pretrained` writes them). `nmt.loading.open_model` merges the adapter in
when it finds one, so translate, evaluate and serve take such a directory as it is; `merge_adapter_dir`
(`nmt merge-adapter`) writes the merged weights as a plain model directory. Such a directory is untrusted: nmt
reads adapter_config.json itself and builds plain LoRA from the settings its training writes
(`adapter_settings`), initialisation off, then loads the weights; peft never reads the file.
"""

from __future__ import annotations

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


def lora_config(cfg: FinetuneConfig, init: bool = True):
    """peft's LoraConfig of `cfg`: plain LoRA; `init` False leaves the matrices for weights loaded after."""
    return _peft("finetune.lora_r").LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                               target_modules=list(cfg.lora_targets), bias="none",
                                               init_lora_weights=init)


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


# An adapter directory is untrusted: its adapter_config.json is read by nmt, not by peft, and the adapter is built
# from the few keys below (as `add_lora` builds one for training), initialisation off, before its weights are loaded.
# Any other setting (pissa/olora/... initialisation, DoRA, rsLoRA, rank patterns, modules to save) would make peft
# compute or alter something nmt did not train, so it must be off (null, false, {} or []).
LORA_KEYS = ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias", "init_lora_weights")
INERT_KEYS = ("base_model_name_or_path", "revision", "task_type", "inference_mode", "peft_version", "auto_mapping",
              "megatron_core", "qalora_group_size")  # names and settings of switches that must be off: no effect here


def adapter_settings(directory: Path, model: torch.nn.Module) -> FinetuneConfig:
    """The LoRA settings of `directory`'s adapter_config.json, checked against what nmt's training writes: peft_type
    LORA, a rank that the adapter's weights have, alpha and dropout in FinetuneConfig's ranges, target modules among
    `model`'s linears, no bias, initialisation true or false (the weights are loaded after), every other setting off."""
    from nmt.checkpoint import read_json

    path = directory / ADAPTER_CONFIG
    raw = read_json(path)

    def refuse(key: str, wants: str) -> NmtError:
        return NmtError(f"{path}: {key} {str(raw.get(key))[:80]!r}: {wants}; nmt loads the LoRA adapters its "
                        "training writes (copy adapter_config.json from the run's model/ again)")

    if raw.get("peft_type") != "LORA":
        raise refuse("peft_type", "nmt loads LoRA adapters only (peft_type LORA)")
    on = [k for k, v in raw.items() if k not in LORA_KEYS + INERT_KEYS and v not in (None, False, {}, [])]
    if on:
        raise refuse(on[0], "a peft setting nmt does not train with; it must be off (null)")
    r, alpha, dropout, targets = (raw.get(k) for k in ("r", "lora_alpha", "lora_dropout", "target_modules"))
    if not (isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= 65536):
        raise refuse("r", "the rank is an integer in [1, 65536]")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha <= 1e6):
        raise refuse("lora_alpha", "alpha is a number in (0, 1e6]")
    if not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1):
        raise refuse("lora_dropout", "dropout is a number in [0, 1)")
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    if not (isinstance(targets, list) and targets and all(t in linears for t in targets)):
        raise refuse("target_modules", f"a list of the model's linears ({', '.join(linears)})")
    if raw.get("bias", "none") != "none":
        raise refuse("bias", "LoRA adapters of nmt's train no bias (none)")
    if raw.get("init_lora_weights", True) not in (True, False):
        raise refuse("init_lora_weights", "an initialisation that changes the base weights; it must be true or false")
    return FinetuneConfig(lora_r=r, lora_alpha=float(alpha), lora_dropout=float(dropout), lora_targets=targets)


def load_adapter(model: torch.nn.Module, directory: str | Path, merge: bool = True) -> torch.nn.Module:
    """`model` (the base weights of `directory`) with the adapter of `directory`: merged into the base weights
    (a plain model, as fast as one), or kept as LoRA layers (`merge=False`: the model as it trained). The adapter is
    built from its checked settings (`adapter_settings`), its size from the weights file's header, before any
    tensor of it is read."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    directory = Path(directory)
    peft = _peft(f"{directory} holds a LoRA adapter ({ADAPTER_CONFIG}); loading it")
    settings = adapter_settings(directory, model)
    weights = directory / ADAPTER_WEIGHTS
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k.removeprefix(PEFT_PREFIX): tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        raise NmtError(f"{weights}: cannot read it ({e}); copy {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} from the run's "
                       "model/ again") from None
    ranks = {shape[0] for k, shape in shapes.items() if k.endswith(".lora_A.weight")}
    if ranks != {settings.lora_r}:
        raise NmtError(f"{weights}: its LoRA matrices have rank {sorted(ranks) or 'none'}, {ADAPTER_CONFIG} says r "
                       f"{settings.lora_r}; copy both files from the same run")
    tuner = peft.LoraModel(model, lora_config(settings, init=False), ADAPTER)
    expected = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}
    if shapes != expected:
        odd = sorted(k for k in set(shapes) | set(expected) if shapes.get(k) != expected.get(k))[:3]
        raise NmtError(f"{weights}: its tensors are not those of {ADAPTER_CONFIG}'s adapter (e.g. {odd}); copy both "
                       "files from the same run")
    try:
        state = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(weights)).items()}
    except (OSError, SafetensorError) as e:
        raise NmtError(f"{weights}: cannot read it ({e}); copy it from the run's model/ again") from None
    peft.set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    if not merge:
        return model
    merged = tuner.merge_and_unload()
    if hasattr(merged, "peft_config"):
        del merged.peft_config
    return merged
