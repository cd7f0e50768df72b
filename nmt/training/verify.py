"""Is a checkpoint whole? Every file of a step_N folder is read before Accelerate loads it (a truncated
`optimizer.bin` after a node crash, a random-state file Accelerate would silently skip, a tokenizer file that is
not the one recorded), and after loading the random states are checked to be the saved ones. (Weights of another
model size are not damage: loading them fails with the shapes and the changed keys named,
`nmt.validate.load_state_error`.)"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import torch
from accelerate.utils import RNG_STATE_NAME, SAFE_WEIGHTS_NAME, load

from nmt import checkpoint as ckpt


def damage(path: Path, rank: int) -> str | None:
    """What is wrong with checkpoint `path` for process `rank` (a file unreadable, cut short or failing its
    checksums), or None when it is whole."""
    try:
        info = json.loads((path / ckpt.COMPLETE).read_text())
        if not isinstance(info, dict) or "state" not in info:
            return f"{ckpt.COMPLETE} holds no training state"
    except (OSError, ValueError) as e:
        return f"{ckpt.COMPLETE} is unreadable ({type(e).__name__})"
    recorded = (info.get(ckpt.FINGERPRINTS) or {}).get("tokenizer")
    if recorded and ckpt.tokenizer_sha256(path) != recorded:
        names = " + ".join(p.name for p in ckpt.tokenizer_files(path))
        return f"{names} is not the tokenizer it recorded (sha256)" if names else "its tokenizer file is missing"
    weights = sorted(path.rglob("*.safetensors"))
    if not weights and not any(path.glob("pytorch_model*")):  # (FSDP's sharded weights: a pytorch_model_fsdp_0/)
        return f"{SAFE_WEIGHTS_NAME} is missing"
    for file in weights:
        if problem := safetensors_damage(file):
            return problem
    for zipped in sorted(path.glob("*.bin")):
        if problem := torch_file_damage(zipped):
            return problem
    if rank >= int(info.get("num_processes") or 1):
        return None  # a process the checkpoint did not have: it starts from its seed (resume warns about this)
    return rng_damage(path / f"{RNG_STATE_NAME}_{rank}.pkl")


def safetensors_damage(path: Path) -> str | None:
    """A missing or cut-short safetensors file."""
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
