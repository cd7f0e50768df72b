"""Which run a training continues, and from where: one `nmt train` per output_dir at a time (a lock beside it), a
used output_dir is never mixed with a fresh run nor cut by a resume that holds none of its checkpoints
(`--resume latest|auto|PATH` or `--overwrite`), a checkpoint resumes only the run that wrote it (its config and the
fingerprints of its data and tokenizer are compared), and a damaged newest checkpoint is named and passed over for
the previous complete one."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, gather_object

from nmt import checkpoint as ckpt
from nmt.checkpoint import check_rng_restored, damage
from nmt.config import TrainConfig, flat, read_yaml, to_dict
from nmt.errors import NmtError
from nmt.tokenizer import PairTokenizer
from nmt.training.state import Run, TrainState
from nmt.validate import load_state_error

log = get_logger(__name__)

# What makes a run that run: a checkpoint resumes only under the same values (unless resume_with_changes).
# Everything else (max_steps, max_minutes, eval_every, save_every, log_every, patience, ...) may change freely.
IDENTITY_SECTIONS = ("data", "tokenizer", "model", "optim", "finetune")
IDENTITY_KEYS = ("seed", "max_tokens", "accum_steps", "init_from")
FREE_IN_SECTIONS = ("data.cache_dir",)


def claim_output_dir(accelerator, cfg: TrainConfig) -> list[Path]:
    """The checkpoints to resume from, newest first (empty: a fresh run), once this run holds the output_dir's
    lock. A folder that holds a run is changed only by a resume from that run's own checkpoints: a fresh run, or a
    resume that finds none there (`auto` on a finished run whose checkpoints were deleted, a checkpoint of another
    folder), is refused, unless `overwrite` moves the old run aside first."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise NmtError(f"output_dir {out}: is a file; give a folder (it is made if missing)")
    lock_output_dir(accelerator, out)
    found = ckpt.resume_candidates(cfg.resume, out)
    used = out.is_dir() and any(out.iterdir())
    if used and found and found[0].resolve().parent.parent != out.resolve():
        raise NmtError(f"--resume {cfg.resume}: output_dir {out} already holds another run; continue the checkpoint "
                       f"in its own run's folder ({found[0].parent.parent}) or in an unused --output_dir")
    if used and not found:
        if cfg.resume == "auto":
            what = ("a run but none of its checkpoints (a run whose checkpoints were deleted, or one stopped before "
                    "its first), so it cannot be continued" if (out / "config.yaml").is_file()
                    else "files but no nmt run (no checkpoint, no config.yaml)")
            raise NmtError(f"--resume auto: output_dir {out} holds {what}; it is left as it is: start over with "
                           f"--overwrite instead of --resume (moves it aside to {out}.old-<time>), or choose another "
                           "--output_dir")
        if not cfg.overwrite:
            raise NmtError(f"output_dir {out} already holds a run; continue it from its checkpoints with --resume "
                           "latest (or --resume auto), or start over with --overwrite "
                           f"(moves the old run aside to {out}.old-<time>), or choose another --output_dir")
        _refuse_inputs_inside(cfg, out)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            aside = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            while aside.exists():  # two in one second
                aside = aside.with_name(aside.name + "-1")
            out.rename(aside)
            print(f"nmt: --overwrite: moved the previous run in {out} to {aside}", flush=True)
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        ckpt.remove_temporaries(out)  # what a killed run was writing (this run holds the lock: nobody else is)
    return found


def _refuse_inputs_inside(cfg: TrainConfig, out: Path) -> None:
    """`--overwrite` moves the old run aside: an input of this run inside it (`init_from` R/model, a corpus
    written into the run folder) would vanish from under the new run, so that is refused before anything moves."""
    inputs = [("init_from", cfg.init_from), *((f"data.{split}", c.path) for split in ("train", "valid", "test")
                                              for c in cfg.data.corpora(split))]
    root = out.resolve()
    for key, value in inputs:
        if isinstance(value, str) and value:
            path = Path(value).expanduser().resolve()
            if path == root or root in path.parents:
                raise NmtError(f"--overwrite would move {out} aside, and {key} {value} lies inside it; copy it out "
                               "of the old run first (e.g. cp -r), or choose another --output_dir")


# --- one run per output_dir: a lock beside it ------------------------------------------------------------------------

_held: dict[str, object] = {}  # lock file -> the FileLock this process holds (until released or the process ends)


def lock_file(out: Path) -> Path:
    """The lock of output_dir `out`: a hidden file beside it, so that the folder itself stays untouched until the
    run starts and `--overwrite` can move the folder aside while the lock stays held."""
    out = out.resolve()
    return out.parent / f".{out.name}.nmt.lock"


def lock_output_dir(accelerator, out: Path) -> None:
    """Hold `out`'s lock for this run: a second `nmt train` into the same folder is refused, naming the process
    that holds it. The main process takes it and tells the others, so that every process stops alike before any
    collective. An flock: the operating system releases it when the process ends, however it ends."""
    problem = None
    if accelerator.is_main_process:
        try:
            _take_lock(out)
        except NmtError as e:
            problem = str(e)
        except Exception as e:  # noqa: BLE001 (the others must hear of any failure, or they wait for the main process)
            problem = f"output_dir {out}: cannot take its lock {lock_file(out)} ({type(e).__name__}: {e})"
    if accelerator.num_processes > 1:
        box = [problem]
        broadcast_object_list(box)
        problem = box[0]
    if problem:
        raise NmtError(problem)


def _take_lock(out: Path) -> None:
    from filelock import FileLock, Timeout

    path = lock_file(out)
    if str(path) in _held:
        return  # an earlier train() of this process (a notebook) that ended without releasing it
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise NmtError(f"another nmt train is using output_dir {out} ({_holder(path)}); wait for it to end or stop "
                       "it, or choose another --output_dir") from None
    _held[str(path)] = lock
    # beside the lock file, which older filelock versions empty on every try to take it
    path.with_suffix(".pid").write_text(f"{os.getpid()} {socket.gethostname()}\n")


def _holder(path: Path) -> str:
    try:
        pid, host = path.with_suffix(".pid").read_text().split()
    except (OSError, ValueError):
        return "pid unknown"
    return f"pid {pid}" if host == socket.gethostname() else f"pid {pid} on {host}"


def release_output_dir(output_dir: str | Path) -> None:
    """Let other runs use `output_dir` again (at the end of train(); the end of the process does it anyway)."""
    lock = _held.pop(str(lock_file(Path(output_dir))), None)
    if lock is not None:
        lock.release()


def config_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """`key: old -> new` for every setting that makes the run (IDENTITY_*) and differs from `saved`."""
    now, old = flat(to_dict(cfg)), flat(saved)
    keys = [k for k in now if (k.split(".")[0] in IDENTITY_SECTIONS or k in IDENTITY_KEYS) and k not in FREE_IN_SECTIONS]
    return [f"{k}: {old[k]!r} -> {now[k]!r}" for k in keys if k in old and old[k] != now[k]]


def saved_config(path: Path) -> dict | None:
    """The resolved config a checkpoint was written with (older checkpoints: its run's config.yaml)."""
    try:
        info = json.loads((path / ckpt.COMPLETE).read_text())
        if isinstance(info, dict) and isinstance(info.get("config"), dict):
            return info["config"]
    except (OSError, ValueError):
        pass
    run_config = path.parent.parent / "config.yaml"
    return read_yaml(run_config) if run_config.is_file() else None


def check_same_run(path: Path, cfg: TrainConfig) -> None:
    """Refuse to resume `path` under settings that make another run, naming them."""
    saved = saved_config(path)
    changes = config_changes(saved, cfg) if saved else []
    if not changes:
        return
    shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    if not cfg.resume_with_changes:
        raise NmtError(f"--resume: {path} was written by another run configuration ({shown}); put those back, "
                       "start a new run in another --output_dir, or pass --resume-with-changes if you mean it")
    log.warning(f"resuming {path} with changed settings (--resume-with-changes): {shown}; the optimizer and "
                "schedule keep the checkpoint's state", main_process_only=True)


def check_same_data(path: Path, run: Run) -> None:
    """Refuse to resume `path` on data other than it was trained on (the fingerprints it recorded), naming the
    splits, unless `allow_data_change`; and in every case under a tokenizer other than its own."""
    cfg = run.cfg
    saved = ckpt.read_info(path).get(ckpt.FINGERPRINTS) or {}
    changed = ckpt.data_changes(saved, run.corpus.stats.get(ckpt.FINGERPRINTS) or {})
    if changed:
        first = cfg.data.corpora("train")[0].path
        named = ", ".join(f"{name} ({getattr(cfg.data, name) or f'carved from {first}'})" for name in changed)
        if not cfg.allow_data_change:
            raise NmtError(f"--resume: the data changed since {path} was written: {named} (files are known by path, "
                           "size and modification time); put the run's data back, start a new run in another "
                           "--output_dir, or pass --allow-data-change to continue on this data with the run's own "
                           "tokenizer")
        log.warning(f"resuming {path} on changed data (--allow-data-change): {named}; the run's own tokenizer encodes "
                    "it" + ("; validation scores before and after this step are not comparable, and best/ keeps "
                            "the best on either" if "valid" in changed else ""), main_process_only=True)
    own = saved_tokenizer(path)
    if own is not None and _serialized(own) != _serialized(run.corpus.tokenizer):
        raise NmtError(f"--resume: {path} was trained with another tokenizer than this run has (one trained again on "
                       "changed data, or from changed tokenizer.* settings), so its ids would mean other subwords; "
                       "resume with the run's data and settings, or start a new run in another --output_dir")


def saved_tokenizer(path: Path) -> PairTokenizer | None:
    """The tokenizer checkpoint `path` holds, when it holds one whose files are the ones it recorded (a damaged
    checkpoint is named by `pick_checkpoint`, which passes over it)."""
    try:
        recorded = (ckpt.read_info(path).get(ckpt.FINGERPRINTS) or {}).get("tokenizer")
    except NmtError:
        return None
    if not recorded or ckpt.tokenizer_sha256(path) != recorded:
        return None
    return PairTokenizer.load(path)


def resumed_tokenizer(found: list[Path]) -> PairTokenizer | None:
    """The tokenizer of the run `found` resumes, from its newest checkpoint that holds it whole (None: a fresh run,
    or checkpoints written before they held one). Data are encoded with it, so a resume never trains a tokenizer
    again: on changed data (--allow-data-change) a new one of the same size would fit the model's shapes while
    its ids meant other subwords."""
    return next((tok for path in found if (tok := saved_tokenizer(path)) is not None), None)


def _serialized(tokenizer: PairTokenizer) -> tuple[str, str]:
    return tokenizer.src.to_str(), tokenizer.tgt.to_str()


def pick_checkpoint(run: Run, found: list[Path]) -> Path:
    """The newest of `found` that is whole on every process; damaged ones are named (an explicit path that is
    damaged stops with the name of the previous complete checkpoint)."""
    accelerator = run.accelerator
    explicit = run.cfg.resume not in ("latest", "auto")
    for i, path in enumerate(found):
        problems = [p for p in gather_object([damage(path, accelerator.process_index)]) if p]
        if not problems:
            return path
        what = f"checkpoint {path} is damaged: {problems[0]}"
        earlier = [p for p in ckpt.list_checkpoints(run.out) if _step(p) < _step(path)]
        if explicit:
            hint = f"resume from {earlier[-1]} (--resume {earlier[-1]})" if earlier else "start a fresh run"
            raise NmtError(f"{what}; {hint}")
        if i + 1 < len(found):
            log.warning(f"{what}; falling back to {found[i + 1]}", main_process_only=True)
    raise NmtError(f"every checkpoint in {ckpt.checkpoints_dir(run.out)} is damaged (newest: {what}); "
                   "start over with --overwrite")


def _step(path: Path) -> int:
    m = ckpt.STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def resume(run: Run, sampler, found: list[Path]) -> TrainState:
    """Restore model, optimizer, scheduler and RNG (Accelerate, weights_only loads) and our JSON state, from
    the newest whole checkpoint of `found` that this run wrote."""
    accelerator = run.accelerator
    check_same_run(found[0], run.cfg)
    path = pick_checkpoint(run, found)
    check_same_data(path, run)
    try:
        accelerator.load_state(str(path))
    except RuntimeError as e:  # weights of another model size: name the tensor, both shapes and the changed keys
        raise load_state_error(e, path, run.cfg) from None
    check_rng_restored(path, accelerator.process_index)
    info = ckpt.read_info(path)
    state = TrainState(**info["state"])
    sampler.load_state_dict(state.sampler)
    if info.get("num_processes") not in (None, accelerator.num_processes):
        log.warning(f"{path} was written by {info['num_processes']} processes, resuming on {accelerator.num_processes}: "
                    "the data order differs from an uninterrupted run from here on", main_process_only=True)
    log.info(f"resumed from {path} at step {state.step}", main_process_only=True)
    return state
