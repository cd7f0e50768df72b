"""The checkpoint chapter: where runs keep things on disk, and what each was made with. No torch at import: `nmt
info` and the path checks of nmt.validate name these files cheaply; the functions that read weights import torch
and Accelerate inside.

In reading order: the files of a model directory (output_dir/model, output_dir/best, `nmt average -o DIR`),
reading its JSON with named errors and its language codes by config's one rule (a model directory is untrusted:
a code becomes a file suffix and a tag); step_N checkpoints, written under a temporary name and renamed into place, so
a directory named step_N is always complete (`latest` is the newest such directory), with the sha256
fingerprints of the data they were trained on and of their tokenizer file(s) (`FINGERPRINTS`), so a resume on
other data and a model directory with another tokenizer are named instead of silently misread; a checkpoint's
training state, written and read without pickle (safetensors and JSON), and whether a checkpoint is whole; a
directory written whole by export, import, average and merge-adapter, over only what nmt wrote
(`check_output_dir`); and checkpoint averaging.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nmt.config import ModelConfig, check_lang_code, from_dict, lang_tag
from nmt.errors import NmtError

if TYPE_CHECKING:
    import torch


# --- The files of a model directory ----------------------------------------------------------------------------------
# A model directory (output_dir/model, output_dir/best, `nmt average -o DIR`) holds config.json (the ModelConfig),
# model.safetensors (the weights), the tokenizer JSON, and when training wrote them training.json (what the run was and
# scored) and search.json (the tuned alpha); a LoRA run's also its adapter's two files. Named once here.

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
    except RecursionError:  # json's parser recurses once per level: a file of a million "[" is no config
        raise NmtError(f"{path}: not a JSON file nmt reads (its values nest too deeply)") from None
    if not isinstance(data, dict):
        raise NmtError(f"{path}: expected a JSON object")
    return data


def read_summary(directory: str | Path) -> dict:
    """A model directory's training.json (`SUMMARY_FILE`: what the run was, its config, metrics, data fingerprints,
    segmentation), {} where none was written; one that is not a JSON object is an NmtError naming it. The one
    reader of that file."""
    path = Path(directory) / SUMMARY_FILE
    return read_json(path) if path.is_file() else {}


def read_search(directory: str | Path) -> dict | None:
    """A model directory's search.json (what training's length-penalty tuning wrote: alpha, beam_size, tuned_on,
    bleu), or None where it has none: the one reader of that file."""
    path = Path(directory) / SEARCH_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        alpha = record["alpha"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
        raise NmtError(f"{path}: not a readable search defaults file ({e}); delete it to use the defaults") from None
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise NmtError(f"{path}: alpha must be a number, got {alpha!r}")
    return record


def search_defaults(directory: str | Path) -> dict:
    """{"alpha": ...} from a model directory's search.json (`read_search`), else {}: the SearchConfig fields a
    translator uses unless a call gives them."""
    record = read_search(directory)
    return {} if record is None else {"alpha": float(record["alpha"])}


def languages_record(pairs: list[str], targets: list[str], tags: list[str]) -> dict:
    """What languages.json holds: the pairs trained ("en-de"), the target languages, and their source-side tags."""
    return {"pairs": pairs, "target_languages": targets, "tags": dict(zip(targets, tags)) if tags else {}}


def read_languages(directory: str | Path) -> dict | None:
    """A model directory's languages.json (`languages_record`), or None where training wrote none. Checked as
    training writes it: language codes, and each target's tag the `<2xx>` of its code (never another token)."""
    path = Path(directory) / LANGUAGES_FILE
    if not path.is_file():
        return None
    record = read_json(path)
    pairs, targets, tags = record.get("pairs", []), record.get("target_languages", []), record.get("tags") or {}
    if not (isinstance(pairs, list) and isinstance(targets, list) and isinstance(tags, dict)):
        raise NmtError(f"{path}: pairs and target_languages must be lists and tags an object, as training writes them")
    for i, pair in enumerate(pairs):
        check_lang_code(pair, f"{path}: pairs[{i}]")
    for i, lang in enumerate(targets):
        check_lang_code(lang, f"{path}: target_languages[{i}]")
    for lang, tag in tags.items():
        if lang not in targets or tag != lang_tag(lang):
            raise NmtError(f"{path}: tags[{lang!r}] is {str(tag)[:60]!r}; training writes {lang_tag('xx')!r} for each "
                           "target language xx, and nmt inserts no other token")
    # an imported M2M100/NLLB model (nmt.interop): each target's forced first token, and other names of its codes
    firsts, aliases = record.get("first_tokens") or {}, record.get("aliases") or {}
    if not (isinstance(firsts, dict) and isinstance(aliases, dict)):
        raise NmtError(f"{path}: first_tokens and aliases must be objects, as nmt import writes them")
    for lang, token in firsts.items():
        if lang not in targets or not (isinstance(token, str) and token.strip() == token and 0 < len(token) <= 64):
            raise NmtError(f"{path}: first_tokens[{str(lang)[:60]!r}] must name a target language's token")
    for alias, lang in aliases.items():
        check_lang_code(alias.strip("_"), f"{path}: aliases[{alias[:60]!r}]")
        if lang not in firsts:
            raise NmtError(f"{path}: aliases[{alias[:60]!r}] is {str(lang)[:60]!r}, not one of first_tokens' languages")
    return record


def load_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a model directory (its config.json), checked like any config."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise NmtError(f"{path}: missing; {directory} is not an nmt model directory (give output_dir/model)")
    record = read_json(path)  # its errors name the file
    try:
        return from_dict(ModelConfig, record, "model")
    except NmtError as e:
        raise NmtError(f"{path}: {e}") from None


# --- Checkpoints: written whole, found, pruned -----------------------------------------------------------------------
log = logging.getLogger(__name__)
STEP_DIR = re.compile(r"^step_(\d+)$")
COMPLETE = "nmt_checkpoint.json"  # written last inside a checkpoint, before the rename
TEMPORARY = (".tmp-", ".old-")  # name prefixes of folders being written or replaced (`temp_dir_for`, `publish`)
FINGERPRINTS = "fingerprints"  # key in COMPLETE and training.json: {"train", "valid", "test", "tokenizer"} -> sha256


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete step_N checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    found = []
    for d in root.glob("step_*") if root.is_dir() else []:
        m = STEP_DIR.match(d.name)
        if m and d.is_dir():
            if (d / COMPLETE).is_file():
                found.append((int(m.group(1)), d))
            else:
                log.warning("ignoring %s: it is incomplete (a run was killed while writing it)", d)
    return [d for _, d in sorted(found)]


def resume_candidates(resume: str | None, output_dir: str | Path) -> list[Path]:
    """The checkpoints `resume` may start from, newest first: `latest` -> the run's complete checkpoints (at least
    one), `auto` -> the same, possibly none (a fresh start), None -> none, a path -> that checkpoint, checked."""
    if resume is None:
        return []
    if resume in ("latest", "auto"):
        found = list_checkpoints(output_dir)[::-1]
        if not found and resume == "latest":
            raise NmtError(f"--resume latest: no checkpoint in {checkpoints_dir(output_dir)}; "
                           "train without --resume to start fresh, or use --resume auto")
        return found
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise NmtError(f"--resume {resume}: not a complete nmt checkpoint (no {COMPLETE}); "
                       f"use --resume latest or a step_N folder from {checkpoints_dir(output_dir)}")
    return [path]


def resolve_resume(resume: str, output_dir: str | Path) -> Path:
    """`latest` -> the newest complete checkpoint of the run; a path -> that checkpoint, checked."""
    return resume_candidates(resume, output_dir)[0]


def read_info(path: Path) -> dict:
    """The JSON nmt wrote into a checkpoint (step, process count, loop and sampler state)."""
    try:
        return json.loads((path / COMPLETE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise NmtError(f"{path / COMPLETE}: unreadable ({e}); resume from another checkpoint") from None


def temp_dir_for(final: Path) -> Path:
    """A name of this process's own for `final` while it is written: two writers never share one."""
    return final.parent / f".tmp-{final.name}-{_unique()}"


def _unique() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_temporaries(output_dir: str | Path) -> None:
    """Delete the temporary folders a killed run left in `output_dir` and its checkpoints/ (call only while
    holding the folder's lock: then no other process is writing them)."""
    for root in (Path(output_dir), checkpoints_dir(output_dir)):
        for d in root.iterdir() if root.is_dir() else []:
            if d.name.startswith(TEMPORARY) and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)


def mark_complete(tmp: Path, info: dict) -> None:
    (tmp / COMPLETE).write_text(json.dumps(info))


def fsync_tree(root: Path) -> None:
    """Flush every file under `root`, and the folders themselves, to disk: a rename is atomic, but without
    this a crash soon after it can leave a complete-looking step_N whose files are empty or cut short."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(folder))


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary directory into place, replacing an older one atomically enough:
    the old directory is moved aside first and removed only after the new one is in place."""
    old = final.parent / f".old-{final.name}-{_unique()}"
    fsync_tree(tmp)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)



# --- Writing a directory whole, over only what nmt wrote --------------------------------------------------------------
# `nmt export`, `import`, `average` and `merge-adapter` write a directory OUT whole (`write_directory`). An existing OUT
# is replaced (`--force`) only when nmt wrote it: a model directory or an export, whose every file is one of the names
# below, is replaced; a run folder (its config.yaml beside metrics.jsonl or checkpoints/) is moved aside, never
# deleted; anything else, the working directory, the home folder, a folder holding either, and a symlink are refused.

OUTPUT_FILES = frozenset({
    CONFIG_FILE, WEIGHTS_FILE, SUMMARY_FILE, SEARCH_FILE, LANGUAGES_FILE, JOINT_FILE, SRC_FILE, TGT_FILE,
    ADAPTER_CONFIG, ADAPTER_WEIGHTS,
    "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",  # a transformers export
    "model.bin", "nmt_ctranslate2.json", "shared_vocabulary.json", "source_vocabulary.json",  # a CTranslate2 export
    "target_vocabulary.json", "shared_vocabulary.txt", "source_vocabulary.txt", "target_vocabulary.txt",
})
RUN_CONFIG, RUN_MARKERS = "config.yaml", ("metrics.jsonl", "checkpoints")  # what every run folder holds


def is_model_output(directory: Path) -> bool:
    """Whether `directory` is a model directory or an export nmt wrote: config.json, the weights, and files of
    OUTPUT_FILES only (no folder, nothing of the user's)."""
    entries = list(directory.iterdir())
    names = {e.name for e in entries}
    return (all(e.is_file() and not e.is_symlink() and e.name in OUTPUT_FILES for e in entries)
            and CONFIG_FILE in names and bool(names & {WEIGHTS_FILE, "model.bin"}))


def is_run_folder(directory: Path) -> bool:
    """Whether `directory` is an nmt run's output_dir: config.yaml beside metrics.jsonl or checkpoints/."""
    return (directory / RUN_CONFIG).is_file() and any((directory / m).exists() for m in RUN_MARKERS)


def check_output_dir(out: Path, inputs: list[Path], force: bool, flag: str) -> None:
    """The checks before a command writes the directory `out` whole: not a symlink, the working directory, the home
    folder or a folder holding one of them, nor one of the directories it reads (or a folder holding one), not a
    file; empty or absent, or with `force` a directory nmt wrote (`is_model_output`, `is_run_folder`)."""
    if out.is_symlink():
        raise NmtError(f"{flag} {out} is a symbolic link (to {os.readlink(out)}); nmt replaces a folder whole and never "
                       "through a link: give a new path, or the folder itself")
    if not out.exists():
        return
    where = out.resolve()
    for name, place in (("the working directory", Path.cwd()), ("your home folder", Path.home())):
        place = place.resolve()
        if where == place or where in place.parents:
            holds = "is" if where == place else f"holds {place},"
            raise NmtError(f"{flag} {out} {holds} {name}; nmt writes OUT as a folder of its own: give a new path, "
                           "e.g. ./exported")
    for d in inputs:
        if where == d.resolve() or where in d.resolve().parents:
            holds = "is" if where == d.resolve() else "holds"
            raise NmtError(f"{flag} {out} {holds} {d}, which this command reads; choose another output directory")
    if not out.is_dir():
        raise NmtError(f"{flag} {out} is a file; give the path of a directory to write")
    if not any(out.iterdir()):
        return
    if not force:
        raise NmtError(f"{flag} {out} exists and is not empty; choose another directory or pass --force to replace it")
    if not (is_model_output(out) or is_run_folder(out)):
        other = sorted(e.name for e in out.iterdir() if e.name not in OUTPUT_FILES or not e.is_file())
        what = f"holds what nmt did not write ({', '.join(other[:3])}{', ...' if len(other) > 3 else ''})" if other \
            else "is no complete model directory of nmt's"
        raise NmtError(f"{flag} {out} {what}; --force replaces only a model directory or run folder nmt wrote: "
                       "move those files away or choose another directory")


def write_directory(out: Path, write: Callable[[Path], None]) -> Path:
    """`write` fills a sibling temporary directory, which then replaces `out` whole: a failed or killed write leaves
    `out` as it was (a killed one's leftover is removed by the next write). An `out` that is not a model directory
    of nmt's (a run folder, passed by `check_output_dir`) is moved aside to `out.replaced-N` and kept."""
    if out.is_symlink():
        raise NmtError(f"{out} is a symbolic link; nmt replaces a folder whole and never through a link")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = temp_dir_for(out)
    shutil.rmtree(partial, ignore_errors=True)
    try:
        write(partial)
        if out.is_dir() and any(out.iterdir()) and not is_model_output(out):
            aside = next(p for n in range(1, 1 << 20) if not (p := out.with_name(f"{out.name}.replaced-{n}")).exists())
            os.replace(out, aside)
            log.warning("moved %s aside to %s (nmt replaces only its model directories: delete it yourself when you "
                        "no longer need it)", out, aside)
        publish(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def prune(output_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (never the newest one)."""
    found = list_checkpoints(output_dir)
    for d in found[: max(len(found) - max(keep_last, 1), 0)]:
        shutil.rmtree(d, ignore_errors=True)


# --- Fingerprints: what a checkpoint or model directory was made with ------------------------------------------------


def sha256_parts(parts: Iterable[bytes]) -> str:
    """One sha256 over several byte strings, each prefixed by its length (no two splits of the bytes collide)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def tokenizer_files(directory: str | Path) -> list[Path]:
    """The tokenizer file(s) in `directory`, as PairTokenizer.load picks them (empty: none there)."""
    directory = Path(directory)
    if (directory / JOINT_FILE).is_file():
        return [directory / JOINT_FILE]
    pair = [directory / SRC_FILE, directory / TGT_FILE]
    return pair if all(p.is_file() for p in pair) else []


def tokenizer_sha256(directory: str | Path) -> str | None:
    """The fingerprint of the tokenizer file(s) in `directory`, byte for byte; None when it holds none."""
    files = tokenizer_files(directory)
    return sha256_parts(p.read_bytes() for p in files) if files else None


def check_fingerprint(directory: str | Path) -> None:
    """A model directory's tokenizer must be the one its model was trained with: training.json records the sha256
    of the tokenizer file(s) as they were written, and another tokenizer (even one of the same size, whose ids
    mean other subwords) is refused. Directories without that record (not written by training) pass."""
    directory = Path(directory)
    try:
        recorded = (read_summary(directory).get(FINGERPRINTS) or {}).get("tokenizer")
    except (OSError, NmtError):
        return  # no training.json, or not one training wrote: nothing recorded to compare
    found = tokenizer_sha256(directory)
    if recorded and found and found != recorded:
        names = " + ".join(p.name for p in tokenizer_files(directory))
        raise NmtError(f"{directory}: {names} is not the tokenizer this model was trained with (its sha256 is "
                       f"{found[:12]}..., {SUMMARY_FILE} records {recorded[:12]}...), so its ids would mean other "
                       f"subwords; put back the model's own tokenizer file(s) (the run's best/ or model/ holds them)")


def data_changes(saved: dict, now: dict) -> list[str]:
    """The names in `now` (splits: "train", "valid", "test") whose fingerprint differs from `saved`'s; a name
    `saved` does not record (a checkpoint from before fingerprints) is not compared."""
    return [name for name, value in now.items() if saved.get(name) not in (None, value)]


# --- A checkpoint's training state, without pickle -------------------------------------------------------------------
# What a resume restores, and nothing of it pickled: the weights (model.safetensors), the optimizer's state (its
# tensors in optimizer.safetensors, its param_groups and any other values as JSON in that file's metadata), the
# schedule's and the fp16 loss scaler's state as JSON, and each process's random states (random_states_R.safetensors:
# the torch generators as byte tensors, Python's and NumPy's Mersenne Twister words as integers, the rest JSON).
# Accelerate's save_state would write the optimizer, schedule and random states with torch.save (pickle), so nmt
# writes and reads them itself. A pickle in a checkpoint folder (`*.bin`, `*.pkl`, `*.pt`, `pytorch_model*`:
# Accelerate's layout, an older nmt's checkpoint, or one planted) is never opened: it is damage, named.
#
# Is a checkpoint whole? Every file is read before anything is restored (a file cut short after a node crash, a
# tokenizer file that is not the one recorded), and what the optimizer, schedule and random-state files hold is
# checked against the run's own objects (tensor shapes, JSON types) before any of it is applied. A damaged or
# tampered file is damage like a cut-short one: the run falls back to the previous checkpoint
# (`nmt.training.state.pick_checkpoint`). Weights of another model size are not damage: loading them fails with
# the shapes and the changed keys named (`nmt.validate.load_state_error`).

OPTIMIZER_FILE = "optimizer.safetensors"  # the optimizer's state tensors; param_groups in its metadata
SCHEDULER_FILE = "scheduler.json"  # the learning-rate schedule's state_dict
SCALER_FILE = "scaler.json"  # the fp16 loss scaler's state_dict, when the run has one
PICKLED = ("*.bin", "*.pkl", "*.pt", "*.pth", "*.ckpt", "pytorch_model*")  # never opened: damage, named


def rng_file(rank: int) -> str:
    """Process `rank`'s random states in a checkpoint."""
    return f"random_states_{rank}.safetensors"


class StateDamage(Exception):
    """A training-state file that cannot be restored; its message names the file and what is wrong."""


@dataclass
class SavedState:
    """The training state of one checkpoint as one process restores it, read and checked, not yet applied."""

    optimizer: dict  # torch's Optimizer.state_dict() layout
    scheduler: dict
    scaler: dict | None
    rng: dict | None  # None: a process the checkpoint did not have (it starts from the run's seed)
    accelerator_step: int = 0  # Accelerator.step: where gradient accumulation stands


def write_state(directory: Path, rank: int, main: bool, model, optimizer, scheduler, scaler=None,
                accelerator_step: int = 0, weights: dict | None = None, optimizer_state: dict | None = None) -> None:
    """The training state into checkpoint folder `directory`: the main process writes the weights of `model` (the
    bare objective), the optimizer's, the schedule's and the loss scaler's state (under DDP they are the same on
    every process); every process writes its own random states. `weights` and `optimizer_state`, when given, stand
    for the model's and the optimizer's state_dict (FSDP2's, gathered whole: `nmt.training.fsdp`)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    if main:
        weights = model.state_dict() if weights is None else weights
        save_file(_stored_once(weights), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        tensors, meta = _optimizer_record(optimizer.state_dict() if optimizer_state is None else optimizer_state)
        save_file(tensors, str(directory / OPTIMIZER_FILE), metadata=meta)
        (directory / SCHEDULER_FILE).write_text(json.dumps(scheduler.state_dict(), allow_nan=False))
        if scaler is not None:
            (directory / SCALER_FILE).write_text(json.dumps(scaler.state_dict(), allow_nan=False))
    tensors, meta = _rng_record(accelerator_step)
    save_file(tensors, str(directory / rng_file(rank)), metadata=meta)


def _stored_once(state_dict: dict) -> dict:
    """`state_dict` with a tensor shared under several names (a tied embedding) kept under its first name only, as
    model directories store it (`tgt_embed.weight`); safetensors' `load_model` takes either name back."""
    out, seen = {}, set()
    for name, tensor in state_dict.items():
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if where not in seen:
            seen.add(where)
            out[name] = tensor.detach().contiguous()
    return out


def _optimizer_record(state_dict: dict) -> tuple[dict, dict]:
    """An optimizer's state_dict as safetensors: `state.I.NAME` tensors, the rest JSON in the metadata."""
    import torch

    tensors, values = {}, {}
    for index, entry in state_dict["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                values.setdefault(str(index), {})[name] = value
    meta = {"format": "pt", "param_groups": json.dumps(state_dict["param_groups"]), "values": json.dumps(values)}
    return tensors, meta


def _rng_record(accelerator_step: int) -> tuple[dict, dict]:
    """This process's random states: Python's, NumPy's and torch's (CPU and every CUDA device)."""
    import random

    import numpy as np
    import torch

    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "python": torch.tensor(words, dtype=torch.int64),
               "numpy": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    meta = {"python": json.dumps([version, gauss]), "numpy": json.dumps([kind, int(pos), int(has_gauss), float(cached)]),
            "accelerator_step": str(accelerator_step)}
    return tensors, meta


def damage(path: Path, rank: int) -> str | None:
    """What is wrong with checkpoint `path`'s files for process `rank` (a pickle in it, a file missing, unreadable or
    cut short, a tokenizer that is not the recorded one), or None when they are whole."""
    try:
        info = json.loads((path / COMPLETE).read_text())
        if not isinstance(info, dict) or "state" not in info:
            return f"{COMPLETE} holds no training state"
    except (OSError, ValueError) as e:
        return f"{COMPLETE} is unreadable ({type(e).__name__})"
    pickled = sorted({p.name for pattern in PICKLED for p in path.glob(pattern)})
    if pickled:
        run = path.parent.parent
        return (f"{pickled[0]} is a pickle, which nmt never reads (Accelerate's save_state or an older nmt wrote it, "
                f"or it was planted); nmt's checkpoints hold {OPTIMIZER_FILE}, {SCHEDULER_FILE} and "
                f"{rng_file(0)}: to go on from an older run, train from its model directory (--init_from "
                f"{run / 'best'} or {run / 'model'}, a fresh optimizer) into a new --output_dir")
    recorded = (info.get(FINGERPRINTS) or {}).get("tokenizer")
    if recorded and tokenizer_sha256(path) != recorded:
        names = " + ".join(p.name for p in tokenizer_files(path))
        return f"{names} is not the tokenizer it recorded (sha256)" if names else "its tokenizer file is missing"
    needed = [WEIGHTS_FILE, OPTIMIZER_FILE, SCHEDULER_FILE]
    if rank < int(info.get("num_processes") or 1):  # else a process the checkpoint did not have: from its seed
        needed.append(rng_file(rank))
    for name in needed:
        if not (path / name).is_file():
            return f"{name} is missing"
    for file in sorted(path.glob("*.safetensors")):
        if problem := safetensors_damage(file):
            return problem
    return None


def safetensors_damage(path: Path) -> str | None:
    """A missing or cut-short safetensors file."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        size = path.stat().st_size
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        return f"{path.name} is unreadable ({type(e).__name__})"
    if size != 8 + n + end:
        return f"{path.name} is cut short ({size} of {8 + n + end} bytes)"
    return None


def read_state(path: Path, rank: int, optimizer, scheduler, scaler=None) -> SavedState:
    """Checkpoint `path`'s training state for process `rank`, read and checked against the run's `optimizer`,
    `scheduler` and `scaler` (the structure and types their own state_dicts have, every tensor the shape of its
    parameter): a StateDamage naming the file when it does not fit. Nothing is applied yet."""
    info = json.loads((path / COMPLETE).read_text())
    saved = _read_optimizer(path / OPTIMIZER_FILE)
    if problem := _optimizer_misfit(saved, optimizer):
        raise StateDamage(f"{OPTIMIZER_FILE} {problem}")
    sched = _read_json_state(path / SCHEDULER_FILE, scheduler.state_dict())
    scaler_state = None
    if scaler is not None:
        if not (path / SCALER_FILE).is_file():
            raise StateDamage(f"{SCALER_FILE} is missing (the run has an fp16 loss scaler)")
        scaler_state = _read_json_state(path / SCALER_FILE, scaler.state_dict())
    rng, step = None, 0
    if rank < int(info.get("num_processes") or 1):
        rng, step = _read_rng(path / rng_file(rank))
    return SavedState(saved, sched, scaler_state, rng, step)


def _open_safetensors(path: Path) -> tuple[dict, dict]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise StateDamage(f"{path.name} is unreadable ({type(e).__name__}: {str(e)[:120]})") from None


def _json_meta(meta: dict, key: str, path: Path):
    try:
        return json.loads(meta[key])
    except (KeyError, TypeError, ValueError) as e:
        raise StateDamage(f"{path.name}: its metadata {key!r} is missing or not JSON ({type(e).__name__})") from None


def _read_optimizer(path: Path) -> dict:
    tensors, meta = _open_safetensors(path)
    groups, values = _json_meta(meta, "param_groups", path), _json_meta(meta, "values", path)
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not isinstance(values, dict):
        raise StateDamage(f"{path.name}: param_groups is not a list of objects")
    state: dict[int, dict] = {}
    for key, tensor in tensors.items():
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
            raise StateDamage(f"{path.name}: unexpected tensor {key[:80]!r}")
        state.setdefault(int(parts[1]), {})[parts[2]] = tensor
    for index, entry in values.items():
        if not index.isdigit() or not isinstance(entry, dict):
            raise StateDamage(f"{path.name}: unexpected value for {index[:80]!r}")
        state.setdefault(int(index), {}).update(entry)
    return {"state": state, "param_groups": groups}


def _optimizer_misfit(saved: dict, optimizer) -> str | None:
    """Why `saved` (an optimizer state_dict) does not fit `optimizer`: the groups and their parameters, the JSON
    types of every setting, each state tensor's shape against its parameter's (None: it fits)."""
    import torch

    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups):
        return f"has {len(saved['param_groups'])} parameter groups, the run's optimizer {len(groups)}"
    params = {}
    for g, (old, new) in enumerate(zip(saved["param_groups"], groups)):
        ids = old.get("params")
        if not isinstance(ids, list) or len(ids) != len(new["params"]) or not all(type(i) is int for i in ids):
            return f"group {g} does not list the run's {len(new['params'])} parameters"
        for key in old.keys() & new.keys() - {"params"}:
            if problem := json_misfit(old[key], new[key], f"group {g} {key}"):
                return problem
        params.update(zip(ids, new["params"]))
    names = {frozenset(entry) for entry in saved["state"].values()}
    if len(names) > 1:
        return "holds other state names for some parameters than for others"
    for index, entry in saved["state"].items():
        if index not in params:
            return f"holds state for parameter {index}, which no group lists"
        shape = tuple(params[index].shape)
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                if not value.is_floating_point():
                    return f"state {index}.{name} is {value.dtype}, not floating point"
                if value.dim() and tuple(value.shape) != shape:  # (a 0-dim value: the step count)
                    return f"state {index}.{name} is {tuple(value.shape)}, its parameter {shape}"
    return None


def json_misfit(saved, now, where: str) -> str | None:
    """Where the JSON value `saved` differs in structure or type from `now` (what the run's own object holds: the
    same keys, list lengths and types; an integer passes for a float), or None."""
    if isinstance(now, (list, tuple)):
        if not isinstance(saved, list) or len(saved) != len(now):
            return f"{where} is not a list of {len(now)}"
        return next((p for i, (a, b) in enumerate(zip(saved, now)) if (p := json_misfit(a, b, f"{where}[{i}]"))), None)
    if isinstance(now, dict):
        if not isinstance(saved, dict) or saved.keys() != {str(k) for k in now}:
            return f"{where} does not hold the keys {sorted(map(str, now))[:8]}"
        return next((p for k, v in now.items() if (p := json_misfit(saved[str(k)], v, f"{where}.{k}"))), None)
    if now is None or saved is None:  # (a setting torch leaves open on one device, e.g. fused)
        return None if not isinstance(saved, (dict, list)) else f"{where} is {type(saved).__name__}, not a value"
    if isinstance(now, (bool, str)):
        return None if type(saved) is type(now) else f"{where} is {type(saved).__name__}, not {type(now).__name__}"
    if isinstance(now, (int, float)):
        ok = type(saved) is int or (isinstance(now, float) and type(saved) is float)
        return None if ok else f"{where} is {type(saved).__name__}, not {type(now).__name__}"
    return None  # (a value JSON cannot hold is not saved either)


def _read_json_state(path: Path, now: dict) -> dict:
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StateDamage(f"{path.name} is unreadable ({type(e).__name__})") from None
    if problem := json_misfit(saved, json.loads(json.dumps(now)), "its state"):
        raise StateDamage(f"{path.name}: {problem}")
    return saved


def _read_rng(path: Path) -> tuple[dict, int]:
    """A random-state file, checked as far as restoring it would check it (sizes, word ranges, JSON)."""
    import torch

    tensors, meta = _open_safetensors(path)
    python, numpy = _json_meta(meta, "python", path), _json_meta(meta, "numpy", path)
    step = meta.get("accelerator_step", "0")
    words = {"torch": (torch.uint8, torch.get_rng_state().numel()), "python": (torch.int64, 625),
             "numpy": (torch.int64, 624)}
    for name, (dtype, size) in words.items():
        t = tensors.get(name)
        if t is None or t.dtype != dtype or t.shape != (size,):
            raise _bad(path, f"{name} is not {size} {dtype} values")
    if any(k not in words and not (k.startswith("cuda.") and k[5:].isdigit()) for k in tensors):
        raise _bad(path, "it holds tensors nmt does not write")
    for name in ("python", "numpy"):
        t = tensors[name][:624]
        if bool((t < 0).any()) or bool((t >= 1 << 32).any()):
            raise _bad(path, f"{name}'s words are not 32-bit")
    if not (isinstance(python, list) and len(python) == 2 and type(python[0]) is int
            and (python[1] is None or type(python[1]) is float) and isinstance(numpy, list) and len(numpy) == 4
            and numpy[0] == "MT19937" and all(type(x) is int for x in numpy[1:3]) and type(numpy[3]) is float
            and 0 <= numpy[1] <= 624 and 0 <= int(tensors["python"][624]) <= 624 and step.isdigit()):
        raise _bad(path, "its Python or NumPy state is not one they save")
    return {"tensors": tensors, "python": python, "numpy": numpy}, int(step)


def _bad(path: Path, what: str) -> StateDamage:
    return StateDamage(f"{path.name} cannot be restored: {what}")


def load_weights(model, path: Path) -> None:
    """The checkpoint's weights into `model` (the bare objective): names and shapes checked (a RuntimeError names
    a misfit, `nmt.validate.load_state_error`); a tied weight stored once fills its other names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    try:
        load_model(model, str(path / WEIGHTS_FILE), strict=True)
    except (SafetensorError, OSError) as e:
        raise StateDamage(f"{WEIGHTS_FILE} is unreadable ({type(e).__name__}: {str(e)[:120]})") from None


def read_weights(path: Path) -> dict:
    """Checkpoint `path`'s weights as tensors (a StateDamage when the file is unreadable)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise StateDamage(f"{WEIGHTS_FILE} is unreadable ({type(e).__name__}: {str(e)[:120]})") from None


def apply_state(saved: SavedState, optimizer, scheduler, scaler=None, load_optimizer=None) -> None:
    """Put a checked `read_state` into the run's objects and this process's random generators; `load_optimizer`,
    when given, loads the optimizer's state_dict in place of `optimizer.load_state_dict` (a sharded optimizer's)."""
    import random

    import numpy as np
    import torch

    groups = [{k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in old.items()}  # betas are a tuple
              for old, now in zip(saved.optimizer["param_groups"], optimizer.param_groups)]
    try:
        (load_optimizer or optimizer.load_state_dict)({"state": saved.optimizer["state"], "param_groups": groups})
        scheduler.load_state_dict(saved.scheduler)
        if scaler is not None:
            scaler.load_state_dict(saved.scaler)
        if saved.rng is None:
            return
        tensors, (version, gauss), (kind, pos, has_gauss, cached) = saved.rng["tensors"], saved.rng["python"], \
            saved.rng["numpy"]
        random.setstate((version, tuple(tensors["python"].tolist()), gauss))
        np.random.set_state((kind, tensors["numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(tensors["torch"])
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                if f"cuda.{i}" in tensors:
                    torch.cuda.set_rng_state(tensors[f"cuda.{i}"], i)
    except (ValueError, TypeError, KeyError, RuntimeError) as e:  # what the checks above did not foresee
        raise StateDamage(f"its optimizer, schedule or random states cannot be restored ({type(e).__name__}: "
                          f"{str(e)[:120]})") from None


# --- Checkpoint averaging --------------------------------------------------------------------------------------------
# Checkpoint averaging: the element-wise mean of the weights of several checkpoints of one run.
#
# Averaging the last few checkpoints (Vaswani et al. 2017; fairseq's average_checkpoints) usually gains
# BLEU for free. Reads safetensors only.

def average_weights(dirs: list[Path]) -> dict[str, torch.Tensor]:
    """Mean of the weights (model.safetensors) of `dirs` (checkpoints or model directories), in float32."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

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
