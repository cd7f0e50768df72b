"""What a run carries and what it leaves: the state a run hands from job to job, which run a training continues
and from where, and the files it writes.

- `TrainState` (saved in checkpoints), `Run` (the run's context) and `TrainResult` (what `train` returns).
- Which run: one `nmt train` per output_dir at a time (a lock beside it), a used output_dir is never mixed with a
  fresh run nor cut by a resume that holds none of its checkpoints (`--resume latest|auto|PATH` or `--overwrite`),
  a checkpoint resumes only the run that wrote it (its config and the fingerprints of its data and tokenizer are
  compared), and a damaged newest checkpoint is named and passed over for the previous complete one.
- What a run leaves on disk: the run directory (config.yaml, data.json, plan.json, metrics.jsonl), step_N
  checkpoints (weights, optimizer, schedule and random states as safetensors and JSON, never a pickle, and the run's
  tokenizer, written atomically) and inference-ready model
  directories (best/, model/). Each records the fingerprints of the run's data and tokenizer
  (`nmt.checkpoint.FINGERPRINTS`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from accelerate.logging import get_logger
from accelerate.utils import DistributedType, broadcast_object_list, gather_object

from nmt import checkpoint as ckpt
from nmt import plan as planlib
from nmt.adapters import save_adapted
from nmt.checkpoint import LANGUAGES_FILE, SUMMARY_FILE, WEIGHTS_FILE, damage, languages_record, read_languages
from nmt.compat import is_fsdp, uncompiled
from nmt.config import TrainConfig, flat, read_yaml, save_yaml, to_dict
from nmt.data import Corpus, corpora_line, overlap_line
from nmt.errors import NmtError
from nmt.model import unwrap_objective
from nmt.textfiles import atomic_file
from nmt.tokenizer import JOINT_FILE, SRC_FILE, TGT_FILE, UNK, PairTokenizer
from nmt.training import fsdp
from nmt.validate import load_state_error

log = get_logger(__name__)

# What makes a run that run: a checkpoint resumes only under the same values (unless resume_with_changes).
# Everything else (max_steps, max_minutes, eval_every, save_every, log_every, patience, ...) may change freely.
IDENTITY_SECTIONS = ("data", "tokenizer", "model", "optim", "finetune")
IDENTITY_KEYS = ("seed", "max_tokens", "accum_steps", "init_from")
FREE_IN_SECTIONS = ("data.cache_dir",)
PLAN_FILE = "plan.json"
SAMPLE = 2000  # pairs read for the segmentation figures


@dataclass
class TrainState:
    """What the loop itself must remember across a resume, stored as JSON in the checkpoint (nmt_checkpoint.json).

    Not `register_for_checkpointing`: Accelerate saves custom objects with torch.save, a pickle. JSON runs no code.
    """

    step: int = 0
    best_score: float = -math.inf  # validation BLEU, or minus the validation loss for models without search
    best_step: int = -1
    best_nll: float = math.inf  # the best's validation loss: of two validations with one BLEU, the lower loss is better
    evals_since_best: int = 0  # for early stopping
    tokens_seen: int = 0
    skipped_steps: int = 0  # steps whose loss or gradient was not finite (no update made)
    bad_in_row: int = 0
    oom_steps: int = 0  # steps with a micro-batch that ran out of memory on some process (no update made)
    oom_in_row: int = 0
    elapsed_s: float = 0.0  # wall-clock seconds of the run so far (its time budget), resumes included
    sampler: dict = field(default_factory=dict)  # TokenBatchSampler.state_dict(): epoch and position
    start: dict = field(default_factory=dict)  # fine-tuning: the starting model's validation scores (before step 1)


@dataclass
class Run:
    """One training run's context, handed to every job instead of long argument lists."""

    accelerator: object  # accelerate.Accelerator
    resolved: TrainConfig  # the config resolved for the run (nmt.plan.resolve), as it started: never edited
    corpus: Corpus
    objective: object = None  # the prepared Seq2SeqLoss (wrapped by DDP on several processes)
    optim: object = None  # its prepared Optim (nmt.training.loop): the optimizer and schedule a checkpoint holds
    state: TrainState = field(default_factory=TrainState)
    plan: planlib.Plan | None = None  # what nmt chose for the run (nmt.plan), re-timed once under a time budget
    started: float = field(default_factory=time.monotonic)  # time.monotonic() when the run's clock started

    cfg: TrainConfig = field(init=False)  # the settings it trains with now: `resolved` with what `plan` re-timed

    def __post_init__(self):
        self.follow(self.plan)

    def follow(self, plan: planlib.Plan | None) -> None:
        """From now on, `plan` (re-timed) and the settings it gives."""
        self.plan, self.cfg = plan, planlib.settings(self.resolved, plan)

    def elapsed(self) -> float:
        """Seconds of the run's time budget spent (before a resume too)."""
        return time.monotonic() - self.started

    @property
    def out(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def bare_objective(self):
        """The objective without DDP/FSDP's or torch.compile's wrappers (accelerate's autocast kept): its own
        state_dict keys, and a forward that runs no collective. (Not accelerate's default keep_torch_compile=True,
        which re-points a compiled wrapper at the unwrapped module: DDP would drop out of the compiled objective.)"""
        return self.accelerator.unwrap_model(self.objective, keep_torch_compile=False)

    @property
    def model(self):
        """The plain model (no DDP/FSDP/compile wrapper, no objective): what search and saving use."""
        return unwrap_objective(self.bare_objective)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process


@dataclass
class TrainResult:
    model_dir: Path | None  # the final model: config.json, model.safetensors, tokenizer.json, training.json
    steps: int
    best: dict = field(default_factory=dict)  # validation metrics of the kept model
    stopped_by: str | None = None  # "SIGTERM"/"SIGINT" when a signal ended the run early (no final model)
    checkpoint: Path | None = None  # the last checkpoint written
    minutes: float | None = None  # wall-clock minutes the run spent of its budget
    max_minutes: float | None = None  # the time budget
    stop_reason: str = ""  # why training ended
    epochs: float | None = None  # epochs trained
    test: dict = field(default_factory=dict)  # the final model on the test set (beam 4): bleu, chrf, pairs
    commands: list[str] = field(default_factory=list)  # how to translate and evaluate with the model
    start: dict = field(default_factory=dict)  # fine-tuning: the starting model's validation scores

    def summary(self) -> str:
        """What the user has, for the terminal."""
        if self.stopped_by:
            return (f"stopped by {self.stopped_by} after step {self.steps}; checkpoint {self.checkpoint}. "
                    "Resume: run the same command with --resume latest (or auto; without --overwrite)")
        digits = 2 if (self.max_minutes or self.minutes) < 1 else 1  # a budget under a minute needs hundredths
        used = f"{self.minutes:.{digits}f}" + (f" of {self.max_minutes:g}" if self.max_minutes else "")
        lines = [f"nmt: trained {self.steps:,} steps" + (f" ({self.epochs:.1f} epochs)" if self.epochs else "") +
                 f" in {used} minutes; stopped: {self.stop_reason or 'done'}"]
        valid = ", ".join(f"{k} {self.best[k]:.2f}" for k in ("bleu", "chrf", "valid_nll") if
                          isinstance(self.best.get(k), float))
        if valid:
            lines.append(f"  best validation: {valid}" + (f" (step {self.best['step']:,})" if "step" in self.best else ""))
        if self.start:
            lines.append("  " + start_line(self.start, self.best))
        lines.append(f"  model: {self.model_dir}")
        if self.test:
            lines.append(f"  test (beam 4, {self.test['pairs']:,} pairs): BLEU {self.test['bleu']:.2f}, "
                         f"chrF {self.test['chrf']:.2f}")
        lines += [f"  {c}" for c in self.commands]
        return "\n".join(lines)


def start_line(start: dict, best: dict) -> str:
    """Fine-tuning's start -> best on validation, and whether any step beat the start."""
    key, name = ("bleu", "BLEU") if "bleu" in start else ("valid_nll", "validation nll")
    line = f"start -> best: {name} {start[key]:.2f} -> {best.get(key, start[key]):.2f}"
    if best.get("step") == 0:
        return line + " (no step beat the start: the model written is the starting model)"
    return line + f" (step {best['step']:,})" if "step" in best else line


# --- which run: the output_dir a run claims (a fresh run, a resume, or --overwrite) ------------------------------


def claim_output_dir(accelerator, cfg: TrainConfig) -> list[Path]:
    """The checkpoints to resume from, newest first (empty: a fresh run), once this run holds the output_dir's
    lock. A folder that holds a run is changed only by a resume from that run's own checkpoints: a fresh run, or a
    resume that finds none there (`auto` on a finished run whose checkpoints were deleted, a checkpoint of another
    folder), is refused, unless `overwrite` moves the old run aside first."""
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise NmtError(f"output_dir {out}: is a file; give a folder (it is made if missing)")
    check_checkpointable(accelerator)
    lock_output_dir(accelerator, out)
    check_shared_output_dir(accelerator, out)
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


def check_checkpointable(accelerator) -> None:
    """nmt's checkpoints hold no pickle. Under FSDP2 they are gathered whole (`nmt.training.fsdp`); FSDP1's and
    DeepSpeed's own checkpoints (torch.distributed.checkpoint's metadata, the engine's torch.save files) are
    pickles, so those two are refused before any work."""
    if is_fsdp(accelerator) and accelerator.is_fsdp2:
        return
    if is_fsdp(accelerator):
        raise NmtError("nmt train under FSDP version 1: nmt trains with FSDP2 only; set fsdp_version: 2 in the "
                       "accelerate config (accelerate_configs/fsdp.yaml)")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise NmtError("nmt train under DeepSpeed: its checkpoints are pickles, and nmt writes and reads none (a "
                       "checkpoint could run code when resumed); launch with accelerate_configs/fsdp.yaml (FSDP2 "
                       "shards parameters, gradients and optimizer state, as ZeRO-3 does) or multi_gpu.yaml (DDP)")


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


SEEN_WITHIN_S = 10.0  # a network file system may show a new file to the other nodes a few seconds late


def check_shared_output_dir(accelerator, out: Path) -> None:
    """Every process sees the folder the main process writes, or the run stops here on every process alike.
    The main process alone writes checkpoints, and every process reads them to resume: across nodes without a
    shared output_dir, node 1 would start fresh (`--resume auto`) while node 0 resumed. Proved with a fresh token
    that the main process writes beside the lock and every process reads back."""
    if accelerator.num_processes == 1:
        return
    probe = lock_file(out).with_suffix(".probe")
    box = [None]
    if accelerator.is_main_process:
        box[0] = secrets.token_hex(16)
        with atomic_file(probe) as f:
            f.write(box[0])
    broadcast_object_list(box)
    deadline = time.monotonic() + SEEN_WITHIN_S
    while not (seen := _reads(probe) == box[0]) and time.monotonic() < deadline:
        time.sleep(0.5)
    views = gather_object([(seen, socket.gethostname())])  # every process's, in rank order
    if accelerator.is_main_process:
        probe.unlink(missing_ok=True)
    blind = [f"{rank} on {host}" for rank, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise NmtError(f"output_dir {out}: process {', '.join(blind)} cannot see what the main process "
                       f"({views[0][1]}) writes there; every node reads the run's checkpoints from it, so give an "
                       "--output_dir on a file system all nodes share (NFS, Lustre, a cluster's scratch)")


def _reads(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


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


# --- resuming: the same run, the same data, a whole checkpoint -------------------------------------------------------


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


def check_same_data(path: Path, cfg: TrainConfig, corpus: Corpus) -> None:
    """Refuse to resume `path` on data other than it was trained on (the fingerprints it recorded), naming the
    splits, unless `allow_data_change`; and in every case under a tokenizer other than its own."""
    saved = ckpt.read_info(path).get(ckpt.FINGERPRINTS) or {}
    changed = ckpt.data_changes(saved, corpus.stats.fingerprints)
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
    if own is not None and not own.same_as(corpus.tokenizer):
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


def pick_checkpoint(accelerator, cfg: TrainConfig, objective, optim, found: list[Path]) -> Path:
    """The newest of `found` that is whole on every process, restored into `objective` and `optim`; damaged ones (a
    file unreadable, cut short, tampered with or a pickle) are named and passed over (an explicit path that is
    damaged stops with the name of the previous complete checkpoint)."""
    explicit = cfg.resume not in ("latest", "auto")
    newest = None
    for i, path in enumerate(found):
        problem = damage(path, accelerator.process_index) or restore(accelerator, cfg, objective, optim, path)
        problems = [p for p in gather_object([problem]) if p]
        if not problems:
            return path
        what = f"checkpoint {path} is damaged: {problems[0]}"
        newest = newest or what
        earlier = [p for p in ckpt.list_checkpoints(cfg.output_dir) if _step(p) < _step(path)]
        if explicit:
            hint = f"resume from {earlier[-1]} (--resume {earlier[-1]})" if earlier else "start a fresh run"
            raise NmtError(f"{what}; {hint}")
        if i + 1 < len(found):
            log.warning(f"{what}; falling back to {found[i + 1]}", main_process_only=True)
    raise NmtError(f"every checkpoint in {ckpt.checkpoints_dir(cfg.output_dir)} is damaged (newest: {newest}); "
                   "start over with --overwrite")


def restore(accelerator, cfg: TrainConfig, objective, optim, path: Path) -> str | None:
    """Checkpoint `path`'s weights, optimizer, schedule, loss scaler and this process's random states into the
    prepared `objective` and `optim`; what makes it damaged when it cannot be (nothing is applied then, but for
    weights read before a later file failed, which the checkpoint restored next replaces). Weights that do not fit
    the model stop the run, named."""
    optimizer, scheduler = optim.optimizer, optim.scheduler
    bare = accelerator.unwrap_model(objective, keep_torch_compile=False)  # as Run.bare_objective
    sharded = is_fsdp(accelerator)
    load_optimizer = (lambda saved: fsdp.load_full_optimizer_state(bare, optimizer, saved)) if sharded else None
    try:
        try:  # the weights first: another model size is named as such, not as a damaged optimizer state
            if sharded:
                fsdp.load_full_weights(bare, ckpt.read_weights(path))
            else:
                ckpt.load_weights(bare, path)
        except RuntimeError as e:  # weights of another model size: name the tensor, both shapes and the changed keys
            raise load_state_error(e, path, cfg) from None
        saved = ckpt.read_state(path, accelerator.process_index, optimizer, scheduler, accelerator.scaler)
        ckpt.apply_state(saved, optimizer, scheduler, accelerator.scaler, load_optimizer)
    except ckpt.StateDamage as e:
        return str(e)
    accelerator.step = saved.accelerator_step  # where gradient accumulation stands (Accelerate's own counter)
    return None


def _step(path: Path) -> int:
    m = ckpt.STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def resume(accelerator, cfg: TrainConfig, corpus: Corpus, objective, optim, sampler, found: list[Path]) -> TrainState:
    """The state the run continues from: model, optimizer, scheduler and random states restored into `objective`,
    `optim` and the process (safetensors and JSON, `restore`), the sampler's position into `sampler`, from the newest
    whole checkpoint of `found` that this run (`cfg`, on `corpus`) wrote; a fresh TrainState without `found`."""
    if not found:
        return TrainState()
    check_same_run(found[0], cfg)
    path = pick_checkpoint(accelerator, cfg, objective, optim, found)
    check_same_data(path, cfg, corpus)
    info = ckpt.read_info(path)
    state = TrainState(**info["state"])
    sampler.load_state_dict(state.sampler)
    if info.get("num_processes") not in (None, accelerator.num_processes):
        log.warning(f"{path} was written by {info['num_processes']} processes, resuming on {accelerator.num_processes}: "
                    "the data order differs from an uninterrupted run from here on", main_process_only=True)
    log.info(f"resumed from {path} at step {state.step}", main_process_only=True)
    return state


# --- what a run leaves on disk: the run directory, checkpoints, model directories ------------------------------------


def start_run(run: Run) -> None:
    """The run directory: metrics.jsonl trimmed to the step the run starts at, config.yaml, data.json, trackers."""
    accelerator, cfg, stats = run.accelerator, run.cfg, run.corpus.stats
    if run.is_main:
        run.out.mkdir(parents=True, exist_ok=True)
        trim_metrics(run.out / "metrics.jsonl", run.state.step)
        save_yaml(cfg, run.out / "config.yaml")
        (run.out / "data.json").write_text(json.dumps({**stats.as_dict(), ckpt.FINGERPRINTS: fingerprints(run)}, indent=2))
        n_params = sum(p.numel() for p in run.model.parameters())
        n_trained = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        trained = f" ({n_trained / 1e6:.3f}M trained: finetune)" if n_trained < n_params else ""
        print(f"nmt: {accelerator.num_processes} process(es) on {accelerator.device}, "
              f"precision {accelerator.mixed_precision}; {n_params / 1e6:.2f}M parameters{trained}; "
              f"pairs {stats.pairs}; cleaning dropped {stats.clean['dropped']}", flush=True)
        for line in (overlap_line(stats), corpora_line(stats)):
            if line:
                print(f"nmt: {line}", flush=True)
    if cfg.log_with:
        accelerator.init_trackers("nmt", config={k: v if isinstance(v, (int, float, str, bool)) else str(v)
                                                   for k, v in flat(to_dict(cfg)).items()})


def fingerprints(run: Run, directory: Path | None = None) -> dict:
    """sha256 of the run's data (per split, `nmt.data.split_fingerprints`) and of its tokenizer file(s): those in
    `directory`, or (None) as the run's tokenizer writes them."""
    tok = run.corpus.tokenizer
    if directory is not None:
        tokenizer = ckpt.tokenizer_sha256(directory)
    else:  # the text tokenizers' save writes: to_str(pretty=True)
        files = [tok.src] if tok.one_file else [tok.src, tok.tgt]
        tokenizer = ckpt.sha256_parts(t.to_str(pretty=True).encode() for t in files)
    return {**run.corpus.stats.fingerprints, "tokenizer": tokenizer}


def trim_metrics(path: Path, step: int) -> None:
    """Keep the rows up to `step` (where this run starts): after a kill, rows past the checkpoint are
    trained again, and a line cut off mid-write is dropped."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def save_plan(plan: planlib.Plan, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with atomic_file(out / PLAN_FILE) as f:
        f.write(json.dumps(plan.to_dict(), indent=2))


def load_plan(out: Path) -> planlib.Plan | None:
    """The saved plan of the run in `out`; for a run saved before plans recorded their choices, its resolved
    config.yaml stands in (every value it holds is taken as chosen then)."""
    path = out / PLAN_FILE
    if path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        if "chosen" in data:
            return planlib.Plan.from_dict(data)
    saved = out / "config.yaml"
    if not saved.is_file():
        return None
    from nmt.config import load_config

    old = load_config(saved)
    keys = planlib.KEYS
    return planlib.Plan(chosen={k: planlib.get(old, k) for k in keys}, reasons={k: "as the run was started" for k in keys})


def log_metrics(run: Run, metrics: dict) -> None:
    """Append to metrics.jsonl (always) and send to the trackers of `log_with`, at the run's current step."""
    if run.is_main:
        with open(run.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": run.state.step, **metrics}) + "\n")
    if run.cfg.log_with:
        run.accelerator.log(metrics, step=run.state.step)


def plain_weights(accelerator, objective, everywhere: bool = False) -> dict:
    """The model's full weights, named as in the bare model: under FSDP2 gathered on the main process (on every
    process if `everywhere`), every process taking part."""
    if is_fsdp(accelerator):
        return fsdp.full_weights(accelerator.unwrap_model(objective, keep_torch_compile=False), everywhere)
    return accelerator.get_state_dict(uncompiled(objective))


def save_checkpoint(run: Run) -> None:
    """The training state (`nmt.checkpoint.write_state`: weights, optimizer, schedule and random states, no pickle)
    and the run's tokenizer (a resume encodes with it, never training another) into a temporary folder, renamed
    to step_N once complete."""
    accelerator, state = run.accelerator, run.state
    final = ckpt.checkpoints_dir(run.out) / f"step_{state.step}"
    tmp = [ckpt.temp_dir_for(final)]  # the main process's name, shared by every process writing into it
    if accelerator.num_processes > 1:
        broadcast_object_list(tmp)
    tmp = tmp[0]
    accelerator.wait_for_everyone()
    weights = optimizer_state = None
    if is_fsdp(accelerator):  # every process takes part in the gather; the main one gets it all
        weights = fsdp.full_weights(run.bare_objective)
        optimizer_state = fsdp.full_optimizer_state(run.bare_objective, run.optim.optimizer)
    ckpt.write_state(tmp, accelerator.process_index, run.is_main, run.bare_objective, run.optim.optimizer,
                     run.optim.scheduler, accelerator.scaler, accelerator.step, weights, optimizer_state)
    accelerator.wait_for_everyone()
    if run.is_main:
        run.corpus.tokenizer.save(tmp)
        ckpt.mark_complete(tmp, {"step": state.step, "num_processes": accelerator.num_processes,
                                 "state": dataclasses.asdict(state), "config": to_dict(run.cfg),
                                 ckpt.FINGERPRINTS: fingerprints(run, tmp)})
        ckpt.publish(tmp, final)
        ckpt.prune(run.out, run.cfg.keep_last)
    accelerator.wait_for_everyone()


def save_model_dir(run: Run, final: Path, metrics: dict) -> None:
    """An inference-ready model directory, written atomically: weights, config, tokenizer, summary."""
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    weights = plain_weights(accelerator, run.objective)  # every process takes part
    if run.is_main:
        tmp = ckpt.temp_dir_for(final)
        tmp.mkdir(parents=True, exist_ok=True)
        if run.cfg.finetune.lora_r:  # the base weights as they are, and the adapter beside them
            save_adapted(run.model, tmp, weights)
        else:
            _save_weights(run.model, weights, tmp)
        if run.cfg.init_from:  # fine-tuning: the very files of the model it started from, byte for byte
            copy_tokenizer(Path(run.cfg.init_from), tmp)
        else:
            run.corpus.tokenizer.save(tmp)
        summary = {"step": run.state.step, "metrics": metrics, "data": run.corpus.stats.as_dict(), "argv": sys.argv,
                   "segmentation": segmentation(run.corpus.splits["train"]),  # what init_from compares with
                   "num_processes": accelerator.num_processes, "config": to_dict(run.cfg),
                   ckpt.FINGERPRINTS: fingerprints(run, tmp)}  # what loading compares (checkpoint.check_fingerprint)
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        data = run.cfg.data
        start = read_languages(run.cfg.init_from) if run.cfg.init_from else None
        if start and start.get("first_tokens"):  # an imported M2M100/NLLB: its language tokens stay the model's
            shutil.copy2(Path(run.cfg.init_from) / LANGUAGES_FILE, tmp / LANGUAGES_FILE)
        elif data.is_multilingual:  # what translate and serve check a requested target language against
            record = languages_record(data.pairs(), data.target_languages(), data.tags())
            (tmp / LANGUAGES_FILE).write_text(json.dumps(record, indent=2))
        ckpt.publish(tmp, final)
    del weights
    accelerator.wait_for_everyone()


def _save_weights(model, weights: dict, directory: Path) -> None:
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(directory, state_dict=weights)
    else:
        from safetensors.torch import save_model

        save_model(model, str(directory / WEIGHTS_FILE))


def copy_tokenizer(source: Path, target: Path) -> None:
    """The tokenizer file(s) of model directory `source` into `target`, unchanged."""
    for name in (JOINT_FILE, SRC_FILE, TGT_FILE):
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)


def segmentation(ds) -> dict:
    """Subwords per whitespace word and the <unk> share, source and target, over the first SAMPLE pairs of an
    encoded split: how well a tokenizer fits a corpus (more subwords per word: over-segmented)."""
    part = ds.select(range(min(len(ds), SAMPLE)))
    out = {}
    for side, text, ids in (("src", "src", "src_ids"), ("tgt", "tgt", "tgt_ids")):
        subwords = [row[:-1] if side == "src" else row for row in part[ids]]  # the source's </s> not counted
        n = sum(len(x) for x in subwords)
        words = sum(len(t.split()) for t in part[text])
        out[side] = {"subwords_per_word": round(n / max(words, 1), 3),
                     "unk_rate": sum(x.count(UNK) for x in subwords) / max(n, 1)}
    return out


def publish_final(run: Run) -> Path:
    """model/ as a copy of best/ (the kept model); its path."""
    best, final = run.out / "best", run.out / "model"
    if run.is_main and best.is_dir():
        tmp = ckpt.temp_dir_for(final)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(best, tmp)
        ckpt.publish(tmp, final)
    run.accelerator.wait_for_everyone()
    return final
