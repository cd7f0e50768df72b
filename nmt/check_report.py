"""The report of `nmt check` (`preflight`): its numbers, and the few lines it prints for the terminal."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nmt.config import TrainConfig


@dataclass
class Report:
    """The numbers of a pre-flight check; `problems` says what to change, `lines()` is the printout."""

    num_processes: int
    pairs: dict[str, int]  # pairs per split after cleaning
    read: int  # training pairs read before cleaning
    dropped: dict[str, int]  # training pairs dropped by cleaning, by reason
    carved: list[str]  # splits carved off train (valid_ratio / test_ratio)
    src_len: dict[str, int]  # training source length percentiles ("p50", "p90", "p99", "max"), subwords + </s>
    tgt_len: dict[str, int]  # the same for targets as the decoder sees them (subwords + </s>)
    joint_vocab: bool
    src_vocab_size: int
    tgt_vocab_size: int
    unk_rate: dict[str, float]  # share of <unk> subwords in the validation set, "src" and "tgt"
    tokens_per_epoch: dict[str, int]  # real training tokens, "src" and "tgt" (with </s>)
    padding_share: float  # share of the padded micro-batch tensors that is padding
    steps_per_epoch: int  # optimizer steps per epoch (the same on every process)
    micro_batches_per_epoch: int  # per process: steps_per_epoch * accum_steps
    total_steps: int  # what the run will train: max_steps, or max_epochs * steps_per_epoch
    n_params: int
    memory: dict[str, int]  # bytes per process: "states" (16 B/param), "activations" (max_tokens batch), "total"
    seconds_per_step: float | None = None  # from the timed probe (None: not probed)
    seconds_per_epoch: float | None = None
    probe_device: str = ""
    precision: str = "no"  # the mixed precision the probe (and training) ran in
    probe_steps: int = 0
    measured_peak: int | None = None  # bytes, CUDA only: torch.cuda.max_memory_allocated during the probe
    overlap: str | None = None  # validation/test pairs that also occur in train (nmt.data.overlap_line)
    corpora: list[dict] = field(default_factory=list)  # several training corpora: each one's pair, pairs, share
    plan: list[str] = field(default_factory=list)  # the plan's printout (nmt.plan.Plan.lines): what nmt chose, why
    fit: dict | None = None  # init_from: the old tokenizer on the new training data, and on its own (tokenizer_fit)
    cfg: TrainConfig | None = field(default=None, repr=False)
    problems: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """A few lines for the terminal; the problems last, one per line."""
        cfg = self.cfg
        out = [f"data      {_pairs(self.pairs)} pairs{_carved(self.carved)}; cleaning kept {self.pairs['train']:,} "
               f"of {self.read:,} training pairs read{_dropped(self.dropped)}",
               *([f"overlap   {self.overlap}"] if self.overlap else []),
               *([f"corpora   {_corpora(self.corpora, cfg)}"] if self.corpora else []),
               f"lengths   subword tokens with </s>, training set: source {_pct(self.src_len)}; "
               f"target {_pct(self.tgt_len)}",
               f"vocab     {_vocab(self)}; unknown on validation: source {self.unk_rate['src']:.2%}, "
               f"target {self.unk_rate['tgt']:.2%}",
               *self.plan,
               f"epoch     {_n(self.tokens_per_epoch['src'])} source + {_n(self.tokens_per_epoch['tgt'])} target tokens; "
               f"{self.steps_per_epoch:,} optimizer steps ({self.micro_batches_per_epoch:,} micro-batches per process: "
               f"max_tokens {cfg.max_tokens:,} x {_processes(self.num_processes)} x {cfg.accum_steps} accum_steps); "
               f"padding {self.padding_share:.0%}{_dropout(cfg)}",
               f"run       {self.total_steps:,} steps = {self.total_steps / self.steps_per_epoch:.1f} epochs "
               f"({_limit(cfg)})"]
        if self.seconds_per_step is not None:
            out.append(f"time      {self.seconds_per_step:.3g} s/step on {self.probe_device}{_precision(self.precision)} "
                       f"({self.probe_steps} timed "
                       f"step{'s' if self.probe_steps > 1 else ''} after a warm-up{_per_device(self)}) -> "
                       f"{_duration(self.seconds_per_epoch)} per epoch, "
                       f"{_duration(self.seconds_per_step * self.total_steps)} for the run (validation not included)")
            if cfg.max_minutes is not None:  # the wall-clock budget stops the run first when it is shorter
                steps = min(self.total_steps, int(60 * cfg.max_minutes / self.seconds_per_step))
                out[-1] += (f"; max_minutes {cfg.max_minutes:g} allows ~{steps:,} steps "
                            f"({steps / self.steps_per_epoch:.1f} epochs)")
        peak = f"; measured peak {_gb(self.measured_peak)}" if self.measured_peak else ""
        out.append(f"model     {self.n_params / 1e6:.2f}M parameters; memory per process ~{_gb(self.memory['total'])} = "
                   f"{_gb(self.memory['states'])} weights+grads+Adam (16 B/param, fp32) + {_gb(self.memory['activations'])} "
                   f"activations of a max_tokens batch{peak}")
        if self.fit:
            out.append(_fit(self.fit))
        out += [f"problem   {p}" for p in self.problems] or ["problems  none found"]
        return out


# --- formatting ---------------------------------------------------------------------------------------------


def _dropout(cfg: TrainConfig) -> str:
    p = cfg.tokenizer.dropout
    return f" (epoch 0 under BPE-dropout p={p:g}: the segmentation changes each epoch)" if p else ""


def _processes(n: int) -> str:
    return f"{n} process{'es' if n > 1 else ''}"


def _precision(precision: str) -> str:
    return "" if precision == "no" else f" in {precision}"


def _per_device(r: Report) -> str:
    return f"; each of the {r.num_processes} processes on a {r.probe_device} like it" if r.num_processes > 1 else ""


def _corpora(corpora: list[dict], cfg: TrainConfig) -> str:
    """Each training corpus's share of an epoch (data.weights, data.temperature), e.g.
    "en-de 1,000 pairs -> 1,000 per epoch (50.0%), de-en ... (temperature 5)"."""
    each = ", ".join(f"{c['pair']} {c['train']}: {c['pairs']:,} pairs -> {c['per_epoch']:,} per epoch "
                     f"({100 * c['share']:.1f}%)" for c in corpora)
    return f"{each} (data.temperature {cfg.data.temperature:g})"


def _pairs(pairs: dict[str, int]) -> str:
    return " / ".join(f"{name} {n:,}" for name, n in pairs.items())


def _carved(carved: list[str]) -> str:
    return f" ({' and '.join(carved)} carved off train)" if carved else ""


def _dropped(dropped: dict[str, int]) -> str:
    if not dropped:
        return ", nothing dropped"
    return ", dropped: " + ", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1]))


def _pct(p: dict[str, int]) -> str:
    return " / ".join(f"{k} {v}" for k, v in p.items())


def _fit(fit: dict) -> str:
    def side(s: str, name: str) -> str:
        new, old = fit["new"][s], (fit["old"] or {}).get(s)
        was = f" ({old['subwords_per_word']:.2f} on its own training data)" if old else ""
        return f"{name} {new['subwords_per_word']:.2f} subwords/word{was}, {new['unk_rate']:.2%} <unk>"

    return f"init_from {fit['dir']}: its tokenizer on this training data: {side('src', 'source')}; {side('tgt', 'target')}"


def _vocab(r: Report) -> str:
    if r.joint_vocab:
        return f"joint {r.src_vocab_size:,} subwords"
    return f"separate: source {r.src_vocab_size:,}, target {r.tgt_vocab_size:,} subwords"


def _limit(cfg: TrainConfig) -> str:
    if cfg.max_steps:
        return "max_steps"
    return "max_epochs" if cfg.max_epochs else "planned for max_minutes"


def _n(x: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.0f}"


def _gb(n_bytes: int | None) -> str:
    n_bytes = n_bytes or 0
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= size / 10:
            return f"{n_bytes / size:.3g} {unit}"
    return f"{n_bytes} B"


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
