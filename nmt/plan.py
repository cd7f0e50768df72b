"""The plan: the one resolution of a configuration's open fields into a complete configuration.

A config may leave fields null, meaning "choose for me": the model's shape, the vocabulary size, the batch size,
the learning rate and its warmup, the validation cadence, checkpoint averaging, dropout, the step limit.
`resolve(cfg, facts, speed)` fills every one of them from the corpus, the measured training speed and the time
budget, and records one reason per value it chose. `nmt train`, `nmt check`, resume and fine-tuning all call it;
everything after it reads the resolved config only. The printed plan (`Plan.lines`) is made from the values the
resolved config holds, so it cannot name one value and train with another, and it says nothing of the values
the user set.

Pure functions, no torch: the speed comes in as a function from a model shape to seconds per token, timed by
the caller on real training steps. Anchored on a hand-tuned recipe for 48k pairs in 25 CPU minutes (d192 3+3,
2,048-token batches, lr 0.0011, warmup 600 of ~4,800 steps, validation every 300, 3 checkpoints averaged).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from nmt.config import MODEL_PRESETS, TrainConfig


class Dims(NamedTuple):
    """A model's shape, as far as the rule needs it."""

    name: str
    d_model: int
    n_heads: int
    n_encoder_layers: int
    n_decoder_layers: int
    d_ff: int


DIM_KEYS = Dims._fields[1:]
# the model shapes the rule chooses from, smallest first: named sizes of the config (MODEL_PRESETS)
RUNGS = tuple(Dims(name, *(MODEL_PRESETS[name][k] for k in DIM_KEYS)) for name in ("tiny", "d128", "d192", "small", "base"))

# (training pairs below, tokenizer.vocab_size, the widest model the corpus may use): the one sizing table.
# Small corpora want small vocabularies and small models (Sennrich & Zhang 2019: a few thousand BPE merges for
# low-resource NMT); 32k joint subwords with Transformer base is the WMT-scale setting of Vaswani et al. 2017.
# Under 1k pairs nothing learns to translate: such runs are smoke tests and get the tiny model. Under 20k pairs
# d192 validated better than small on Tatoeba's first 10k pairs; on its 48k pairs in 25 minutes a vocabulary of 8,000
# validated better than 4,000 (BLEU 46.1 against 44.1 with 2,048-token batches, 46.6 against 45.5 with 1,024).
# "big" is never chosen: ask for it by name.
SIZES = (
    (1_000, 1_000, "tiny"),
    (20_000, 2_000, "d192"),
    (100_000, 8_000, "small"),
    (300_000, 8_000, "small"),
    (1_000_000, 8_000, "base"),
    (5_000_000, 16_000, "base"),
    (None, 32_000, "base"),
)
# under a time budget, the widest allowed model that still sees this many epochs: on Tatoeba in 25 minutes d192
# seeing ~27 epochs validated better than small (d256) seeing ~14
MIN_EPOCHS = 20.0
# from this many planned epochs over a corpus under 20k pairs, training segments each epoch anew (BPE-dropout):
# at ~300 epochs over 10k pairs, where training without it stops gaining by mid-run, it validated higher
MANY_EPOCHS = 100.0
BPE_DROPOUT = 0.1  # Provilkov et al. 2020's p
DEFAULT_EPOCHS = 10  # without a time budget or a step limit
# the largest batch (tokens a step) that still allows this many updates in the budget, else the smallest: under a
# short budget more, smaller updates learn more (Tatoeba in 25 minutes: 2,048 over 4,096 at ~2,400 steps; on one
# CPU core, 1,024 over 2,048 at ~2,600: validation BLEU 45.5 against 44.1, docs/results.md)
TARGET_STEPS = 6000
BATCHES = (4096, 2048, 1024)  # a CPU's rungs
# an accelerator's: a GPU computes a 1,024-token batch of a small model in about the time it takes to launch its
# kernels, so its rate per token rises with the batch up to tens of thousands of tokens (fairseq's 4,096 a GPU with
# update_freq 8, Ott et al. 2018's 25k-token batches, Marian's workspace-filling ones); each rung is timed, and one
# that does not fit the device's memory is left out
GPU_BATCHES = (65536, 32768, 16384, 8192, 4096)
# short of TARGET_STEPS, a batch is halved while that buys at least this many times the updates: a CPU's step time
# is proportional to its tokens (2x a halving), a GPU's below its saturating batch is not
HALVING_GAIN = 1.5
FILL = 0.95  # share of max_tokens a batch fills (length buckets pad ~4%)
TRAIN_SHARE = 0.9  # of the time left, until a validation is timed; the rest goes to validation and checkpoints
VALID_SHARE = 0.15  # at most this share of the time left goes to validations, once one is timed
WARMUP_SHARE = 0.12  # of the planned steps (600 of ~4,800 on Tatoeba)
MAX_WARMUP = 4000
LR_AT_192 = 1.1e-3  # peak lr for d_model 192; scaled by 1/sqrt(d_model), as Vaswani et al.'s schedule does
VALIDATIONS = 16  # about this many validations per run
AVERAGE_LAST = 3  # checkpoints averaged at the end (kept only if it validates at least as well)
TIMED_VALID_SENTENCES = 500  # under a time budget validation BLEU decodes this many pairs
# Fine-tuning a trained model (init_from) is planned apart: the architecture, tokenizer and dropout are the model's,
# and a model nmt trained is fine-tuned at the peak rate it was trained with (nmt.training.run.inherited reads it
# from its training.json). A d128 model trained 6 minutes on Tatoeba's short half, fine-tuned 400 steps on its long
# half (docs/configuration.md): validation BLEU 10.5 at the start; 3e-5 and 1e-4 never beat it, 3e-4 12.4, 1e-3
# 16.7, its own 1.3e-3 20.5 with the from-scratch warmup (12%) and 17.8 with a 5% one: inverse_sqrt decays from the
# warmup's end, so a shorter warmup is a lower rate for the rest of the run.
# A model of unknown training (an import) is fine-tuned at FINETUNE_LR: an OPUS-MT-style Marian (d256, 3+3 layers,
# 55 min of the HF recipe on Tatoeba less the pairs naming Tom or Mary), 10 minutes on those (benchmarks/finetune.py,
# docs/configuration.md): test BLEU new / old domain 15.6 / 40.6 at the start; 3e-5 46.9 / 40.5, 5e-5 47.6 / 39.4,
# 1e-4 47.8 / 38.1: 5e-5 gains within 0.2 of 1e-4 and forgets half as much.
FINETUNE_LR = 5e-5
# LoRA r8 (only the adapters train, from zero) on the same start and budget: 3e-4 45.5 / 39.1, 1e-3 44.8 / 37.5,
# 3e-3 45.1 / 35.4.
LORA_LR = 3e-4

# the keys a plan may choose, in the order it prints them
# the defaults nmt changed because they measured better (docs/results.md), printed with the plan when in force
MEASURED_DEFAULTS = {
    "tokenizer.split_punctuation": "nmt's default: each punctuation mark its own pre-token measured +1.6 test BLEU "
                                   "on Tatoeba en-de at 12 minutes, 3 runs each (docs/results.md)",
    "model.init_std": "nmt's default from d_model 128: matrices drawn from N(0, 0.02) as transformers' Marian, "
                      "attention's input projections and the embeddings as Xavier's start; measured against both "
                      "on the quickstart and on Tatoeba en-de and Bible en-fr (docs/results.md)",
}

KEYS = ("max_epochs", "tokenizer.vocab_size", "model.size", *(f"model.{k}" for k in DIM_KEYS), "max_tokens",
        "model.dropout", "tokenizer.dropout", "optim.lr", "optim.warmup_steps", "optim.decay_steps", "eval_every",
        "save_every", "average_last", "keep_last", "eval_max_sentences")
# keys that follow the planned number of steps: re-planned when the real run's speed is known
STEP_KEYS = ("optim.warmup_steps", "optim.decay_steps", "eval_every", "save_every", "average_last", "keep_last")


@dataclass(frozen=True)
class Facts:
    """What the plan knows of the corpus: training pairs after cleaning, and the cost of an epoch (padded tokens of
    the longer side summed over the pairs) and of its costliest pair."""

    train_pairs: int
    epoch_cost: int = 0
    longest_cost: int = 0
    # the training sampler's optimizer steps in an epoch for a max_tokens (exact; None: estimated from epoch_cost)
    epoch_steps: Callable[[int], int] | None = field(default=None, compare=False, repr=False)
    # the tokenizer's requested size as data.prepare trained it (chosen there by `vocab_size_for` when left open,
    # before the plan could run: the plan records that choice, it does not make a second one); None: no corpus yet
    vocab_size: int | None = None


@dataclass
class Plan:
    """What nmt chose, the value and one reason per key, and the run's expected length."""

    chosen: dict[str, Any] = field(default_factory=dict)  # dotted key -> value, as in the resolved config
    reasons: dict[str, str] = field(default_factory=dict)  # dotted key -> why
    steps: int | None = None  # optimizer steps expected (None: unknown)
    epochs: float | None = None
    minutes: float | None = None  # the time budget
    seconds_per_token: float | None = None  # measured on the chosen model, one process
    retimed: dict | None = None  # the re-plan after the first real steps (`retime`)
    precision: list | None = None  # [mixed precision, why] when nmt chose it (`precision_for`); None: the launcher's
    init_from: str | None = None  # fine-tuning: the model directory the run starts from
    given: dict[str, list] = field(default_factory=dict)  # fine-tuning: key -> [value, note], a setting kept over the rule
    defaults: dict[str, list] = field(default_factory=dict)  # key -> [value, why]: a default nmt changed on measurement

    def lines(self) -> list[str]:
        """The printed plan: one line per value nmt chose, with its reason; nothing for the values given."""
        precision = [f"  precision {self.precision[0]}: {self.precision[1]}"] if self.precision else []
        given = [f"  {key} {show(value)}: {note}" for key, (value, note) in {**self.given, **self.defaults}.items()]
        if not self.chosen and not precision and not given:
            return ["plan: every setting given; nothing chosen"]
        head = ("plan: fine-tuning " + self.init_from + ", " if self.init_from else "plan: ") + "chosen for " + \
            (f"the {self.minutes:g}-minute budget" if self.minutes else "this corpus") + \
            (f" (~{self.steps:,} steps, {self.epochs:.1f} epochs)" if self.steps and self.epochs else "") + \
            "; set a key to override it"
        return [head] + precision + [f"  {key} {show(self.chosen[key])}: {self.reasons[key]}" for key in self.chosen] \
            + given

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        return cls(**{k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(cls)}})


def show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:g}" if isinstance(value, float) else str(value)


# --- what is open ------------------------------------------------------------------------------------------


def get(cfg: TrainConfig, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def put(cfg: TrainConfig, values: dict[str, Any]) -> TrainConfig:
    """`cfg` with the dotted `values` set (a new config; sections replaced, not mutated)."""
    sections: dict[str, dict] = {}
    top = {}
    for key, value in values.items():
        section, _, name = key.rpartition(".")
        (sections.setdefault(section, {}) if section else top)[name] = value
    replaced = {s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()}
    return dataclasses.replace(cfg, **top, **replaced)


def open_keys(cfg: TrainConfig) -> list[str]:
    """The keys `cfg` leaves to the plan, in KEYS order."""
    out = []
    for key in KEYS:
        if key == "max_epochs":
            is_open = cfg.max_epochs is None and cfg.max_steps is None
        elif key == "model.size":
            is_open = cfg.model.size == "auto" and any(getattr(cfg.model, k) is None for k in DIM_KEYS)
        elif key == "tokenizer.dropout":
            is_open = cfg.tokenizer.dropout is None and cfg.tokenizer.kind == "bpe"
        elif key == "optim.decay_steps":
            is_open = cfg.optim.schedule == "linear" and cfg.optim.decay_steps is None
        else:
            is_open = get(cfg, key) is None
        if is_open:
            out.append(key)
    return out


# --- the rule --------------------------------------------------------------------------------------------


def size_row(train_pairs: int) -> tuple[int, str]:
    """(vocab_size, widest model) for a corpus of `train_pairs` training pairs."""
    for below, vocab_size, widest in SIZES:
        if below is None or train_pairs < below:
            return vocab_size, widest
    raise AssertionError("SIZES ends with an open row")


def vocab_size_for(train_pairs: int) -> int:
    """tokenizer.vocab_size for a corpus of `train_pairs` training pairs (after cleaning)."""
    return size_row(train_pairs)[0]


def rung(name: str) -> Dims:
    return next(r for r in RUNGS if r.name == name)


def allowed(train_pairs: int) -> list[Dims]:
    """The shapes a corpus of this size may use, smallest first; tiny only for smoke-test corpora."""
    widest = size_row(train_pairs)[1]
    if widest == "tiny":
        return [RUNGS[0]]
    return list(RUNGS[1:[r.name for r in RUNGS].index(widest) + 1])


def flops_per_token(m: Dims) -> float:
    """Relative training cost per token of a shape: the layers' matrix products (attention's length terms and the
    vocabulary projection, much the same for every shape, left out)."""
    d, ff = m.d_model, m.d_ff
    return m.n_encoder_layers * (4 * d * d + 2 * d * ff) + m.n_decoder_layers * (8 * d * d + 2 * d * ff)


@dataclass(frozen=True)
class Limits:
    """What bounds the run: a time budget (the minutes left for training) and step or epoch limits."""

    minutes: float | None
    max_steps: int | None
    max_epochs: int | None
    processes: int = 1
    accum_steps: int = 1


def steps_per_epoch(facts: Facts, max_tokens: int, limits: Limits) -> int:
    if facts.epoch_steps is not None:
        return facts.epoch_steps(max_tokens)
    return max(1, math.ceil(facts.epoch_cost / (max_tokens * FILL * limits.processes * limits.accum_steps)))


def step_seconds(per_token: float, timed: Dims, model: Dims, max_tokens: int, limits: Limits) -> float:
    """Seconds of one optimizer step of `model`, from seconds per token measured on `timed`."""
    return per_token * flops_per_token(model) / flops_per_token(timed) * max_tokens * FILL * limits.accum_steps


def expected_steps(facts: Facts, limits: Limits, step_s: float | None, max_tokens: int) -> int | None:
    """Optimizer steps the run will take: the least of max_steps, max_epochs and what the time budget allows
    (None: nothing bounds it that the plan can count)."""
    bounds = [b for b in (limits.max_steps,) if b]
    if limits.max_epochs:
        bounds.append(limits.max_epochs * steps_per_epoch(facts, max_tokens, limits))
    if limits.minutes is not None and step_s:
        bounds.append(int(60 * limits.minutes * TRAIN_SHARE / step_s))
    return max(1, min(bounds)) if bounds else None


# (a shape, tokens a micro-batch) -> seconds per cost token of training it so (one process); None: a batch that size
# does not fit the device's memory
Speed = Callable[[Dims, int], float | None]


def batches_for(device: str | None) -> tuple[int, ...]:
    """The batch sizes (tokens a micro-batch) the plan chooses from on `device`, largest first."""
    return BATCHES if device is None or device.split(":")[0] == "cpu" else GPU_BATCHES


def resolve(cfg: TrainConfig, facts: Facts, *, speed: Speed | None = None, processes: int = 1,
            minutes_left: float | None = None, previous: Plan | None = None,
            inherited: dict[str, str] | None = None, batches: tuple[int, ...] = BATCHES) -> tuple[TrainConfig, Plan]:
    """`cfg` with every open field chosen, and the plan that says what was chosen and why.

    Args:
        cfg: the configuration as the user gave it (null: choose), after init_from filled what the model
            directory fixes (`inherited`: those keys and their reason).
        facts: the corpus (`Facts`).
        speed: times a shape on real training steps (None: no timing; a time budget then cannot be planned).
        processes: the launch's process count (batches are per process).
        minutes_left: the time budget left for training (default cfg.max_minutes).
        previous: the plan of the run being resumed: its choices are kept, nothing is timed again.
        batches: the batch sizes to choose from (`batches_for` the device), largest first.
    """
    if previous is not None:
        return _kept(cfg, facts, previous, speed, processes, minutes_left, inherited or {}, batches)
    choose = _Chooser(cfg, Plan(minutes=cfg.max_minutes, init_from=cfg.init_from), open_keys(cfg))
    limits = _limits(choose, minutes_left, speed, processes)
    choose("tokenizer.vocab_size", facts.vocab_size or vocab_size_for(facts.train_pairs),
           f"for {facts.train_pairs:,} training pairs")
    if cfg.init_from is None and cfg.tokenizer.split_punctuation is True:  # a tokenizer trained here, the default
        choose.plan.defaults["tokenizer.split_punctuation"] = [True, MEASURED_DEFAULTS["tokenizer.split_punctuation"]]
    dims, timed = _shape(choose, facts, limits, speed, batches)
    if cfg.init_from is None and choose.cfg.model.mixed_start():  # fresh weights
        choose.plan.defaults["model.init_std"] = ["null", MEASURED_DEFAULTS["model.init_std"]]
    choose.plan.seconds_per_token = timed.per_token if timed else None

    def seconds(tokens: int) -> float | None:
        """Seconds of an optimizer step of `dims` in batches of `tokens` (None: not timed, or does not fit)."""
        if not timed:
            return None
        per_token = timed.per_token if tokens == timed.tokens else speed(dims, tokens)
        return None if per_token is None else step_seconds(per_token, timed.dims, dims, tokens, limits)

    _batch_size(choose, facts, limits, seconds, batches)
    tokens = choose.cfg.max_tokens
    steps = expected_steps(facts, limits, seconds(tokens), tokens)
    epochs = steps / steps_per_epoch(facts, tokens, limits) if steps else 0.0
    choose.plan.steps, choose.plan.epochs = steps, epochs or None
    choose("model.dropout", *dropout_for(facts.train_pairs, epochs))
    choose("tokenizer.dropout", *bpe_dropout_for(facts.train_pairs, epochs))
    choose("optim.lr", *lr_for(choose.cfg))
    for key, (value, why) in step_choices(steps or 1, choose.cfg, choose.keys, timed=limits.minutes is not None).items():
        choose(key, value, why)
    sentences = TIMED_VALID_SENTENCES if limits.minutes is not None else None
    choose("eval_max_sentences", sentences, ("under a time budget, BLEU on the first validation pairs" + (
        "" if cfg.init_from else " (the loss only during the warmup)")) if sentences else "all validation pairs")
    if cfg.init_from:
        _note_given(choose, steps or 1, limits.minutes is not None, inherited or {})
    return _finish(choose.cfg, choose.plan, inherited or {}), choose.plan


def lr_for(cfg: TrainConfig) -> tuple[float, str]:
    """The peak learning rate and why: from scratch 1.1e-3 x sqrt(192 / d_model); fine-tuning (init_from) a trained
    model FINETUNE_LR, its LoRA adapters LORA_LR, whatever the width."""
    if cfg.init_from and cfg.finetune.lora_r:
        return LORA_LR, (f"LoRA (rank {cfg.finetune.lora_r}) on a trained model: the adapters start from zero; of 3e-4 "
                         "to 3e-3 on an imported OPUS-MT-style model it gained and kept the most (docs/configuration.md)")
    if cfg.init_from:
        return FINETUNE_LR, ("fine-tuning a model of unknown training (no training.json, e.g. an imported one): of "
                             "3e-5 to 1e-4 on an imported OPUS-MT-style model, it gained as much as the highest on the "
                             "new domain and lost half as much on the old (docs/configuration.md)")
    d = cfg.model.d_model
    return float(f"{LR_AT_192 * math.sqrt(192 / d):.2g}"), f"for d_model {d} (1.1e-3 x sqrt(192/d))"


def _note_given(choose: _Chooser, steps: int, timed: bool, inherited: dict[str, str]) -> None:
    """Fine-tuning: the settings of the fine-tuning rule that the user gave, printed as kept, with the rule's value."""
    cfg = choose.cfg
    keys = [k for k in ("optim.lr", "optim.warmup_steps", "eval_every") if k not in choose.keys and k not in inherited]
    rule = {k: v for k, (v, _) in step_choices(steps, cfg, keys, timed=timed).items()}
    rule["optim.lr"] = lr_for(cfg)[0]
    for key in keys:
        value = get(cfg, key)
        choose.plan.given[key] = [value, "given, the fine-tuning rule's too" if value == rule[key] else
                                  f"given, kept over the fine-tuning rule's {show(rule[key])}"]


def _kept(cfg: TrainConfig, facts: Facts, previous: Plan, speed: Speed | None, processes: int,
          minutes_left: float | None, inherited: dict[str, str], batches: tuple[int, ...]) -> tuple[TrainConfig, Plan]:
    """A resumed run's resolution: the choices of its plan, for the keys still open."""
    keys = open_keys(cfg)
    kept = {k: previous.chosen[k] for k in keys if k in previous.chosen}
    plan = dataclasses.replace(previous, chosen=kept, reasons={k: previous.reasons[k] for k in kept})
    named = "model.size" in kept  # the shape's fields come with its name
    if any(k not in kept and not (named and k.removeprefix("model.") in DIM_KEYS) for k in keys):
        # a key the run's plan did not choose then: chosen now, the kept ones as given
        cfg, fresh = resolve(put(cfg, kept), facts, speed=speed, processes=processes, minutes_left=minutes_left,
                             batches=batches)
        plan.chosen, plan.reasons = {**kept, **fresh.chosen}, {**plan.reasons, **fresh.reasons}
    return _finish(cfg, plan, inherited), plan


def _limits(choose: _Chooser, minutes_left: float | None, speed: Speed | None, processes: int) -> Limits:
    """What bounds the run. Without an epoch or step limit a time budget ends it, else DEFAULT_EPOCHS do."""
    cfg = choose.cfg
    minutes = cfg.max_minutes if minutes_left is None else minutes_left
    limits = Limits(minutes if speed is not None else None, cfg.max_steps, cfg.max_epochs, processes, cfg.accum_steps)
    if cfg.max_epochs is None and cfg.max_steps is None:
        if cfg.max_minutes is not None:
            choose("max_epochs", None, f"the {cfg.max_minutes:g}-minute budget ends the run")
        else:
            choose("max_epochs", DEFAULT_EPOCHS, "no time budget, step or epoch limit given")
    if not (limits.minutes or limits.max_steps or limits.max_epochs):  # no budget, or one not timed (nmt check)
        limits = dataclasses.replace(limits, max_epochs=DEFAULT_EPOCHS)
    return limits


def _shape(choose: _Chooser, facts: Facts, limits: Limits, speed: Speed | None,
           batches: tuple[int, ...]) -> tuple[Dims, Timed | None]:
    """The model's shape (given, or the widest allowed that sees MIN_EPOCHS in the budget), and its timing when a
    time budget needs one."""
    keys, timed = choose.keys, None
    sizes = batches if "max_tokens" in keys else (choose.cfg.max_tokens,)  # a batch size given is the one timed
    if any(getattr(choose.cfg.model, k) is None for k in DIM_KEYS):
        model, why, timed = _choose_model(facts, limits, speed, sizes)
        shape = (f"d_model {model.d_model}, {model.n_heads} heads, {model.n_encoder_layers}+{model.n_decoder_layers} "
                 f"layers, d_ff {model.d_ff}")
        if all(f"model.{k}" in keys for k in DIM_KEYS):  # a named size: the config says which, the line its shape
            choose("model.size", model.name, f"{shape}; {why}")
            choose.cfg = put(choose.cfg, {f"model.{k}": getattr(model, k) for k in DIM_KEYS})
        else:
            for k in DIM_KEYS:
                choose(f"model.{k}", getattr(model, k), f"the rest of model {model.name} ({shape})")
    name = choose.cfg.model.size if choose.cfg.model.size != "auto" else "given"
    dims = Dims(name, *(get(choose.cfg, f"model.{k}") for k in DIM_KEYS))
    if speed is not None and limits.minutes is not None and (timed is None or timed[0][1:] != dims[1:]):
        timed = _fitting(speed, dims, sizes)  # the shape that trains: small models run below their FLOP share
    return dims, timed


class Timed(NamedTuple):
    """A timing: the shape, the tokens a micro-batch, seconds per cost token."""

    dims: Dims
    tokens: int
    per_token: float


def _fitting(speed: Speed, dims: Dims, sizes: tuple[int, ...]) -> Timed:
    """`dims` timed at the largest of `sizes` whose batch fits the device's memory."""
    for tokens in sizes:
        per_token = speed(dims, tokens)
        if per_token is not None:
            return Timed(dims, tokens, per_token)
    from nmt.errors import NmtError

    raise NmtError(f"a training step of model {dims.name} (d_model {dims.d_model}) runs out of memory in batches of "
                   f"{sizes[-1]:,} tokens; give a smaller max_tokens (and raise accum_steps to keep the batch), "
                   "model.checkpoint_activations: true, or a smaller model.size")


def _batch_size(choose: _Chooser, facts: Facts, limits: Limits, seconds: Callable[[int], float | None],
                batches: tuple[int, ...]) -> None:
    """The largest of `batches` that fits the device's memory and still allows TARGET_STEPS updates in the budget;
    short of them, halved while halving buys at least HALVING_GAIN times the updates (a compute-bound device: a CPU
    doubles them; a launch-bound GPU adds few and keeps the larger batch); never below the costliest pair. Without a
    time budget (nothing timed) BATCHES[0]."""
    tokens, why = BATCHES[0], "no time budget"
    if limits.minutes is not None and choose.plan.seconds_per_token is not None:  # timed
        steps, too_big = 0, []
        for size in batches:
            step_s = seconds(size)
            if step_s is None:
                too_big.append(size)
                continue
            more = expected_steps(facts, limits, step_s, size)
            if steps and more < HALVING_GAIN ** math.log2(tokens / size) * steps:
                why = (f"~{steps:,} steps with it: {size:,} tokens would give ~{more:,}, under {HALVING_GAIN:g}x the "
                       "updates a halving (the device is not compute-bound there)")
                break
            tokens, steps = size, more
            if steps >= TARGET_STEPS:
                why = f"~{steps:,} steps with it >= {TARGET_STEPS:,}: the largest batch that allows them"
                break
        else:
            why = f"~{steps:,} steps with it: no batch of {', '.join(f'{b:,}' for b in batches)} tokens allows " \
                  f"{TARGET_STEPS:,}, so the smallest (more updates)"
        if too_big:
            why += f"; {', '.join(f'{b:,}' for b in too_big)} did not fit the device's memory"
    if tokens < facts.longest_cost:
        tokens, why = facts.longest_cost, f"the longest training pair costs {facts.longest_cost:,} tokens"
    choose("max_tokens", tokens, why)


def step_choices(steps: int, cfg: TrainConfig, keys: list[str], timed: bool,
                 every: int | None = None) -> dict[str, tuple[Any, str]]:
    """The values that follow the number of steps (warmup, validation cadence, averaging, a linear schedule's
    end), for the keys among `keys`; `cfg` holds the values given or chosen before. `every`: the validation
    cadence when the time validations take is known (`retime`), else ~VALIDATIONS in the run."""
    out: dict[str, tuple[Any, str]] = {}
    warmup = max(1, min(MAX_WARMUP, round(WARMUP_SHARE * steps)))
    out["optim.warmup_steps"] = warmup, f"{WARMUP_SHARE:.0%} of ~{steps:,} steps" + (
        ", as from scratch: inverse_sqrt decays from the warmup's end, and fine-tuning with 5% validated lower"
        if cfg.init_from else "")
    out["optim.decay_steps"] = steps, ("the linear schedule ends with the budget's steps" if timed else
                                       "the linear schedule ends with the run's last step")
    why = f"~{VALIDATIONS} validations in ~{steps:,} steps" if every is None else "the validations that fit the time left"
    if cfg.init_from:
        why += ", each scoring BLEU against the start's (validated before step 1)"
    every = every or max(1, steps // VALIDATIONS)
    out["eval_every"] = every, why
    out["save_every"] = (cfg.eval_every if "eval_every" not in keys else every), "with each validation"
    save_every = cfg.save_every if "save_every" not in keys else out["save_every"][0]
    average = AVERAGE_LAST if steps // save_every >= 2 * AVERAGE_LAST else 0
    out["average_last"] = average, (f"the last {AVERAGE_LAST} checkpoints, kept if no worse" if average else
                                    f"fewer than {2 * AVERAGE_LAST} checkpoints to average")
    avg = cfg.average_last if "average_last" not in keys else average
    out["keep_last"] = max(avg or 0, 2), "enough to average" if (avg or 0) > 2 else "the last 2 besides best/"
    return {k: v for k, v in out.items() if k in keys}


class _Chooser:
    """Sets a key that `cfg` leaves open, recording the value and its reason; a given key stays as it is."""

    def __init__(self, cfg: TrainConfig, plan: Plan, keys: list[str]):
        self.cfg, self.plan, self.keys = cfg, plan, keys

    def __call__(self, key: str, value: Any, why: str) -> None:
        if key not in self.keys:
            return
        self.cfg = put(self.cfg, {key: value})
        if value is not None or key in ("max_epochs", "eval_max_sentences"):
            self.plan.chosen[key], self.plan.reasons[key] = value, why


def _choose_model(facts: Facts, limits: Limits, speed: Speed | None,
                  sizes: tuple[int, ...]) -> tuple[Dims, str, Timed | None]:
    """The widest allowed shape that sees MIN_EPOCHS epochs in the budget (else the narrowest), why, and the
    timing made on the way: the widest shape at the largest of `sizes` that fits, whose rate per token stands for
    every shape's (scaled by its FLOPs)."""
    shapes = allowed(facts.train_pairs)
    names = ", ".join(r.name for r in shapes)
    if speed is None or limits.minutes is None:
        return shapes[-1], f"the widest for {facts.train_pairs:,} training pairs (no time budget)", None
    timed = _fitting(speed, shapes[-1], sizes)
    epochs, tokens = 0.0, sizes[-1]
    for m in reversed(shapes):
        steps = expected_steps(facts, limits, step_seconds(timed.per_token, timed.dims, m, tokens, limits), tokens)
        epochs = steps / steps_per_epoch(facts, tokens, limits)
        if epochs >= MIN_EPOCHS:
            return m, (f"the widest of {names} that sees >= {MIN_EPOCHS:g} epochs in the budget (~{epochs:.1f} by "
                       f"timing {timed.dims.name})"), timed
    return shapes[0], (f"the narrowest of {names}: none sees {MIN_EPOCHS:g} epochs (~{epochs:.1f} for it by timing "
                       f"{timed.dims.name})"), timed


def dropout_for(train_pairs: int, epochs: float) -> tuple[float, str]:
    if train_pairs < 1_000 or epochs < 2:
        return 0.0, "under 2 epochs or a smoke-test corpus: nothing to overfit"
    if train_pairs < 20_000:
        return 0.2, "under 20k training pairs: many epochs over little data"
    return 0.1, "20k training pairs or more"


def bpe_dropout_for(train_pairs: int, epochs: float) -> tuple[float, str]:
    """BPE_DROPOUT for MANY_EPOCHS or more over 1k to 20k pairs, else 0 (off); and why."""
    if 1_000 <= train_pairs < 20_000 and epochs >= MANY_EPOCHS:
        return BPE_DROPOUT, f"~{epochs:.0f} epochs over under 20k training pairs: each epoch segmented anew"
    return 0.0, f"on only for {MANY_EPOCHS:g} epochs or more over under 20k training pairs"


def _finish(cfg: TrainConfig, plan: Plan, inherited: dict[str, str]) -> TrainConfig:
    """The resolved config: the plan's choices set; the keys init_from fixed join the plan with their reason."""
    out = put(cfg, plan.chosen)
    plan.chosen = {k: plan.chosen[k] for k in KEYS if k in plan.chosen}
    if inherited:
        plan.chosen = {**{k: get(out, k) for k in KEYS if k in inherited}, **plan.chosen}
        plan.reasons = {**inherited, **plan.reasons}
    return out


# --- re-planning once the real run's speed is known ----------------------------------------------------------


def precision_for(max_minutes: float | None, launched: str | None, native_bf16: bool,
                  gpu: bool = False) -> tuple[str, str | None]:
    """The mixed precision a run trains in and why (None: the launcher chose it, `accelerate launch`, a profile or
    ACCELERATE_MIXED_PRECISION). On a GPU always mixed: bf16 where it has bf16 units (Ampere and later), else fp16
    with a loss scaler (a GPU's fp32 units are a fraction of its half-precision ones). On a CPU, under a time
    budget, bf16 where it multiplies bf16 in hardware: more steps in the same minutes (1.55x on a 2-core
    AVX512-BF16 CPU, benchmarks/train_speed.py), which validated better (docs/results.md); else fp32 ("no")."""
    if launched is not None:
        return launched, None
    if gpu:
        if native_bf16:
            return "bf16", "a GPU with bf16 units: its tensor cores, fp32's range (ACCELERATE_MIXED_PRECISION=no: fp32)"
        return "fp16", ("a GPU without bf16 units (before Ampere): fp16 with a loss scaler "
                        "(ACCELERATE_MIXED_PRECISION=no: fp32)")
    if max_minutes is not None and native_bf16:
        return "bf16", "for the time budget: this device multiplies bf16 in hardware (ACCELERATE_MIXED_PRECISION=no: fp32)"
    return "no", None


@dataclass(frozen=True)
class Measured:
    """What a run measured of itself, for `retime`: at optimizer step `step`, after `elapsed_s` seconds of its budget,
    its steps' mean wall time and, once one has decoded, a validation's."""

    step: int
    seconds_per_step: float
    elapsed_s: float
    validation_s: float | None = None


def settings(cfg: TrainConfig, plan: Plan | None) -> TrainConfig:
    """The settings a run trains with now: its resolved `cfg` with the values its plan re-timed (`retime`)."""
    if plan is None or not plan.retimed:
        return cfg
    return put(cfg, {k: plan.chosen[k] for k in STEP_KEYS if k in plan.chosen})


def retime(plan: Plan, measured: Measured, cfg: TrainConfig) -> Plan:
    """The plan again for the time left, at the real run's measured speed (data loading and Python overhead
    included, which the timed probe misses) and, once one has decoded, a validation's time: then as many of the
    validations left as fit in VALID_SHARE of the time left, and the steps in the rest. The keys that follow the
    number of steps and that nmt chose are re-planned; a warmup already passed stays. `cfg` is the run's resolved
    config, which stays as it is: `settings(cfg, plan)` applies the result.
    A pure function of its inputs, which the run saves (plan.json), so a resumed run continues the same plan."""
    now, step = settings(cfg, plan), measured.step
    left_s = max(60 * plan.minutes - measured.elapsed_s, 0.0)
    every = None
    if measured.validation_s:
        done = step // now.eval_every if now.eval_every else 0
        validations = max(1, min(VALIDATIONS - done, int(VALID_SHARE * left_s / measured.validation_s)))
        steps_left = int(max(left_s - validations * measured.validation_s, 0.0) / measured.seconds_per_step)
        every = max(1, steps_left // validations)
    else:
        steps_left = int(left_s * TRAIN_SHARE / measured.seconds_per_step)
    steps = step + max(1, steps_left)
    keys = [k for k in STEP_KEYS if k in plan.chosen]
    if now.optim.warmup_steps is not None and now.optim.warmup_steps <= step and "optim.warmup_steps" in keys:
        keys.remove("optim.warmup_steps")  # the lr has already reached its peak
    values = {k: v for k, (v, _) in step_choices(steps, now, keys, timed=True, every=every).items()}
    new = dataclasses.replace(plan, chosen={**plan.chosen, **values}, steps=steps, retimed={
        "at_step": step, "seconds_per_step": measured.seconds_per_step, "validation_s": measured.validation_s,
        "elapsed_s": measured.elapsed_s, "steps": steps, "values": values})
    if plan.epochs and plan.steps:
        new.epochs = plan.epochs * steps / plan.steps
    return new


def retime_line(plan: Plan, planned_step_s: float | None) -> str:
    r = plan.retimed
    was = f" (the probe said {planned_step_s:.3g})" if planned_step_s else ""
    valid = f", {r['validation_s']:.3g} s a validation" if r.get("validation_s") else ""
    values = ", ".join(f"{k} {show(v)}" for k, v in r["values"].items())
    return (f"nmt: re-timed at step {r['at_step']:,}: {r['seconds_per_step']:.3g} s a step{was}{valid}, so ~"
            f"{r['steps']:,} steps in the budget" + (f"; {values}" if values else ""))
