"""The one timing probe, and the config resolved with it: what `train` and `nmt check` both call, so the check
shows the plan that training follows.

- `planned`: a config's open fields resolved for a prepared corpus (`nmt.plan.resolve`), with the speed timed here
  when a time budget needs it: a `Planned` (the config and its plan); `facts`, the corpus's side of the plan.
- `speed_probe`: seconds per cost token of training a model shape in batches of a size, timed on real batches.
- `time_steps`: optimizer steps taken exactly as training takes them (`nmt.training.loop.train_step` on
  `OneDevice`), timed, with warm-ups and compile's first steps left out; `batches` collates their windows.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from nmt import plan as planlib
from nmt.batching import Collator, TokenBatchSampler
from nmt.compat import graphs_compiled
from nmt.config import ModelConfig, TrainConfig
from nmt.errors import NmtError
from nmt.kernels import use_attention_path, use_cpu_kernels
from nmt.model import Seq2SeqTransformer
from nmt.tables import column
from nmt.training import loop as training_loop
from nmt.training.loop import OneDevice, default_device, make_objective, make_optim

PROBE_STEPS = 3  # timed steps after one untimed warm-up
PROBE_BUDGET_S = 30.0  # a probe stops early once its timed steps have taken this long
COMPILE_WARMUPS = 2  # under compile, steps that compiled are not timed: the first shape, then the dynamic one


class Planned(NamedTuple):
    """A config with its open fields resolved, and the plan saying what was chosen and why."""

    cfg: TrainConfig
    plan: planlib.Plan


def planned(cfg: TrainConfig, corpus, *, processes: int = 1, device: str | None = None, precision: str = "no",
            inherited: dict[str, str] | None = None, previous: planlib.Plan | None = None,
            minutes_left: float | None = None, timed: bool = True) -> Planned:
    """`cfg` resolved for `corpus` (`nmt.plan.resolve`) with the speed timed here when a time budget needs it."""
    # a resumed run's plan is kept as it was: nothing is timed again
    speed = speed_probe(cfg, corpus, device, precision) if timed and cfg.max_minutes and previous is None else None
    cfg, plan = planlib.resolve(cfg, facts(cfg, corpus, processes), speed=speed, processes=processes,
                                minutes_left=minutes_left, previous=previous, inherited=inherited,
                                batches=planlib.batches_for(str(default_device(device))))
    tok = corpus.tokenizer  # the vocabulary sizes are the tokenizer's: facts, not choices
    model = dataclasses.replace(cfg.model, src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size,
                                share_embeddings=cfg.model.share_embeddings and tok.joint)
    return Planned(dataclasses.replace(cfg, model=model), plan)


def facts(cfg: TrainConfig, corpus, processes: int = 1) -> planlib.Facts:
    """The plan's facts of the prepared corpus; steps per epoch are the training sampler's own."""
    cost = column(corpus.splits["train"], "cost")
    spe = functools.cache(lambda max_tokens: TokenBatchSampler(
        cost, max_tokens, world_size=processes, accum_steps=cfg.accum_steps, seed=cfg.seed,
        epoch_rows=corpus.epoch_rows).steps_per_epoch(0))
    epoch = cost if corpus.epoch_rows is None else cost[corpus.epoch_rows(0)]
    return planlib.Facts(train_pairs=corpus.stats.sizing_pairs, epoch_cost=int(epoch.sum(dtype=np.int64)),
                         longest_cost=int(cost.max()), epoch_steps=spe, vocab_size=corpus.stats.vocab_size)


def speed_probe(cfg: TrainConfig, corpus, device: str | None, precision: str) -> planlib.Speed:
    """Seconds per cost token (a batch's pairs x its costliest pair) of training a shape in batches of a size, one
    process in mixed `precision`: the median of PROBE_STEPS timed steps on real batches, each shape and size timed
    once; None where such a step runs out of the device's memory. On a CPU every size is timed at the smallest
    rung: its rate per token hardly moves with the batch, and each timing spends the budget."""
    device = default_device(device)
    tok, train = corpus.tokenizer, corpus.splits["train"]
    cost = column(train, "cost")

    @functools.cache
    def timed(dims: planlib.Dims, tokens: int) -> float | None:
        model_cfg = ModelConfig(src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size, dropout=0.1,
                                **{k: getattr(dims, k) for k in planlib.DIM_KEYS},
                                share_embeddings=cfg.model.share_embeddings and tok.joint)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            model = use_cpu_kernels(Seq2SeqTransformer(model_cfg), fast_dropout=device.type == "cpu")  # as trained
        plan = TokenBatchSampler(cost, tokens, seed=cfg.seed).plan(0)
        chunks = ([plan.batches[i % len(plan)]] for i in itertools.count())
        try:
            steps = time_steps(model, cfg, batches(cfg, train, chunks, device, model), PROBE_STEPS, device,
                               precision)
        except OutOfMemory:
            return None
        finally:
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next, smaller probe starts from an empty cache
        return float(np.median([s / w[0]["src_ids"].shape[0] / _cost(w[0]) for s, w in steps]))

    def speed(dims: planlib.Dims, tokens: int) -> float | None:
        return timed(dims, planlib.BATCHES[-1] if device.type == "cpu" else tokens)

    return speed


def _cost(batch: dict) -> int:
    """A collated batch's costliest pair: its padded source or decoder length."""
    return max(batch["src_ids"].shape[1], batch["tgt_in_ids"].shape[1])


def batches(cfg: TrainConfig, train, chunks: Iterable[list[np.ndarray]], device: torch.device,
            model: torch.nn.Module) -> Iterable[list[dict]]:
    """The collated micro-batch windows of `chunks` (index arrays into the split `train`), on `device`."""
    columns = train.select_columns(["src_ids", "tgt_ids"])
    collate = Collator.for_model(model, cfg.pad_to_multiple_of)
    for window in chunks:
        yield [{k: v.to(device) for k, v in collate.columns(columns[c.tolist()]).items()} for c in window]


def time_steps(model: torch.nn.Module, cfg: TrainConfig, windows: Iterable[list[dict]], steps: int,
               device: torch.device, precision: str = "no", budget_s: float = PROBE_BUDGET_S) -> list[tuple[float, list]]:
    """(seconds, window) of `steps` optimizer steps taken exactly as training takes them (the batch collated,
    then `train_step`: the objective's loss, AdamW as training builds it, clipping, the schedule), after one
    untimed warm-up step; under `compile`, a step during which torch.compile compiled a graph (the first shape,
    the first of another) is a warm-up too, up to COMPILE_WARMUPS more. Stops early once the timed steps have
    taken `budget_s`, or `windows` ends. The caller's random state is left as it was."""
    objective = make_objective(model.to(device), cfg)
    # the schedule's shape does not change a step's time (and a linear one may have no horizon yet)
    steady = dataclasses.replace(cfg, optim=dataclasses.replace(
        cfg.optim, lr=cfg.optim.lr or 1e-3, warmup_steps=cfg.optim.warmup_steps or 1, schedule="inverse_sqrt"))
    if not cfg.compile:  # the attention kernel training takes on this device and precision
        use_attention_path(objective, precision)
    optim, one = make_optim(objective, steady), OneDevice(device, cfg.accum_steps, precision)
    graphs, timed = graphs_compiled() if cfg.compile else 0, []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        batches = iter(windows)
        for i in range(steps + 1 + (COMPILE_WARMUPS if cfg.compile else 0)):
            _sync(device)
            start = time.perf_counter()
            window = next(batches, None)  # collated inside the timing, as the training loop's loader does
            if window is None:
                break
            stats = training_loop.train_step(one, objective, optim, window)  # through the module: a test spies on it
            if stats.out_of_memory:
                raise OutOfMemory(f"a training step of this model ran out of memory on {device} at "
                                  f"{_tokens(window):,} padded tokens a micro-batch; lower max_tokens, and raise "
                                  "accum_steps to keep the batch")
            _sync(device)
            seconds = time.perf_counter() - start
            now = graphs_compiled() if cfg.compile else 0
            compiled, graphs = now > graphs, now
            if i > 0 and not compiled:  # step 0 warms up allocator and kernels
                timed.append((seconds, window))
                if len(timed) >= steps or sum(s for s, _ in timed) > budget_s:
                    break
    return timed


class OutOfMemory(NmtError):
    """A timed training step ran out of the device's memory."""


def _tokens(window: list[dict]) -> int:
    return max(b["src_ids"].numel() + b["tgt_in_ids"].numel() for b in window)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
