"""Is a checkpoint whole? Every file of a step_N folder is read before Accelerate loads it (a truncated
`optimizer.bin` after a node crash, a random-state file Accelerate would silently skip), the weights' shapes
are checked against the model, and after loading the random states are checked to be the saved ones."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import torch
from accelerate.utils import RNG_STATE_NAME, SAFE_WEIGHTS_NAME, load

from nmt import checkpoint as ckpt


def damage(path: Path, model_shapes: dict[str, tuple] | None, rank: int) -> str | None:
    """What is wrong with checkpoint `path` for process `rank`, or None when it is whole.

    model_shapes: the model's state-dict shapes (None: not checked, e.g. sharded FSDP checkpoints).
    """
    try:
        info = json.loads((path / ckpt.COMPLETE).read_text())
        if not isinstance(info, dict) or "state" not in info:
            return f"{ckpt.COMPLETE} holds no training state"
    except (OSError, ValueError) as e:
        return f"{ckpt.COMPLETE} is unreadable ({type(e).__name__})"
    weights = path / SAFE_WEIGHTS_NAME
    if weights.is_file() or model_shapes is not None:
        problem = safetensors_damage(weights, model_shapes)
        if problem:
            return problem
    for zipped in sorted(path.glob("*.bin")):
        if problem := torch_file_damage(zipped):
            return problem
    if rank >= int(info.get("num_processes") or 1):
        return None  # a process the checkpoint did not have: it starts from its seed (resume warns about this)
    return rng_damage(path / f"{RNG_STATE_NAME}_{rank}.pkl")


def safetensors_damage(path: Path, shapes: dict[str, tuple] | None) -> str | None:
    """A missing or cut-short safetensors file, or tensors whose names or shapes are not the model's."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error) as e:
        return f"{path.name} is unreadable ({type(e).__name__})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size != 8 + n + end:
        return f"{path.name} is cut short ({size} of {8 + n + end} bytes)"
    if shapes is None:
        return None
    saved = {k: tuple(t["shape"]) for k, t in header.items() if k != "__metadata__"}
    wrong = [f"{k} {saved[k]} (the model has {shapes[k]})" for k in saved if k in shapes and saved[k] != shapes[k]]
    if wrong:
        return f"{path.name} does not fit the model: {'; '.join(wrong[:3])}"
    return None


def torch_file_damage(path: Path) -> str | None:
    """A torch.save file (a zip archive) that is cut short or whose contents fail their checksums."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        return f"{path.name} is unreadable ({type(e).__name__})"
    return f"{path.name} is corrupt (member {bad})" if bad else None


def rng_damage(path: Path) -> str | None:
    """The random-state file as Accelerate loads it: Accelerate itself skips an unreadable one without a word."""
    if problem := torch_file_damage(path):
        return problem
    try:
        states = load(path)
        torch.ByteTensor(states["torch_manual_seed"])
    except Exception as e:  # noqa: BLE001 (whatever makes Accelerate skip the file makes it damaged)
        return f"{path.name} cannot be restored ({type(e).__name__})"
    return None


def check_rng_restored(path: Path, rank: int) -> None:
    """After load_state: the torch generator is in the state the checkpoint saved (else resume is not exact)."""
    file = path / f"{RNG_STATE_NAME}_{rank}.pkl"
    if not file.is_file():
        return
    states = load(file)
    if not torch.equal(torch.get_rng_state(), states["torch_manual_seed"]):
        from nmt.errors import NmtError

        raise NmtError(f"{path}: the random states were not restored (Accelerate skipped "
                       f"{file.name}); resume from another checkpoint")
