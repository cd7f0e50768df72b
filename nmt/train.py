"""The training loop on Accelerate: data, model, AdamW with inverse-sqrt warmup, validation, checkpoints.

`train(cfg)` is a plain function; state lives in Accelerate (`save_state` with the registered
sampler and `TrainState`). The same code runs on 1 process, N processes or N nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from nmt import checkpoint as ckpt
from nmt.batching import TokenBatchSampler, eval_batches
from nmt.collate import Collator
from nmt.config import TrainConfig, pin_sizes, read_yaml, resolve_sizes, save_yaml, to_dict
from nmt.data import Corpus, bpe_dropout, pair_lengths, prepare
from nmt.errors import NmtError
from nmt.loss import label_smoothed_nll
from nmt.metrics import corpus_scores
from nmt.model import Seq2SeqTransformer
from nmt.search import SEARCH_FILE, SearchConfig
from nmt.tokenizer import PairTokenizer
from nmt.translate import search_encoded

log = get_logger(__name__)


@dataclass
class TrainState:
    """What the loop itself must remember across a resume, stored as JSON beside Accelerate's state.

    Not `register_for_checkpointing`: Accelerate unpickles custom objects with weights_only=False,
    so a tampered checkpoint could run code on resume. JSON cannot.
    """

    step: int = 0
    best_score: float = -math.inf  # validation BLEU, or minus the validation loss for models without search
    best_step: int = -1
    evals_since_best: int = 0  # for early stopping
    tokens_seen: int = 0
    skipped_steps: int = 0  # steps whose loss or gradient was not finite (no update made)
    bad_in_row: int = 0
    sampler: dict = field(default_factory=dict)  # TokenBatchSampler.state_dict(): epoch and position


@dataclass
class TrainResult:
    model_dir: Path | None  # the final model: config.json, model.safetensors, tokenizer.json, training.json
    steps: int
    best: dict = field(default_factory=dict)  # validation metrics of the kept model
    stopped_by: str | None = None  # "SIGTERM"/"SIGINT" when a signal ended the run early (no final model)
    checkpoint: Path | None = None  # the last checkpoint written

    def summary(self) -> str:
        """One line for the terminal."""
        if self.stopped_by:
            return (f"stopped by {self.stopped_by} after step {self.steps}; checkpoint {self.checkpoint}. "
                    "Resume: run the same command with --resume latest")
        best = ", ".join(f"{k} {v:.2f}" for k, v in self.best.items() if isinstance(v, float))
        return f"model saved to {self.model_dir} after {self.steps} steps; best validation: {best}"


def train(cfg: TrainConfig, model: torch.nn.Module | None = None) -> TrainResult:
    """Train a model as `cfg` says; `model` (optional) is your own nn.Module following the contract
    `forward(src_ids, tgt_in_ids) -> logits (B, T, V)`. Returns where the final model was saved.

    In a single process (a notebook, a script) Accelerate's process-wide state is cleared again at the
    end, so train() can be called again with other settings, or followed by notebook_launcher.
    """
    from accelerate.state import AcceleratorState, GradientState, PartialState

    fresh = not PartialState._shared_state
    try:
        return _train(cfg, model)
    finally:
        if fresh and PartialState._shared_state and PartialState().num_processes == 1:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def check_trackers(names: list) -> None:
    """Every `log_with` name must be a tracker accelerate knows and whose package is installed: accelerate
    itself drops an unavailable one with a debug message, and the run would log nowhere without a word."""
    import accelerate.utils
    from accelerate.utils import LoggerType

    known = {t.value for t in LoggerType} - {"all"}
    for name in (n for n in names if isinstance(n, str)):  # tracker objects (GeneralTracker) pass as they are
        if name not in known:
            raise NmtError(f"log_with: unknown tracker '{name}'; accelerate knows {', '.join(sorted(known))}")
        if not getattr(accelerate.utils, f"is_{name}_available")():
            raise NmtError(f"log_with: tracker '{name}' is not installed; pip install {name} "
                           "(or remove it: metrics.jsonl is always written)")


def _train(cfg: TrainConfig, model: torch.nn.Module | None) -> TrainResult:
    check_trackers(cfg.log_with)
    accelerator = Accelerator(
        # without a GPU, processes started by torchrun (accelerate launch) must still join one gloo group
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=cfg.accum_steps,
        log_with=cfg.log_with or None,
        project_dir=cfg.output_dir,
        # batches are sharded by our own sampler, so one scheduler step per optimizer step
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    set_seed(cfg.seed)
    if cfg.resume and (Path(cfg.output_dir) / "config.yaml").is_file():
        cfg = pin_sizes(cfg, read_yaml(Path(cfg.output_dir) / "config.yaml"))  # the sizes the run was started with
    corpus = prepare(cfg.data, cfg.tokenizer, accelerator.main_process_first)
    cfg = sized_config(accelerator, cfg, corpus)
    model = model if model is not None else Seq2SeqTransformer(cfg.model)
    check_contract(model, corpus.tokenizer)
    if cfg.compile:  # in place: the module keeps its type, state_dict keys and save/load
        model.compile()
    dropout = bpe_dropout(cfg, corpus)
    sampler = TokenBatchSampler(corpus.splits["train"]["cost"], cfg.max_tokens, accelerator.process_index,
                                accelerator.num_processes, cfg.accum_steps, cfg.seed,
                                ties=pair_lengths(corpus.splits["train"])[0],  # source lengths: less padding
                                epoch_lengths=dropout.lengths if dropout else None)
    plain = corpus.splits["train"].select_columns(["src_ids", "tgt_ids"])
    # no worker processes: the BPE-dropout view reads sampler.epoch when a batch is fetched
    loader = DataLoader(dropout.view(lambda: sampler.epoch) if dropout else plain, batch_sampler=sampler,
                        collate_fn=Collator(pad_to_multiple_of=cfg.pad_to_multiple_of),
                        # its own generator: each new iterator draws a seed, and drawing it from the global
                        # RNG would shift dropout after a resume (which starts a fresh iterator mid-epoch)
                        generator=torch.Generator())
    optimizer = make_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(cfg.optim.warmup_steps))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    register_search_methods(accelerator, model)
    state = resume(accelerator, cfg, sampler) if cfg.resume else TrainState()
    # epoch 0's steps: under BPE-dropout epochs differ by a few steps, and a resumed run must count the same total
    total = cfg.max_steps or cfg.max_epochs * sampler.steps_per_epoch(0)
    start_run(accelerator, cfg, corpus, model, state.step)
    with StopSignals() as signals:
        stopped_by = run_loop(accelerator, cfg, model, optimizer, scheduler, loader, sampler, state, corpus, total,
                              signals)
    if stopped_by in ("SIGTERM", "SIGINT"):
        accelerator.end_training()
        return TrainResult(None, state.step, stopped_by=stopped_by, checkpoint=ckpt.list_checkpoints(cfg.output_dir)[-1])
    return finish(accelerator, cfg, model, corpus, state)


def sized_config(accelerator: Accelerator, cfg: TrainConfig, corpus: Corpus) -> TrainConfig:
    """`cfg` with every size resolved: the tokenizer and model sizes it leaves null chosen from the number of
    training pairs (`auto_sizes`, printed), the model's vocabulary sizes from the tokenizer."""
    cfg, chosen = resolve_sizes(cfg, corpus.stats["sizing_pairs"])
    if chosen and accelerator.is_main_process:
        print(f"nmt: sizes chosen for {corpus.stats['sizing_pairs']:,} training pairs (auto_sizes; set them to "
              f"override): {'; '.join(chosen)}", flush=True)
    model_cfg = dataclasses.replace(cfg.model, src_vocab_size=corpus.tokenizer.src_vocab_size,
                                    tgt_vocab_size=corpus.tokenizer.tgt_vocab_size,
                                    share_embeddings=cfg.model.share_embeddings and corpus.tokenizer.joint)
    return dataclasses.replace(cfg, model=model_cfg)


def resume(accelerator: Accelerator, cfg: TrainConfig, sampler: TokenBatchSampler) -> TrainState:
    """Restore model, optimizer, scheduler and RNG (Accelerate, weights_only loads) and our JSON state."""
    path = ckpt.resolve_resume(cfg.resume, cfg.output_dir)
    accelerator.load_state(str(path))
    info = ckpt.read_info(path)
    state = TrainState(**info["state"])
    sampler.load_state_dict(state.sampler)
    if info.get("num_processes") not in (None, accelerator.num_processes):
        log.warning(f"{path} was written by {info['num_processes']} processes, resuming on {accelerator.num_processes}: "
                    "the data order differs from an uninterrupted run from here on", main_process_only=True)
    log.info(f"resumed from {path} at step {state.step}", main_process_only=True)
    return state


class StopSignals:
    """SIGTERM/SIGINT (preemption, Ctrl-C): the first asks the loop to stop after the current step and
    checkpoint; a second one exits at once. Only installed in the main thread.

    A repeat within `echo_s` seconds counts as the same event: under SLURM every process gets SIGTERM and
    the launcher (torchrun) forwards its own copy to the workers a moment later.
    """

    echo_s = 1.0

    def __init__(self):
        self.received: str | None = None
        self.at = 0.0
        self.previous: dict = {}

    def __enter__(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            if time.monotonic() - self.at < self.echo_s:
                return
            os._exit(128 + signum)
        self.received, self.at = signal.Signals(signum).name, time.monotonic()
        print(f"\nnmt: {self.received} received: finishing this step and saving a checkpoint "
              "(send it again to exit at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def register_search_methods(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Under FSDP2 a module's sharded weights are gathered only inside forward(); validation search calls
    encode/decode/start_cache, so FSDP is told to gather around those methods too."""
    if accelerator.distributed_type.value != "FSDP":
        return
    from torch.distributed.fsdp import register_fsdp_forward_method

    base = accelerator.unwrap_model(model)
    for name in ("encode", "decode", "start_cache"):
        if hasattr(base, name):
            register_fsdp_forward_method(base, name)
    for module in base.modules():
        if hasattr(module, "cross_kv"):  # a decoder layer: called outside forward when a cache starts
            register_fsdp_forward_method(module, "cross_kv")


def check_contract(model: torch.nn.Module, tokenizer: PairTokenizer) -> None:
    """A clear error when a user's model does not follow forward(src_ids, tgt_in_ids) -> (B, T, V)."""
    if not isinstance(model, torch.nn.Module):
        raise NmtError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    name = type(model).__name__
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 2:
        raise NmtError(f"{name}.forward must take exactly (src_ids, tgt_in_ids) and derive masks itself; "
                       f"it requires {[p.name for p in params]}")
    src = torch.tensor([[5, 6, 3]])
    tgt = torch.tensor([[2, 5]])
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(src.to(device), tgt.to(device))
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or tuple(out.shape[:2]) != (1, 2):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise NmtError(f"{name}.forward(src_ids (1,3), tgt_in_ids (1,2)) returned {shape}; expected logits (1, 2, V)")
    if out.shape[2] != tokenizer.tgt_vocab_size:
        raise NmtError(f"{name} predicts {out.shape[2]} classes but the target vocabulary has "
                       f"{tokenizer.tgt_vocab_size} tokens; build it with tgt_vocab_size={tokenizer.tgt_vocab_size}")
    for attr in ("pad_id", "bos_id", "eos_id"):
        if not hasattr(getattr(model, "cfg", None), attr) and not hasattr(model, attr):
            raise NmtError(f"{name} needs an attribute {attr} (or cfg.{attr}); nmt's tokenizers use pad 0, bos 2, eos 3")


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; the fused kernel where this torch has one for the device."""
    o = cfg.optim
    kwargs = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    try:
        return torch.optim.AdamW(model.parameters(), fused=True, **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(model.parameters(), **kwargs)


def inverse_sqrt(warmup: int):
    """lr factor: linear warmup to 1 over `warmup` steps, then sqrt(warmup / step)."""
    warmup = max(warmup, 1)
    return lambda step: min((step + 1) / warmup, math.sqrt(warmup / (step + 1)))


def start_run(accelerator: Accelerator, cfg: TrainConfig, corpus: Corpus, model, step: int) -> None:
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        trim_metrics(out / "metrics.jsonl", step)
        save_yaml(cfg, out / "config.yaml")
        (out / "data.json").write_text(json.dumps(corpus.stats, indent=2))
        n_params = sum(p.numel() for p in model.parameters())
        print(f"nmt: {accelerator.num_processes} process(es) on {accelerator.device}, "
              f"precision {accelerator.mixed_precision}; {n_params / 1e6:.2f}M parameters; "
              f"pairs {corpus.stats['pairs']}; cleaning dropped {corpus.stats['clean']['dropped']}", flush=True)
    if cfg.log_with:
        accelerator.init_trackers("nmt", config=_flat(to_dict(cfg)))


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


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def micro_batches(loader: DataLoader):
    """Endless micro-batches; each pass over the loader finishes an epoch (the sampler advances it)."""
    while True:
        yield from loader


def run_loop(accelerator, cfg, model, optimizer, scheduler, loader, sampler, state, corpus, total,
             signals: StopSignals) -> str | None:
    """Train until `total` steps; returns why it stopped early ("SIGTERM", "SIGINT", "time"), or None."""
    batches = micro_batches(loader)
    meter, started, rate = Meter(), time.monotonic(), TokenRate()
    bar = progress(accelerator, total, state.step)
    stopped_by = None
    while state.step < total and stopped_by is None:
        step_start = time.perf_counter()
        window = [to_device(next(batches), accelerator.device) for _ in range(cfg.accum_steps)]
        out_of_time = cfg.max_minutes is not None and time.monotonic() - started > 60 * cfg.max_minutes
        stats = train_step(accelerator, cfg, model, optimizer, scheduler, window, stop=bool(signals.received) or out_of_time)
        state.step += 1
        state.tokens_seen += stats["tokens"]
        state.sampler = sampler.state_dict()
        note_finite(accelerator, cfg, state, stats["finite"])
        meter.add(stats)
        # refresh=False: the line is redrawn by update() at most every 0.1 s, not on every step
        bar.set_postfix({"epoch": sampler.epoch, "loss": f"{stats['loss']:.3f}", "lr": f"{scheduler.get_last_lr()[0]:.2e}",
                         "tok/s": rate.update(stats["tokens"], time.perf_counter() - step_start)}, refresh=False)
        bar.update(1)
        if stats["stop"]:  # any process was signalled or is out of time: all stop after this same step
            stopped_by = signals.received or ("time" if out_of_time else "SIGTERM")
        last = state.step == total or stopped_by == "time"
        if state.step % cfg.log_every == 0 or last:
            log_metrics(accelerator, cfg, {**meter.flush(), "lr": scheduler.get_last_lr()[0], "epoch": sampler.epoch,
                                           "skipped_steps": state.skipped_steps}, state.step)
        if (state.step % cfg.eval_every == 0 or last) and stopped_by in (None, "time"):
            evaluate_and_keep_best(accelerator, cfg, model, corpus, state)
            if cfg.patience is not None and state.evals_since_best >= cfg.patience and not last:
                stopped_by = "patience"  # no better validation score for `patience` evaluations
                log.info(f"early stop at step {state.step}: best was step {state.best_step}", main_process_only=True)
        if state.step % cfg.save_every == 0 or last or stopped_by:
            save_checkpoint(accelerator, cfg, state)
    bar.close()
    return stopped_by


def note_finite(accelerator, cfg: TrainConfig, state: TrainState, finite: bool) -> None:
    """Count skipped (non-finite) steps; too many in a row stop training with a checkpoint and a message."""
    if finite:
        state.bad_in_row = 0
        return
    state.skipped_steps += 1
    state.bad_in_row += 1
    log.warning(f"step {state.step}: non-finite loss or gradient, update skipped "
                f"({state.skipped_steps} so far, {state.bad_in_row} in a row)", main_process_only=True)
    if state.bad_in_row >= cfg.max_bad_steps:
        save_checkpoint(accelerator, cfg, state)
        raise NmtError(f"stopped at step {state.step}: {state.bad_in_row} steps in a row had a non-finite loss or "
                       f"gradient (the weights are those of the last good step, saved in "
                       f"{ckpt.checkpoints_dir(cfg.output_dir)}); lower optim.lr, check the data, or use bf16 "
                       "instead of fp16")


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@functools.cache
def warn_if_bf16_is_slow(device_type: str, mixed_precision: str) -> None:
    """Once per process: bf16 autocast on a CPU without bf16 matmul kernels (oneDNN's need AVX512 or AMX;
    otherwise torch multiplies bf16 in a plain loop, 1-2 GFLOP/s against ~30 in fp32 on one AVX2 core)."""
    if device_type == "cpu" and mixed_precision == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        log.warning("mixed_precision bf16 on a CPU without bf16 matmul units (no AVX512/AMX): training runs "
                    "~15x slower than in fp32; use an fp32 profile (accelerate_configs/cpu.yaml)", main_process_only=True)


def train_step(accelerator, cfg: TrainConfig, model, optimizer, scheduler, window: list[dict],
               stop: bool = False) -> dict:
    """One optimizer step over this process's micro-batches.

    Each micro-batch's summed loss is divided by the target tokens of the whole step on all processes;
    DDP's mean over processes and accelerate's division by accum_steps are undone by the factor, so
    the gradient equals the one-process, no-accumulation gradient of the same global batch.
    A step whose gradient is not finite makes no update (under fp16 the loss scaler skips it and
    lowers its scale). `stop` (this process wants to stop) is shared with all processes.
    """
    model.train()
    warn_if_bf16_is_slow(accelerator.device.type, str(accelerator.mixed_precision))
    local = sum(int(b["labels"].ne(0).sum()) for b in window)
    n_tokens = int(accelerator.reduce(torch.tensor(local, device=accelerator.device), "sum"))
    scale = accelerator.num_processes * cfg.accum_steps / max(n_tokens, 1)
    loss_sum = nll_sum = 0.0
    grad_norm, finite = None, True
    # nmt's own model scores the labels inside forward (no (B, T, V) logits); others return logits
    own = isinstance(accelerator.unwrap_model(model, keep_torch_compile=False), Seq2SeqTransformer)
    for batch in window:
        with accelerator.accumulate(model):
            if own:
                loss, nll, _ = model(batch["src_ids"], batch["tgt_in_ids"], labels=batch["labels"],
                                     label_smoothing=cfg.optim.label_smoothing)
            else:
                logits = model(batch["src_ids"], batch["tgt_in_ids"])
                loss, nll, _ = label_smoothed_nll(logits, batch["labels"], 0, cfg.optim.label_smoothing)
            accelerator.backward(loss * scale)
            loss_sum, nll_sum = loss_sum + float(loss.detach()), nll_sum + float(nll)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.clip_norm or math.inf)
                finite = grad_norm is None or math.isfinite(float(grad_norm))  # the same on every process
                if finite or accelerator.scaler is not None:
                    optimizer.step()
                    scheduler.step()
                    finite = finite and not optimizer.step_was_skipped
                optimizer.zero_grad(set_to_none=True)
    sums = accelerator.reduce(torch.tensor([loss_sum, nll_sum, float(stop)], device=accelerator.device), "sum")
    return {"loss": float(sums[0]) / max(n_tokens, 1), "nll": float(sums[1]) / max(n_tokens, 1),
            "tokens": n_tokens, "grad_norm": None if grad_norm is None else float(grad_norm),
            "finite": finite, "stop": bool(sums[2] > 0)}


class Meter:
    """Averages of training statistics between two log lines, and throughput."""

    def __init__(self):
        self.start, self.loss, self.nll, self.tokens, self.steps = time.perf_counter(), 0.0, 0.0, 0, 0

    def add(self, stats: dict) -> None:
        self.loss += stats["loss"] * stats["tokens"]
        self.nll += stats["nll"] * stats["tokens"]
        self.tokens += stats["tokens"]
        self.steps += 1

    def flush(self) -> dict:
        elapsed = time.perf_counter() - self.start
        n = max(self.tokens, 1)
        out = {"loss": self.loss / n, "nll": self.nll / n, "ppl": math.exp(min(self.nll / n, 50)),
               "tokens_per_s": self.tokens / max(elapsed, 1e-9), "steps_per_s": self.steps / max(elapsed, 1e-9)}
        self.__init__()
        return out


def progress(accelerator, total: int, initial: int):
    """The main process's one live line: `train: 40%|...| 200/500 [01:10<01:45, 2.9step/s, epoch=3, loss=3.412,
    lr=1.2e-03, tok/s=14210]` (steps done/total, elapsed<ETA, then the postfix set by run_loop). Other ranks are silent."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not accelerator.is_main_process, desc="train", unit="step",
                dynamic_ncols=True, file=sys.stderr)


class TokenRate:
    """Target tokens per second of the training steps themselves (validation and checkpoints not counted),
    smoothed exponentially as tqdm smooths its own rate."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing, self.value = smoothing, None

    def update(self, tokens: int, seconds: float) -> str:
        now = tokens / max(seconds, 1e-9)
        self.value = now if self.value is None else self.smoothing * now + (1 - self.smoothing) * self.value
        return f"{self.value:.0f}"


def log_metrics(accelerator, cfg: TrainConfig, metrics: dict, step: int) -> None:
    """Append to metrics.jsonl (always) and send to the trackers of `log_with`."""
    if accelerator.is_main_process:
        with open(Path(cfg.output_dir) / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
    if cfg.log_with:
        accelerator.log(metrics, step=step)


@torch.no_grad()
def validate(accelerator, cfg: TrainConfig, model, corpus: Corpus) -> dict:
    """Validation loss/perplexity and BLEU/chrF over exactly the validation set, on all processes."""
    model.eval()
    valid = corpus.splits["valid"]
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    collate, columns = Collator(), valid.select_columns(["src_ids", "tgt_ids"])
    for batch in eval_batches(valid["cost"], cfg.max_tokens, rank, world):
        rows = columns[batch.tolist()]
        b = to_device(collate([{"src_ids": s, "tgt_ids": t} for s, t in zip(rows["src_ids"], rows["tgt_ids"])]), device)
        _, nll, n = label_smoothed_nll(model(b["src_ids"], b["tgt_in_ids"]), b["labels"], 0, 0.0)
        sums += torch.tensor([float(nll), n], dtype=torch.float64, device=device)
    sums = accelerator.reduce(sums, "sum")
    metrics = {"valid_nll": float(sums[0] / sums[1]), "valid_ppl": math.exp(min(float(sums[0] / sums[1]), 50))}
    metrics.update(valid_bleu(accelerator, cfg, model, corpus))
    return metrics


def valid_bleu(accelerator, cfg: TrainConfig, model, corpus: Corpus) -> dict:
    """Decode this process's share of the validation sources, gather all, score once."""
    base = accelerator.unwrap_model(model)
    if not (hasattr(base, "encode") and hasattr(base, "decode")):
        return {}  # a user's model without encode/decode: loss only
    rank, world = accelerator.process_index, accelerator.num_processes
    if accelerator.distributed_type.value == "FSDP":
        # sharded weights: decode with a gathered full copy on the main process (validation only)
        base, rank, world = gathered_copy(accelerator, model, base), 0, 1
    return score_valid(accelerator, cfg, base, corpus, SearchConfig(beam_size=cfg.eval_beam), rank, world)


def score_valid(accelerator, cfg: TrainConfig, base, corpus: Corpus, search: SearchConfig, rank: int,
                world: int) -> dict:
    """BLEU/chrF of `base` (an unwrapped model, or None on processes that decode nothing) searching with
    `search` on the validation set: this process decodes share `rank` of `world`, the main one scores."""
    valid = corpus.splits["valid"]
    n = min(len(valid), cfg.eval_max_sentences or len(valid))
    src_ids = valid.select(range(n))["src_ids"]
    found = {} if base is None else search_encoded(base, src_ids, search, cfg.max_tokens, rank, world,
                                                   accelerator.device)
    mine = [(i, hyps[0].tokens) for i, hyps in found.items()]
    gathered = dict(accelerator.gather_for_metrics(mine, use_gather_object=True))  # index -> tokens, each once
    hyps = corpus.tokenizer.decode_tgt([gathered[i] for i in range(n)])
    scores = corpus_scores(hyps, valid.select(range(n))["tgt"])
    return {"bleu": scores["bleu"], "chrf": scores["chrf"], "bleu_signature": scores["bleu_signature"]}


def try_average(accelerator, cfg: TrainConfig, model, corpus: Corpus, state: TrainState) -> None:
    """Average the last `average_last` checkpoints; it replaces best/ when it validates at least as well."""
    from nmt.average import average_weights, load_into

    found = ckpt.list_checkpoints(cfg.output_dir)[-cfg.average_last:]
    if len(found) < 2 or accelerator.distributed_type.value == "FSDP":
        if accelerator.distributed_type.value == "FSDP":
            log.warning("average_last is not supported under FSDP yet: use `nmt average` on the checkpoints")
        return
    base = accelerator.unwrap_model(model)
    load_into(base, average_weights(found))  # every process loads the same files, so all agree
    metrics = validate(accelerator, cfg, model, corpus)
    score = metrics.get("bleu", -metrics["valid_nll"])
    names = ", ".join(d.name for d in found)
    if accelerator.is_main_process:
        print(f"average of {names}: " + " ".join(f"{k} {v:.2f}" for k, v in metrics.items() if isinstance(v, float))
              + f" (best single: {state.best_score:.2f})", file=sys.stderr, flush=True)
    if score >= state.best_score:
        state.best_score = score
        save_model_dir(accelerator, cfg, model, corpus, Path(cfg.output_dir) / "best",
                       {**metrics, "averaged": names}, state)


def gathered_copy(accelerator, model, base):
    """On the main process, an unsharded copy of an FSDP model (None elsewhere)."""
    state = accelerator.get_state_dict(model)  # every process takes part; the full weights land on the main one
    if not accelerator.is_main_process:
        return None
    copy = type(base)(base.cfg).to(accelerator.device)
    copy.load_state_dict(state)
    return copy.eval()


def evaluate_and_keep_best(accelerator, cfg: TrainConfig, model, corpus: Corpus, state: TrainState) -> None:
    metrics = validate(accelerator, cfg, model, corpus)
    score = metrics.get("bleu", -metrics["valid_nll"])
    improved = score > state.best_score
    state.evals_since_best = 0 if improved else state.evals_since_best + 1
    if improved:
        state.best_score, state.best_step = score, state.step
        save_model_dir(accelerator, cfg, model, corpus, Path(cfg.output_dir) / "best", metrics, state)
    log_metrics(accelerator, cfg, {k: v for k, v in metrics.items() if not isinstance(v, str)}, state.step)
    if accelerator.is_main_process:
        shown = " ".join(f"{k} {v:.2f}" for k, v in metrics.items() if isinstance(v, float))
        print(f"\nvalid @ step {state.step}: {shown}{' (best)' if improved else ''}", file=sys.stderr, flush=True)


def save_model_dir(accelerator, cfg: TrainConfig, model, corpus: Corpus, final: Path, metrics: dict,
                   state: TrainState) -> None:
    """An inference-ready model directory, written atomically: weights, config, tokenizer, summary."""
    accelerator.wait_for_everyone()
    weights = accelerator.get_state_dict(model)  # full weights on the main process (FSDP/DeepSpeed too)
    if accelerator.is_main_process:
        tmp = ckpt.temp_dir_for(final)
        tmp.mkdir(parents=True, exist_ok=True)
        base = accelerator.unwrap_model(model)
        if hasattr(base, "save_pretrained"):
            base.save_pretrained(tmp, state_dict=weights)
        else:
            from safetensors.torch import save_model
            save_model(base, str(tmp / "model.safetensors"))
        corpus.tokenizer.save(tmp)
        summary = {"step": state.step, "metrics": metrics, "data": corpus.stats, "argv": sys.argv,
                   "num_processes": accelerator.num_processes, "config": to_dict(cfg)}
        (tmp / "training.json").write_text(json.dumps(summary, indent=2))
        ckpt.publish(tmp, final)
    del weights
    accelerator.wait_for_everyone()


class _TiedEmbeddingNotice(logging.Filter):
    """Drops accelerate's "Removed shared tensor {'src_embed.weight'} while saving" warning, printed at every
    checkpoint: the shared embedding is stored once on purpose and tied again when the model is built."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removed shared tensor {'src_embed.weight'}" not in record.getMessage()  # after a [RANK n] prefix


def save_checkpoint(accelerator, cfg: TrainConfig, state: TrainState) -> None:
    """accelerator.save_state into a temporary folder, renamed to step_N once complete."""
    final = ckpt.checkpoints_dir(cfg.output_dir) / f"step_{state.step}"
    tmp = ckpt.temp_dir_for(final)
    accelerator.wait_for_everyone()
    notice, quiet = logging.getLogger("accelerate.utils.other"), _TiedEmbeddingNotice()
    notice.addFilter(quiet)  # only around save_state: nmt leaves the logging of its host program alone
    try:
        accelerator.save_state(str(tmp))
    finally:
        notice.removeFilter(quiet)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        ckpt.mark_complete(tmp, {"step": state.step, "num_processes": accelerator.num_processes,
                                 "state": dataclasses.asdict(state)})
        ckpt.publish(tmp, final)
        ckpt.prune(cfg.output_dir, cfg.keep_last)
    accelerator.wait_for_everyone()


def finish(accelerator, cfg: TrainConfig, model, corpus: Corpus, state: TrainState) -> TrainResult:
    """The final model directory: the checkpoint average if asked for and no worse, else best/."""
    out = Path(cfg.output_dir)
    best, final = out / "best", out / "model"
    if cfg.average_last > 1:
        try_average(accelerator, cfg, model, corpus, state)
    if accelerator.is_main_process and best.is_dir():
        tmp = ckpt.temp_dir_for(final)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(best, tmp)
        ckpt.publish(tmp, final)
    accelerator.wait_for_everyone()
    tuned = tune_alpha(accelerator, cfg, model, corpus, final, state) if cfg.tune_alpha else {}
    accelerator.end_training()
    summary = json.loads((final / "training.json").read_text())
    return TrainResult(final, state.step, {**summary["metrics"], **tuned})


@torch.no_grad()
def tune_alpha(accelerator, cfg: TrainConfig, model, corpus: Corpus, model_dir: Path, state: TrainState) -> dict:
    """Decode the validation set with the model kept in `model_dir`, with beam eval_beam, once for each length
    penalty of cfg.tune_alpha and the default; the best BLEU's alpha (`best_alpha`) is written to
    `model_dir/search.json`, where Translator takes its default alpha from, and logged to metrics.jsonl."""
    if not isinstance(accelerator.unwrap_model(model), Seq2SeqTransformer):
        log.warning("tune_alpha: only nmt's own model can be reloaded for tuning; skipped", main_process_only=True)
        return {}
    kept = Seq2SeqTransformer.from_pretrained(model_dir).to(accelerator.device).eval()  # every process: its share
    default = SearchConfig().alpha
    bleu = {}
    for alpha in sorted({*cfg.tune_alpha, default}):
        search = SearchConfig(beam_size=cfg.eval_beam, alpha=alpha)
        bleu[alpha] = score_valid(accelerator, cfg, kept, corpus, search, accelerator.process_index,
                                  accelerator.num_processes)["bleu"]
    alpha = best_alpha(bleu, default)
    if accelerator.is_main_process:
        n = min(len(corpus.splits["valid"]), cfg.eval_max_sentences or len(corpus.splits["valid"]))
        found = {"alpha": alpha, "beam_size": cfg.eval_beam, "tuned_on": f"{n} validation pairs",
                 "bleu": {str(a): b for a, b in bleu.items()}}
        tmp = model_dir / f".{SEARCH_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(found, indent=2))
        os.replace(tmp, model_dir / SEARCH_FILE)
        print(f"length penalty tuned on validation (beam {cfg.eval_beam}): alpha {alpha} "
              f"(BLEU {bleu[alpha]:.2f}; " + ", ".join(f"{a}: {b:.2f}" for a, b in bleu.items()) + ")",
              file=sys.stderr, flush=True)
    log_metrics(accelerator, cfg, {"tuned_alpha": alpha, "tuned_alpha_bleu": bleu[alpha],
                                   "default_alpha_bleu": bleu[default]}, state.step)
    accelerator.wait_for_everyone()
    return {"alpha": alpha}


def best_alpha(bleu: dict[float, float], default: float) -> float:
    """The alpha of the highest BLEU; among equals the default, else the one nearest to it (then the smaller)."""
    top = max(bleu.values())
    return min((a for a, b in bleu.items() if b == top), key=lambda a: (abs(a - default), a))
