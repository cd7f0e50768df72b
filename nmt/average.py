"""Checkpoint averaging: the element-wise mean of the weights of several checkpoints of one run.

Averaging the last few checkpoints (Vaswani et al. 2017; fairseq's average_checkpoints) usually gains
BLEU for free. Reads safetensors only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from nmt.errors import NmtError
from nmt.model_dir import LANGUAGES_FILE, SUMMARY_FILE, WEIGHTS_FILE


def average_weights(dirs: list[Path]) -> dict[str, torch.Tensor]:
    """Mean of the weights (model.safetensors) of `dirs` (checkpoints or model directories), in float32."""
    if not dirs:
        raise NmtError("nothing to average: no checkpoints given")
    total: dict[str, torch.Tensor] = {}
    for d in dirs:
        try:
            state = load_file(str(Path(d) / WEIGHTS_FILE))
        except (SafetensorError, OSError, FileNotFoundError) as e:
            raise NmtError(f"{Path(d) / WEIGHTS_FILE}: cannot read ({e})") from None
        if total and state.keys() != total.keys():
            raise NmtError(f"{d}: its weights have other names than {dirs[0]}'s; average checkpoints of one run only")
        for k, v in state.items():
            total[k] = total[k] + v.float() if k in total else v.float().clone()
    return {k: v / len(dirs) for k, v in total.items()}


def tied_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of state-dict names that are one tensor (tied weights): safetensors stores each group once, under
    any one of its names."""
    groups: dict[tuple, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        groups.setdefault(key, []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def load_into(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load averaged weights into `model`; a tied weight stored once under one of its names fills the others
    (nmt's shared embeddings and any own model's ties alike)."""
    own = model.state_dict()
    for names in tied_names(model):
        stored = next((n for n in names if n in weights), None)
        for name in names:
            if stored is not None and name not in weights:
                weights[name] = weights[stored]
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items() if k in own}, strict=True)


def average_run(run_dir: str | Path, last: int, out: str | Path, force: bool = False) -> Path:
    """Average the last `last` checkpoints of a run into a new model directory `out`.

    The architecture and tokenizer come from the run's model/ (or best/) directory, and so does the adapter of a
    LoRA run (its checkpoints' base and LoRA weights are averaged, and written as an adapter directory again, which
    `nmt merge-adapter` merges); its search.json is not copied
    (an alpha tuned for other weights). `out` is written as a sibling temporary directory and renamed into place:
    an existing non-empty `out` only with `force`, and never one the average is read from."""
    import json

    from nmt.adapters import has_adapter, save_adapted
    from nmt.checkpoint import list_checkpoints, write_directory
    from nmt.model import Seq2SeqTransformer
    from nmt.textfiles import refuse_output_dir
    from nmt.tokenizer import PairTokenizer

    run_dir, out = Path(run_dir), Path(out)
    found = list_checkpoints(run_dir)[-last:]
    if len(found) < 2:
        raise NmtError(f"{run_dir}: {len(found)} complete checkpoint(s) in checkpoints/; averaging needs 2 or more")
    source = next((d for d in (run_dir / "model", run_dir / "best") if d.is_dir()), None)
    if source is None:
        raise NmtError(f"{run_dir}: no model/ or best/ to take the config and tokenizer from")
    refuse_output_dir(out, [source, *found], force, "-o")
    adapted = has_adapter(source)  # a LoRA run: its checkpoints hold the base and LoRA layers, averaged as such
    model = Seq2SeqTransformer.from_pretrained(source, merge_adapter=False)
    load_into(model, average_weights(found))

    def write(tmp: Path) -> None:
        if adapted:  # like the run's model/: the base weights and the averaged adapter
            save_adapted(model, tmp)
        else:
            model.save_pretrained(tmp)
        PairTokenizer.load(source).save(tmp)
        summary = {"averaged": [str(d) for d in found], "from": str(source)}
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        if (source / LANGUAGES_FILE).is_file():  # a multilingual model's target languages and tags
            shutil.copy2(source / LANGUAGES_FILE, tmp / LANGUAGES_FILE)

    return write_directory(out, write)
