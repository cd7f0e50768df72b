"""Which run a training continues, and from where: a used output_dir is never mixed with a fresh run
(`--resume latest|auto|PATH` or `--overwrite`), a checkpoint resumes only the run that wrote it (its config is
compared), and a damaged newest checkpoint is named and passed over for the previous complete one."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from accelerate.logging import get_logger
from accelerate.utils import gather_object

from nmt import checkpoint as ckpt
from nmt.config import TrainConfig, read_yaml
from nmt.errors import NmtError
from nmt.strict import to_dict
from nmt.training.state import Run, TrainState
from nmt.training.verify import check_rng_restored, damage
from nmt.validate import load_state_error

log = get_logger(__name__)

# What makes a run that run: a checkpoint resumes only under the same values (unless resume_with_changes).
# Everything else (max_steps, max_minutes, eval_every, save_every, log_every, patience, ...) may change freely.
IDENTITY_SECTIONS = ("data", "tokenizer", "model", "optim")
IDENTITY_KEYS = ("seed", "max_tokens", "accum_steps", "init_from")
FREE_IN_SECTIONS = ("data.cache_dir",)


def claim_output_dir(accelerator, cfg: TrainConfig) -> list[Path]:
    """The checkpoints to resume from, newest first (empty: a fresh run). A fresh run into an output_dir that
    already holds a run is refused, unless `overwrite` moves the old run aside first."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise NmtError(f"output_dir {out}: is a file; give a folder (it is made if missing)")
    found = ckpt.resume_candidates(cfg.resume, out)
    used = out.is_dir() and any(out.iterdir())
    if cfg.resume == "auto" and not found and used and (out / "config.yaml").is_file():
        # the same job again after it died before its first checkpoint: nothing to keep but a stale best/
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(out / "best", ignore_errors=True)
        accelerator.wait_for_everyone()
    elif not found and used:
        if cfg.resume == "auto":
            raise NmtError(f"--resume auto: output_dir {out} holds files but no nmt run (no checkpoint, no "
                           "config.yaml); choose another --output_dir")
        if not cfg.overwrite:
            raise NmtError(f"output_dir {out} already holds a run; continue it with --resume latest (or --resume "
                           "auto: its newest checkpoint if any, else a fresh start), or start over with --overwrite "
                           f"(moves the old run aside to {out}.old-<time>), or choose another --output_dir")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            aside = out.with_name(f"{out.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            while aside.exists():  # two in one second
                aside = aside.with_name(aside.name + "-1")
            out.rename(aside)
            print(f"nmt: --overwrite: moved the previous run in {out} to {aside}", flush=True)
        accelerator.wait_for_everyone()
    return found


def config_changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """`key: old -> new` for every setting that makes the run (IDENTITY_*) and differs from `saved`."""
    now, old = _flat(to_dict(cfg)), _flat(saved)
    keys = [k for k in now if (k.split(".")[0] in IDENTITY_SECTIONS or k in IDENTITY_KEYS) and k not in FREE_IN_SECTIONS]
    return [f"{k}: {old[k]!r} -> {now[k]!r}" for k in keys if k in old and old[k] != now[k]]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


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
