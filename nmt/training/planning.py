"""The budget plan of a run: the settings its config leaves null, chosen by `nmt.budget` from the corpus,
a few timed real training steps (`train_step`, as `nmt check` times them) and the budget. One home for
`nmt train` and `nmt check`, so the check shows the plan training will follow.

A run saves its plan as plan.json in the run directory; a resumed run reuses it instead of re-timing.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from nmt import budget
from nmt.batching import TokenBatchSampler
from nmt.collate import Collator
from nmt.config import MODEL_PRESETS, ModelConfig, TrainConfig
from nmt.model import Seq2SeqTransformer
from nmt.objective import Seq2SeqLoss
from nmt.tables import column
from nmt.training import step as training_step
from nmt.training.step import OneDevice, default_device, make_optim

PLAN_FILE = "plan.json"
PROBE_STEPS = 3  # timed steps after one untimed warm-up
PROBE_LR = 1e-3  # the probe's optimizer needs some lr; the speed does not depend on it
# the TrainConfig fields a plan fills
TOP = ("max_tokens", "eval_every", "save_every", "keep_last", "average_last", "eval_max_sentences")
OPTIM = ("lr", "warmup_steps")
MODEL = ("d_model", "n_heads", "n_encoder_layers", "n_decoder_layers", "d_ff", "dropout")


def decay_open(cfg: TrainConfig) -> bool:
    """A linear schedule without decay_steps: under a time budget the plan's steps end it."""
    return cfg.optim.schedule == "linear" and cfg.optim.decay_steps is None and cfg.max_minutes is not None


def open_fields(cfg: TrainConfig) -> list[str]:
    """The config keys left null for the plan to choose."""
    keys = [k for k in TOP if getattr(cfg, k) is None] + [f"optim.{k}" for k in OPTIM if getattr(cfg.optim, k) is None]
    if decay_open(cfg):
        keys.append("optim.decay_steps")
    keys += [f"model.{k}" for k in MODEL if getattr(cfg.model, k) is None]
    if keys and bpe_open(cfg):  # chosen along with the rest: a config that gives all of that is taken as it is
        keys.append("tokenizer.dropout")
    return keys


def bpe_open(cfg: TrainConfig) -> bool:
    """BPE-dropout left to the plan: tokenizer.dropout null with a BPE tokenizer (0 turns it off)."""
    return cfg.tokenizer.dropout is None and cfg.tokenizer.kind == "bpe"


def corpus_stats(corpus) -> budget.CorpusStats:
    cost = column(corpus.splits["train"], "cost")  # through Arrow, not row by row
    return budget.CorpusStats(train_pairs=corpus.stats["sizing_pairs"], epoch_cost=int(cost.sum(dtype=np.int64)),
                              longest_cost=int(cost.max()))


def budget_of(cfg: TrainConfig, processes: int) -> budget.Budget:
    return budget.Budget(cfg.max_minutes, cfg.max_steps, None if cfg.max_steps else cfg.max_epochs, processes,
                         cfg.accum_steps)


def given_dims(model: ModelConfig) -> budget.Dims | None:
    """The model's shape when the config gives all of it (a preset size, or every field), else None."""
    fields = [getattr(model, k) for k in budget.Dims._fields[1:]]
    return None if None in fields else budget.Dims("given", *fields)


def make_plan(cfg: TrainConfig, corpus, processes: int = 1, device: str | None = None,
              precision: str = "no") -> budget.Plan:
    """Time the model (the corpus's largest allowed rung, then the chosen one if it differs) in the run's mixed
    `precision` when a time budget bounds the run, and plan; no timing without max_minutes."""
    stats, limits, given = corpus_stats(corpus), budget_of(cfg, processes), given_dims(cfg.model)
    if cfg.max_minutes is None:
        return budget.make_plan(stats, limits, None, given)
    first = given or budget.allowed(stats.train_pairs)[-1]
    speed = budget.Speed(measure(cfg, corpus, first, device, precision=precision), first)
    plan = budget.make_plan(stats, limits, speed, given)
    chosen = given or budget.rung(plan.model)
    if chosen != first:  # time the chosen shape itself: small models run below their FLOP share on a CPU
        why = f"{plan.reasons[0]} (timing {first.name}; {chosen.name} then timed itself)"
        speed = budget.Speed(measure(cfg, corpus, chosen, device, precision=precision), chosen)
        plan = budget.make_plan(stats, limits, speed, chosen)
        plan.reasons.insert(0, why)
    return plan


def apply_plan(cfg: TrainConfig, plan: budget.Plan) -> TrainConfig:
    """`cfg` with its null fields taken from `plan`; explicit values are kept, field by field."""
    top = {k: getattr(plan, k) for k in TOP if getattr(cfg, k) is None}
    optim = {k: getattr(plan, k) for k in OPTIM if getattr(cfg.optim, k) is None}
    if decay_open(cfg) and plan.decay_steps is not None:
        optim["decay_steps"] = plan.decay_steps
    model = {k: getattr(plan, k) for k in MODEL if getattr(cfg.model, k) is None}
    if len(model) == len(MODEL) and cfg.model.size == "auto" and plan.model in MODEL_PRESETS:
        model["size"] = plan.model  # the rung is a named size: the run's config and model info say so
    if "average_last" in top and cfg.save_every is not None:  # the run saves at its own cadence, not the plan's
        top["average_last"] = budget.average_for(plan.steps, cfg.save_every)
    if top.get("keep_last") is not None:
        top["keep_last"] = max(top["keep_last"], top.get("average_last", cfg.average_last) or 0)
    tokenizer = {"dropout": plan.bpe_dropout or 0.0} if bpe_open(cfg) else {}  # 0: chosen off
    return dataclasses.replace(cfg, **top, optim=dataclasses.replace(cfg.optim, **optim),
                               model=dataclasses.replace(cfg.model, **model),
                               tokenizer=dataclasses.replace(cfg.tokenizer, **tokenizer))


def describe(plan: budget.Plan | None, keys: list[str]) -> list[str]:
    """The printed block: what the plan chose for `keys` (the fields left null), and why."""
    if not keys:
        return ["plan      all settings given; nothing chosen from the budget"]
    head = f"plan      chosen for the budget (set a key to override it): {', '.join(keys)}"
    reasons = plan.reasons + ([f"optim.decay_steps {plan.decay_steps:,}: the linear schedule ends with the budget's steps"]
                              if "optim.decay_steps" in keys else [])
    return [head] + [f"          - {reason}" for reason in reasons]


def save_plan(plan: budget.Plan, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / PLAN_FILE).write_text(json.dumps(plan.to_dict(), indent=2), encoding="utf-8")


def load_plan(out: Path) -> budget.Plan | None:
    path = out / PLAN_FILE
    return budget.Plan.from_dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else None


# --- timing -----------------------------------------------------------------------------------------------


def measure(cfg: TrainConfig, corpus, dims: budget.Dims, device: str | None = None, steps: int = PROBE_STEPS,
            precision: str = "no") -> float:
    """Seconds per cost token (the batch's pairs x its costliest pair) of training a `dims` model, one process in
    mixed `precision`:
    the median of `steps` timed `train_step`s on real batches of budget.BATCHES[-1] tokens after a warm-up.
    The caller's random state is left as it was."""
    device = default_device(device)
    tok = corpus.tokenizer
    model_cfg = ModelConfig(src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size,
                            **{k: getattr(dims, k) for k in budget.Dims._fields[1:]}, dropout=0.1,
                            share_embeddings=cfg.model.share_embeddings and tok.joint)
    train = corpus.splits["train"]
    cost = column(train, "cost")  # through Arrow, not a Python list
    plan = TokenBatchSampler(cost, budget.BATCHES[-1], seed=cfg.seed).plan(0)
    columns, per_token = train.select_columns(["src_ids", "tgt_ids"]), []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        objective = Seq2SeqLoss(Seq2SeqTransformer(model_cfg).to(device), 0.1)
        collate = Collator(pad_id=objective.pad_id, pad_to_multiple_of=cfg.pad_to_multiple_of)
        optim = make_optim(objective, dataclasses.replace(cfg, optim=dataclasses.replace(
            cfg.optim, lr=PROBE_LR, warmup_steps=1, schedule="inverse_sqrt")))  # the speed does not depend on them
        for i in range(steps + 1):
            chunk = plan.batches[i % len(plan)]
            batch = {k: v.to(device) for k, v in collate.columns(columns[chunk.tolist()]).items()}
            start = time.perf_counter()
            training_step.train_step(OneDevice(device, mixed_precision=precision), objective, optim, [batch])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i > 0:  # step 0 warms up allocator and kernels
                per_token.append((time.perf_counter() - start) / (len(chunk) * int(cost[chunk].max())))
    return float(np.median(per_token))


def planned(accelerator, cfg: TrainConfig, corpus) -> tuple[TrainConfig, budget.Plan | None]:
    """`cfg` with the fields it leaves null filled by the run's plan, and the plan (None: nothing to plan): the
    saved one when resuming (re-planning is deterministic), else a new one made on the main process, shared with
    the others and printed. The caller saves it once the run has started (save_plan), so that a run refused
    before its start (a model breaking the contract, say) leaves its output_dir as it was."""
    keys = open_fields(cfg)
    if not keys:
        return cfg, None
    out = Path(cfg.output_dir)
    plan = load_plan(out) if cfg.resume else None
    if plan is None:
        box = [make_plan(cfg, corpus, accelerator.num_processes, str(accelerator.device),
                         str(accelerator.mixed_precision)).to_dict()
               if accelerator.is_main_process else None]
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(box)
        plan = budget.Plan.from_dict(box[0])
    if accelerator.is_main_process:
        print("nmt: " + "\n".join(describe(plan, keys)).removeprefix("plan      ").replace("\n          ", "\n  "),
              flush=True)
    return apply_plan(cfg, plan), plan
