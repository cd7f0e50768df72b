"""The run's side of the plan: the facts of the prepared corpus, the one timing probe, and `planned`, which
resolves the config once (`nmt.plan.resolve`), prints the plan and hands it to the run. `nmt check` calls the
same functions, so the check shows the plan that training follows.

A run saves its plan as plan.json in the run directory; a resumed run reads it back instead of timing again.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable

import numpy as np
import torch

from nmt import plan as planlib
from nmt.batching import TokenBatchSampler
from nmt.collate import Collator
from nmt.config import ModelConfig, TrainConfig
from nmt.model import Seq2SeqTransformer
from nmt.objective import Seq2SeqLoss
from nmt.tables import column
from nmt.training import loop as training_loop
from nmt.training.loop import OneDevice, default_device, make_optim

PROBE_STEPS = 3  # timed steps after one untimed warm-up
PROBE_BUDGET_S = 30.0  # a probe stops early (after at least one timed step) once it has taken this long


def facts(cfg: TrainConfig, corpus, processes: int = 1) -> planlib.Facts:
    """The plan's facts of the prepared corpus; steps per epoch are the training sampler's own."""
    cost = column(corpus.splits["train"], "cost")
    spe = functools.cache(lambda max_tokens: TokenBatchSampler(
        cost, max_tokens, world_size=processes, accum_steps=cfg.accum_steps, seed=cfg.seed,
        epoch_rows=corpus.epoch_rows).steps_per_epoch(0))
    epoch = cost if corpus.epoch_rows is None else cost[corpus.epoch_rows(0)]
    return planlib.Facts(train_pairs=corpus.stats["sizing_pairs"], epoch_cost=int(epoch.sum(dtype=np.int64)),
                         longest_cost=int(cost.max()), epoch_steps=spe)


# --- the one timing probe ---------------------------------------------------------------------------------


def time_steps(model: torch.nn.Module, cfg: TrainConfig, windows: Iterable[list[dict]], steps: int,
               device: torch.device, precision: str = "no", budget_s: float = PROBE_BUDGET_S) -> list[tuple[float, list]]:
    """(seconds, window) of `steps` optimizer steps taken exactly as training takes them (the batch collated,
    then `train_step`: the objective's loss, AdamW as training builds it, clipping, the schedule), after one
    untimed warm-up step; stops early once `budget_s` has passed. The caller's random state is left as it was."""
    objective = Seq2SeqLoss(model.to(device), cfg.optim.label_smoothing)
    # the schedule's shape does not change a step's time (and a linear one may have no horizon yet)
    steady = dataclasses.replace(cfg, optim=dataclasses.replace(
        cfg.optim, lr=cfg.optim.lr or 1e-3, warmup_steps=cfg.optim.warmup_steps or 1, schedule="inverse_sqrt"))
    optim, one = make_optim(objective, steady), OneDevice(device, cfg.accum_steps, precision)
    timed, started = [], time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        batches = iter(windows)
        for i in range(steps + 1):
            _sync(device)
            start = time.perf_counter()
            window = next(batches, None)  # collated inside the timing, as the training loop's loader does
            if window is None:
                break
            training_loop.train_step(one, objective, optim, window)  # through the module: a test spies on it
            _sync(device)
            if i > 0:  # step 0 warms up allocator and kernels
                timed.append((time.perf_counter() - start, window))
                if len(timed) >= steps or time.perf_counter() - started > budget_s:
                    break
    return timed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(cfg: TrainConfig, train, chunks: Iterable[list[np.ndarray]], device: torch.device,
            model: torch.nn.Module) -> Iterable[list[dict]]:
    """The collated micro-batch windows of `chunks` (index arrays into the split `train`), on `device`."""
    columns = train.select_columns(["src_ids", "tgt_ids"])
    collate = Collator.for_model(model, cfg.pad_to_multiple_of)
    for window in chunks:
        yield [{k: v.to(device) for k, v in collate.columns(columns[c.tolist()]).items()} for c in window]


def speed_probe(cfg: TrainConfig, corpus, device: str | None, precision: str) -> planlib.Speed:
    """Seconds per cost token (a batch's pairs x its costliest pair) of training a shape, one process in mixed
    `precision`: the median of PROBE_STEPS timed steps on real batches of the plan's smaller batch size."""
    device = default_device(device)
    tok, train = corpus.tokenizer, corpus.splits["train"]
    cost = column(train, "cost")
    plan = TokenBatchSampler(cost, planlib.BATCHES[-1], seed=cfg.seed).plan(0)

    def speed(dims: planlib.Dims) -> float:
        model_cfg = ModelConfig(src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size, dropout=0.1,
                                **{k: getattr(dims, k) for k in planlib.DIM_KEYS},
                                share_embeddings=cfg.model.share_embeddings and tok.joint)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(cfg.seed)
            model = Seq2SeqTransformer(model_cfg)
        chunks = ([plan.batches[i % len(plan)]] for i in range(PROBE_STEPS + 1))
        timed = time_steps(model, cfg, batches(cfg, train, chunks, device, model), PROBE_STEPS, device,
                           precision)
        return float(np.median([s / w[0]["src_ids"].shape[0] / _cost(w[0]) for s, w in timed]))

    return speed


def _cost(batch: dict) -> int:
    """A collated batch's costliest pair: its padded source or decoder length."""
    return max(batch["src_ids"].shape[1], batch["tgt_in_ids"].shape[1])


# --- the resolution of a run -------------------------------------------------------------------------------


def planned(cfg: TrainConfig, corpus, *, processes: int = 1, device: str | None = None, precision: str = "no",
            inherited: dict[str, str] | None = None, previous: planlib.Plan | None = None,
            minutes_left: float | None = None, timed: bool = True) -> tuple[TrainConfig, planlib.Plan]:
    """`cfg` resolved for `corpus` (`nmt.plan.resolve`) with the speed timed here when a time budget needs it."""
    # a resumed run's plan is kept as it was: nothing is timed again
    speed = speed_probe(cfg, corpus, device, precision) if timed and cfg.max_minutes and previous is None else None
    cfg, plan = planlib.resolve(cfg, facts(cfg, corpus, processes), speed=speed, processes=processes,
                                minutes_left=minutes_left, previous=previous, inherited=inherited)
    tok = corpus.tokenizer  # the vocabulary sizes are the tokenizer's: facts, not choices
    model = dataclasses.replace(cfg.model, src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size,
                                share_embeddings=cfg.model.share_embeddings and tok.joint)
    return dataclasses.replace(cfg, model=model), plan






def tokenizer_for_data(cfg: TrainConfig, previous: planlib.Plan | None) -> TrainConfig:
    """`cfg` with the tokenizer settings a resumed run was started with, so data preparation reuses its
    tokenizer rather than training one of another size."""
    if previous is None:
        return cfg
    keep = {k: previous.chosen[k] for k in ("tokenizer.vocab_size",) if k in previous.chosen
            and planlib.get(cfg, k) is None}
    return planlib.put(cfg, keep)
