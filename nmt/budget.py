"""The budget rule: the settings a config leaves null, chosen from the corpus, the measured speed and the budget.

Pure functions, no torch: (corpus stats, seconds per token, budget) -> `Plan`. Anchored on the hand-tuned
configs/tatoeba-en-de.yaml (48k pairs, 25 CPU minutes: d192 3+3, 2,048-token batches, lr 0.0011, warmup
600 of ~4,800 steps, validation every 300 steps, 3 checkpoints averaged), which beat the fixed defaults
(4,096-token batches, warmup 1,000, validation every 500) by 5.8 BLEU on an unseen corpus (issue 14).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from nmt.config import auto_sizes


class Dims(NamedTuple):
    """A model's shape, as far as the rule needs it."""

    name: str
    d_model: int
    n_heads: int
    n_encoder_layers: int
    n_decoder_layers: int
    d_ff: int


# model widths the rule chooses from, smallest first
LADDER = (
    Dims("tiny", 32, 2, 1, 1, 64),
    Dims("d128", 128, 4, 2, 2, 512),
    Dims("d192", 192, 4, 3, 3, 768),  # configs/tatoeba-en-de.yaml
    Dims("small", 256, 4, 3, 3, 1024),
    Dims("base", 512, 8, 6, 6, 2048),
)
CAP = {"tiny": "tiny", "small": "small", "base": "base"}  # auto_sizes' corpus-size choice: the largest rung allowed
# the largest allowed model that still sees this many epochs in the budget: on Tatoeba in 25 minutes (2-core
# AVX-512 CPU) d192 seeing ~27 epochs validated better than small (d256) seeing ~14 (benchmarks/recipe.py)
MIN_EPOCHS = 20.0
# under this many training pairs no rung wider than this: on Tatoeba's first 10,000 pairs in 10 minutes d192
# validated better than small, which the epoch rule alone picks there (benchmarks/recipe.py --subset 10000)
SMALL_CORPUS = (20_000, "d192")
# from this many planned epochs over a corpus under SMALL_CORPUS's size, training segments each epoch anew with
# BPE-dropout: on Tatoeba's first 10,000 pairs in 75 minutes (~300 epochs), where the defaults stop gaining by
# mid-run, BPE-dropout 0.1 validated higher (benchmarks/recipe.py; README "Levers tried")
MANY_EPOCHS = 100.0
BPE_DROPOUT = 0.1  # Provilkov et al. 2020's p
TARGET_STEPS = 4000  # 4,096-token batches only when the budget still allows this many updates with them
BATCHES = (4096, 2048)
FILL = 0.95  # share of max_tokens a batch fills (length buckets pad ~4%)
TRAIN_SHARE = 0.9  # of the time budget; the rest goes to validation and checkpoints
WARMUP_SHARE = 0.12  # of the planned steps (600 of ~4,800 on Tatoeba)
MAX_WARMUP = 4000
LR_AT_192 = 1.1e-3  # peak lr for d_model 192; scaled by 1/sqrt(d_model), as Vaswani et al.'s schedule does
VALIDATIONS = 16  # about this many validations per run (every 300 of ~4,800 steps on Tatoeba)
AVERAGE_LAST = 3  # checkpoints averaged at the end (kept only if it validates at least as well)
TIMED_VALID_SENTENCES = 500  # under a time budget validation BLEU decodes this many pairs (as the tuned config)


@dataclass(frozen=True)
class CorpusStats:
    train_pairs: int  # after cleaning
    epoch_cost: int  # padded tokens of the longer side summed over the training pairs (the "cost" column)
    longest_cost: int  # the most expensive training pair


@dataclass(frozen=True)
class Budget:
    minutes: float | None  # max_minutes
    max_steps: int | None
    max_epochs: int | None
    processes: int = 1
    accum_steps: int = 1


@dataclass(frozen=True)
class Speed:
    """Seconds per cost token of one process, measured on a model of shape `model`."""

    seconds_per_token: float
    model: Dims


@dataclass
class Plan:
    """What the rule chose, and why (one reason per choice)."""

    model: str  # a LADDER name, or "given" (the config set the model's shape)
    d_model: int
    n_heads: int
    n_encoder_layers: int
    n_decoder_layers: int
    d_ff: int
    dropout: float
    max_tokens: int
    steps: int  # optimizer steps the budget allows
    epochs: float
    lr: float
    warmup_steps: int
    eval_every: int
    save_every: int
    keep_last: int
    average_last: int
    eval_max_sentences: int | None = None  # None: the whole validation set
    decay_steps: int | None = None  # where optim.schedule linear ends: the planned steps under a time budget
    bpe_dropout: float | None = None  # tokenizer.dropout: BPE-dropout for many epochs over a small corpus, else None
    seconds_per_token: float | None = None
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        return cls(**data)


def rung(name: str) -> Dims:
    return next(r for r in LADDER if r.name == name)


def flops_per_token(m: Dims) -> float:
    """Relative training cost per token of a shape: the layers' matrix products (attention's length terms and
    the vocabulary projection, much the same for every rung, left out)."""
    d, ff = m.d_model, m.d_ff
    return m.n_encoder_layers * (4 * d * d + 2 * d * ff) + m.n_decoder_layers * (8 * d * d + 2 * d * ff)


def allowed(train_pairs: int) -> list[Dims]:
    """The rungs a corpus of this size may use: up to auto_sizes' model size, and no wider than SMALL_CORPUS's rung
    below its size; tiny only for smoke tests."""
    cap = CAP[auto_sizes(train_pairs).model_size]
    names = [r.name for r in LADDER]
    if cap == "tiny":
        return [LADDER[0]]
    if train_pairs < SMALL_CORPUS[0]:
        cap = names[min(names.index(cap), names.index(SMALL_CORPUS[1]))]
    return list(LADDER[1:names.index(cap) + 1])


def seconds_per_step(speed: Speed, model: Dims, max_tokens: int, budget: Budget) -> float:
    per_token = speed.seconds_per_token * flops_per_token(model) / flops_per_token(speed.model)
    return per_token * max_tokens * FILL * budget.accum_steps


def steps_per_epoch(stats: CorpusStats, max_tokens: int, budget: Budget) -> int:
    return max(1, math.ceil(stats.epoch_cost / (max_tokens * FILL * budget.processes * budget.accum_steps)))


def budget_steps(stats: CorpusStats, budget: Budget, speed: Speed | None, model: Dims, max_tokens: int) -> int:
    """Optimizer steps the run will take: the least of max_steps, max_epochs and the time budget."""
    bounds = [b for b in (budget.max_steps,) if b]
    if budget.max_epochs:
        bounds.append(budget.max_epochs * steps_per_epoch(stats, max_tokens, budget))
    if budget.minutes is not None and speed is not None:
        seconds = 60 * budget.minutes * TRAIN_SHARE
        bounds.append(int(seconds / seconds_per_step(speed, model, max_tokens, budget)))
    return max(1, min(bounds))


def choose_model(stats: CorpusStats, budget: Budget, speed: Speed | None) -> tuple[Dims, str]:
    """The largest allowed rung that sees MIN_EPOCHS epochs in the budget (else the smallest); and why."""
    rungs = allowed(stats.train_pairs)
    names = ", ".join(r.name for r in rungs)
    if speed is None or budget.minutes is None:
        return rungs[-1], f"largest for {stats.train_pairs:,} training pairs (no time budget)"
    for m in reversed(rungs):
        steps = budget_steps(stats, budget, speed, m, BATCHES[-1])
        epochs = steps / steps_per_epoch(stats, BATCHES[-1], budget)
        if epochs >= MIN_EPOCHS:
            return m, f"largest of {names} that sees >= {MIN_EPOCHS:g} epochs in the budget (~{epochs:.1f})"
    return rungs[0], f"smallest of {names}: none sees {MIN_EPOCHS:g} epochs (~{epochs:.1f} for it)"


def choose_max_tokens(stats: CorpusStats, budget: Budget, speed: Speed | None, model: Dims) -> tuple[int, str]:
    """4,096-token batches when the budget still allows TARGET_STEPS updates with them, else 2,048 (more, smaller
    updates learned more on Tatoeba in 25 minutes); never below the longest pair."""
    tokens, why = BATCHES[0], "no time budget"
    if speed is not None and budget.minutes is not None:
        steps = budget_steps(stats, budget, speed, model, BATCHES[0])
        tokens = BATCHES[0] if steps >= TARGET_STEPS else BATCHES[-1]
        why = f"{steps:,} steps with {BATCHES[0]:,}-token batches {'>=' if steps >= TARGET_STEPS else '<'} {TARGET_STEPS:,}"
    if tokens < stats.longest_cost:
        return stats.longest_cost, f"the longest training pair costs {stats.longest_cost:,} tokens"
    return tokens, why


def dropout_for(train_pairs: int, epochs: float) -> tuple[float, str]:
    if train_pairs < 1_000 or epochs < 2:
        return 0.0, "under 2 epochs or a smoke-test corpus: nothing to overfit"
    if train_pairs < 20_000:
        return 0.2, "under 20k training pairs: many epochs over little data"
    return 0.1, "20k training pairs or more"


def bpe_dropout_for(train_pairs: int, epochs: float) -> tuple[float | None, str]:
    """BPE_DROPOUT for MANY_EPOCHS or more over 1k to SMALL_CORPUS pairs, else None (off); and why."""
    small = f"under {SMALL_CORPUS[0] // 1000}k training pairs"
    if 1_000 <= train_pairs < SMALL_CORPUS[0] and epochs >= MANY_EPOCHS:
        return BPE_DROPOUT, f"~{epochs:.0f} epochs over {small}: each epoch segmented anew"
    return None, f"on only for {MANY_EPOCHS:g} epochs or more over {small}"


def average_for(steps: int, save_every: int) -> int:
    """AVERAGE_LAST when the run saves at least twice that many checkpoints, else 0 (no averaging)."""
    return AVERAGE_LAST if steps // save_every >= 2 * AVERAGE_LAST else 0


def make_plan(stats: CorpusStats, budget: Budget, speed: Speed | None, model: Dims | None = None) -> Plan:
    """The plan for this corpus, budget and speed; `model` fixes the shape (else `choose_model`)."""
    reasons = []
    if model is None:
        model, why = choose_model(stats, budget, speed)
        reasons.append(f"model {model.name} (d_model {model.d_model}, {model.n_encoder_layers}+"
                       f"{model.n_decoder_layers} layers, d_ff {model.d_ff}): {why}")
    max_tokens, why = choose_max_tokens(stats, budget, speed, model)
    reasons.append(f"max_tokens {max_tokens:,}: {why}")
    steps = budget_steps(stats, budget, speed, model, max_tokens)
    epochs = steps / steps_per_epoch(stats, max_tokens, budget)
    reasons.append(f"~{steps:,} steps = {epochs:.1f} epochs" + (
        f" in {budget.minutes:g} min ({TRAIN_SHARE:.0%} of it training)" if speed and budget.minutes else ""))
    d = model.d_model
    dropout, why = dropout_for(stats.train_pairs, epochs)
    reasons.append(f"dropout {dropout:g}: {why}")
    bpe, why = bpe_dropout_for(stats.train_pairs, epochs)
    reasons.append(f"BPE-dropout {'off' if bpe is None else f'{bpe:g}'} (tokenizer.dropout): {why}")
    lr = float(f"{LR_AT_192 * math.sqrt(192 / d):.2g}")
    warmup = max(1, min(MAX_WARMUP, round(WARMUP_SHARE * steps)))
    reasons.append(f"lr {lr:g} for d_model {d} (1.1e-3 x sqrt(192/d)); warmup {warmup:,} ({WARMUP_SHARE:.0%} of steps)")
    timed = bool(speed and budget.minutes)
    every = max(1, steps // VALIDATIONS)
    average = average_for(steps, every)
    sentences = TIMED_VALID_SENTENCES if timed else None
    scored = f"the first {sentences} validation pairs after the warmup (the loss only before)" if sentences else \
        "all validation pairs"
    reasons.append(f"validate and save every {every:,} steps (~{VALIDATIONS} per run), BLEU on {scored}; "
                   f"average_last {average}")
    return Plan(model.name, d, model.n_heads, model.n_encoder_layers, model.n_decoder_layers, model.d_ff, dropout,
                max_tokens, steps, epochs, lr, warmup, every, every,
                keep_last=max(average, 2), average_last=average, eval_max_sentences=sentences,
                decay_steps=steps if timed else None, bpe_dropout=bpe,
                seconds_per_token=speed.seconds_per_token if speed else None, reasons=reasons)
