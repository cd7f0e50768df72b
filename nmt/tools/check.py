"""Pre-flight check: what a config will train on, how long an epoch takes, and what looks wrong, before training.

`preflight(cfg)` reads and encodes the data (through the same cache as training), plans the epoch with the
training sampler for the launch's process count, times a few real AdamW steps of the configured model,
and returns a `Report` of numbers plus the problems found, each naming the setting to change (at the end of this
module: its numbers, and the few lines it prints for the terminal).
No Accelerator here: the probe runs training's own `train_step` on one device (`OneDevice`), as one process
of the launch would.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nmt.batching import TokenBatchSampler, bpe_dropout, deal
from nmt.checkpoint import read_summary
from nmt.config import ModelConfig, TrainConfig, read_yaml
from nmt.data import overlap_line, prepare
from nmt.encoding import pair_lengths
from nmt.errors import NmtError
from nmt.model import Seq2SeqTransformer
from nmt.tables import arrow_batches, column
from nmt.tokenizer import unknown_rate
from nmt.training import timing
from nmt.training.loop import default_device, run_precision
from nmt.training.run import inherited
from nmt.training.state import segmentation
from nmt.validate import check_run

MIN_VALID_PAIRS = 100  # fewer validation pairs make BLEU differences between checkpoints noise
MAX_DROPPED_SHARE = 0.5  # cleaning dropping more than this usually means misaligned or mis-parsed files
MAX_UNK_RATE = 0.01  # more unknown subwords than this on validation: the vocabulary misses characters
OVER_SEGMENTED = 1.5  # subwords per word over this multiple of the tokenizer's own corpus (init_from)
PERCENTILES = (50, 90, 99)
BYTES_FP32 = 4
# Under bf16 / fp16 autocast the tensors a layer keeps for the backward take this share of their fp32 bytes: 0.59
# with an attention kernel that keeps no H x L rows, 0.68 with the math one, whose rows stay fp32 (fitted to what
# autograd saves on the CPU, d128 and tiny models: tests/test_check.py)
AUTOCAST_SHARE = {"fused": 0.59, "math": 0.68}
# the loss's peak per target position, in 4-byte units of the vocabulary (benchmarks/memory.py --loss 8192 32000:
# the plain loss 2.93 GiB; nmt.kernels' fused one 0.98 over fp32 logits, 1.95 over bf16 ones)
LOSS_FLOATS = {"plain": 3.0, "fused": 1.0, "fused16": 2.0}
USABLE = 0.9  # of a GPU's memory, what training's tensors may hold: the CUDA context and the allocator take the rest


# --- the check --------------------------------------------------------------------------------------


def preflight(cfg: TrainConfig, num_processes: int = 1, probe_steps: int = 3, device: str | None = None,
              gpu_memory: int | None = None) -> Report:
    """Check `cfg` for a launch of `num_processes` processes; time `probe_steps` AdamW steps (0: no probe).

    Args:
        cfg: the training config, as `nmt train` would use it.
        num_processes: the launch's world size (processes over all nodes); batches are planned for it.
        probe_steps: timed optimizer steps of the real model on real batches, after one untimed warm-up.
        device: where to run the probe; default the first GPU, else the CPU.
        gpu_memory: bytes of the GPU to train on: the memory estimate (for a GPU's precision and attention
            kernel) must fit it, else the problem names the fixes. Default: the GPU here, if any.
    """
    if num_processes < 1:
        raise NmtError(f"--num-processes must be at least 1, got {num_processes}")
    check_run(cfg)  # ranges and paths, as training checks them first
    base = inherited(cfg)  # init_from: the model directory's tokenizer and sizes
    cfg, tokenizer = base.cfg, base.tokenizer
    corpus = prepare(cfg.data, cfg.tokenizer, tokenizer=tokenizer, max_positions=cfg.model.max_positions)
    here = default_device(device)  # where the probe runs: the first GPU, else the CPU
    precision, _ = run_precision(cfg, here.type)  # what training will use
    cfg, plan = timing.planned(cfg, corpus, processes=num_processes, device=device, precision=precision,
                                 inherited=base.reasons, timed=probe_steps > 0)  # the resolution training makes
    epoch = _epoch_zero(cfg, corpus, num_processes)
    model = _build(cfg.model, cfg.seed)
    target, estimated_in = here.type, precision
    if gpu_memory is None and target == "cuda":
        gpu_memory = torch.cuda.get_device_properties(here).total_memory
    elif gpu_memory is not None and target != "cuda":  # estimated for the GPU named, in the precision it would use
        target, estimated_in = "cuda", run_precision(cfg, "cuda")[0]
    report = _report(cfg, corpus, model, epoch, num_processes, plan.steps, estimated_in, target)
    report.gpu_memory = gpu_memory
    report.plan = plan.lines()
    if probe_steps > 0:
        probe(report, model, cfg, epoch, steps=probe_steps, device=device, precision=precision)
    longest = int(np.max(column(corpus.splits["train"], "cost")))
    report.problems = find_problems(report, cfg, cfg.model, longest)
    return report


@dataclass
class Epoch:
    """Epoch 0 as training will see it on one process: the training pairs, its batch plan and their lengths."""

    train: object  # the training split (under BPE-dropout: epoch 0's segmentation)
    plan: object  # the training sampler's plan of epoch 0 (nmt.batching)
    src_len: np.ndarray  # (N,) source lengths, subwords + </s>
    tgt_len: np.ndarray  # (N,) target lengths as the decoder sees them


def _epoch_zero(cfg: TrainConfig, corpus, num_processes: int) -> Epoch:
    dropout = bpe_dropout(cfg, corpus)
    # under BPE-dropout, epoch 0's segmentation as training will see it (later epochs differ by a few steps)
    train = dropout.encoded(0) if dropout else corpus.splits["train"]
    src_len, tgt_len = pair_lengths(train)
    cost = dropout.lengths(0)[0] if dropout else column(train, "cost")
    sampler = TokenBatchSampler(cost, cfg.max_tokens, world_size=num_processes, accum_steps=cfg.accum_steps,
                                seed=cfg.seed, ties=src_len, epoch_rows=corpus.epoch_rows)
    if corpus.epoch_rows is not None:  # the lengths of the pairs epoch 0 reads, repeats included
        rows = corpus.epoch_rows(0)
        src_len, tgt_len = src_len[rows], tgt_len[rows]
    return Epoch(train, sampler.plan(0), src_len, tgt_len)


def _report(cfg: TrainConfig, corpus, model: Seq2SeqTransformer, epoch: Epoch, num_processes: int,
            planned_steps: int | None, precision: str, device_type: str) -> Report:
    """The report's numbers before the probe and the problems; memory as it will be on a `device_type`."""
    plan, src_len, tgt_len = epoch.plan, epoch.src_len, epoch.tgt_len
    clean, tokenizer = corpus.stats.clean, corpus.tokenizer
    n_params = sum(p.numel() for p in model.parameters())
    longest, kernel = int(np.max(np.maximum(src_len, tgt_len))), attention_kernel(cfg.model, device_type)
    return Report(
        num_processes=num_processes, pairs=corpus.stats.pairs, read=clean["read"], dropped=clean["dropped"],
        carved=corpus.stats.carved_from_train, src_len=percentiles(src_len), tgt_len=percentiles(tgt_len),
        joint_vocab=tokenizer.joint, src_vocab_size=tokenizer.src_vocab_size,
        tgt_vocab_size=tokenizer.tgt_vocab_size, unk_rate=unknown_rates(corpus.splits["valid"]),
        tokens_per_epoch={"src": int(src_len.sum()), "tgt": int(tgt_len.sum())},
        padding_share=padding_share(plan, src_len, tgt_len), steps_per_epoch=len(plan),
        micro_batches_per_epoch=len(plan) * cfg.accum_steps,
        total_steps=min([n for n in (cfg.max_steps, cfg.max_epochs and cfg.max_epochs * len(plan)) if n]
                        or [planned_steps or len(plan)]), n_params=n_params,
        memory=memory_estimate(cfg, n_params, longest, precision, kernel), longest=longest, attention=kernel,
        memory_precision=precision, memory_device=device_type, cfg=cfg,
        overlap=overlap_line(corpus.stats),
        corpora=[c for c in corpus.stats.corpora if isinstance(c, dict)],
        fit=tokenizer_fit(cfg.init_from, corpus.splits["train"]) if cfg.init_from else None)


def tokenizer_fit(directory: str, train) -> dict:
    """How model directory `directory`'s tokenizer segments `train` (an encoded split) against its own training
    data (`segmentation` in its training.json, when recorded), and the problems that shows."""
    old = read_summary(directory).get("segmentation")
    new, problems = segmentation(train), []
    for side, name in (("src", "source"), ("tgt", "target")):
        ratio = new[side]["subwords_per_word"] / old[side]["subwords_per_word"] if old else 1.0
        if ratio > OVER_SEGMENTED:
            problems.append(f"init_from {directory}: its tokenizer cuts the new {name} into {ratio:.1f}x as many "
                            "subwords per word as its own training data (over-segmented: a new domain or script); "
                            "expect slower, weaker fine-tuning, or train a model with its own tokenizer")
        if new[side]["unk_rate"] > MAX_UNK_RATE:
            problems.append(f"init_from {directory}: {new[side]['unk_rate']:.1%} of the new {name} subwords are "
                            "<unk> under its tokenizer (characters it never saw)")
    return {"dir": str(directory), "new": new, "old": old, "problems": problems}


def _build(model_cfg: ModelConfig, seed: int) -> Seq2SeqTransformer:
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        torch.manual_seed(seed)
        return Seq2SeqTransformer(model_cfg)


def percentiles(lengths: np.ndarray) -> dict[str, int]:
    out = {f"p{q}": int(np.percentile(lengths, q, method="higher")) for q in PERCENTILES}
    return {**out, "max": int(lengths.max())}


def unknown_rates(ds) -> dict[str, float]:
    """Share of <unk> among the validation subwords (the source's appended </s> not counted)."""
    def rows(side: str):  # Arrow batches as Python lists: no per-row formatting by datasets
        for table in arrow_batches(ds.select_columns([f"{side}_ids"])):
            yield from table.column(0).to_pylist()

    return {side: unknown_rate(rows(side)) for side in ("src", "tgt")}


def padding_share(plan, src_len: np.ndarray, tgt_len: np.ndarray) -> float:
    """Padding share of all micro-batch tensors (source + target) of one epoch, over all processes."""
    real = padded = 0
    n_chunks = plan.world_size * plan.accum_steps
    for batch in plan.batches:
        for chunk in deal(batch, n_chunks):
            if len(chunk):
                real += int(src_len[chunk].sum() + tgt_len[chunk].sum())
                padded += len(chunk) * (int(src_len[chunk].max()) + int(tgt_len[chunk].max()))
    return 1 - real / max(padded, 1)


def attention_kernel(m: ModelConfig, device_type: str) -> str:
    """"fused" where `scaled_dot_product_attention` keeps no H x L rows for the backward (a GPU's flash or
    memory-efficient kernel), else "math": a CPU's training step takes the math kernel with dropout on the attention
    weights (torch's choice) and under mixed precision (`nmt.kernels.use_attention_path`), so its estimate counts
    the rows (an upper bound for fp32 without that dropout)."""
    return "fused" if device_type == "cuda" else "math"


def activation_bytes(m: ModelConfig, max_tokens: int, longest: int, precision: str = "no", kernel: str = "math",
                     checkpointed: bool = False, loss: str = "plain") -> int:
    """What one micro-batch of `max_tokens` padded tokens on each side holds for the backward, at its peak.

    Per token, in fp32: an encoder layer keeps ~10 vectors of width D, 3 of width F (FFN input, activation,
    dropout) and, under the math attention kernel, 3 attention rows of H x L (scores, probabilities, dropout;
    L = min(longest pair, max_tokens)); a decoder layer 17 D, 3 F and 6 rows (self- and cross-attention); the
    embeddings 6 D. Fitted to the tensors autograd saves on the CPU (within ~10%, tests/test_check.py); under
    mixed `precision` the layers' share is AUTOCAST_SHARE's. With `checkpointed` layers a layer keeps its input
    only (D), and the backward holds one decoder layer's tensors at a time. The loss (`loss`: "plain", "fused",
    "fused16" over 16-bit logits) adds its peak, LOSS_FLOATS x V.
    """
    D, F, H, V = m.d_model, m.d_ff, m.n_heads, max(m.src_vocab_size, m.tgt_vocab_size)
    L = min(longest, max_tokens)
    rows = kernel == "math"
    share = 1.0 if precision == "no" else AUTOCAST_SHARE[kernel]
    encoder = (10 * D + 3 * F) * share + 3 * H * L * rows
    decoder = (17 * D + 3 * F) * share + 6 * H * L * rows
    if checkpointed:
        layers = (m.n_encoder_layers + m.n_decoder_layers) * D + decoder
    else:
        layers = m.n_encoder_layers * encoder + m.n_decoder_layers * decoder
    return int(BYTES_FP32 * max_tokens * (layers + 6 * D + LOSS_FLOATS[loss] * V))


def memory_estimate(cfg: TrainConfig, n_params: int, longest: int, precision: str, kernel: str,
                    processes: int = 1, sharded: bool = False, lora: bool = False, **changes) -> dict[str, int]:
    """Bytes one training process holds at its peak: "states" (fp32 weights, gradients and AdamW's two moments,
    16 B a parameter: 4 where LoRA trains adapters only, over `processes` where FSDP shards them; under mixed
    precision autocast's 16-bit copies of the weights, 2 B more) and "activations" (`activation_bytes`), and
    their "total". `changes`: max_tokens, checkpointed, as a fix would set them."""
    states = (4 if lora else 16) * n_params / (processes if sharded else 1) + (0 if precision == "no" else 2 * n_params)
    loss = "plain" if cfg.compile else "fused" if precision == "no" else "fused16"  # as make_objective builds it
    activations = activation_bytes(cfg.model, changes.get("max_tokens", cfg.max_tokens), longest, precision, kernel,
                                   changes.get("checkpointed", cfg.model.checkpoint_activations), loss)
    return {"states": int(states), "activations": activations, "total": int(states) + activations}


def memory_fixes(r: Report, device_bytes: int) -> str | None:
    """None when the estimate fits `device_bytes`; else the problem and the fixes that fit, each with its estimate
    (else all of them, to combine): a smaller max_tokens with the accum_steps that keep the batch, checkpointing,
    LoRA (fine-tuning), FSDP."""
    cfg, usable = r.cfg, USABLE * device_bytes
    if r.memory["total"] <= usable:
        return None
    args = (cfg, r.n_params, r.longest, r.memory_precision, r.attention)
    fixes = []  # (what to change, its estimate)
    per_token = r.memory["activations"] / cfg.max_tokens
    fit = int((usable - r.memory["states"]) / per_token) // 256 * 256
    if r.longest <= fit:
        fixes.append((f"max_tokens {fit:,} with accum_steps {math.ceil(cfg.max_tokens * cfg.accum_steps / fit)}"
                      ", as many tokens a step", memory_estimate(*args, max_tokens=fit)))
    if not cfg.model.checkpoint_activations:
        fixes.append(("model.checkpoint_activations: true", memory_estimate(*args, checkpointed=True)))
    if cfg.init_from and not cfg.finetune.lora_r:
        fixes.append(("LoRA, finetune.lora_r: 8", memory_estimate(*args, lora=True)))
    gpus = r.num_processes if r.num_processes > 1 else 8
    fixes.append((f"FSDP over {gpus} GPUs, accelerate_configs/fsdp.yaml",
                  memory_estimate(*args, processes=gpus, sharded=True)))
    enough = [f"{what} (~{_gb(estimate['total'])})" for what, estimate in fixes if estimate["total"] <= usable]
    named = "; or ".join(enough) if enough else "none of these is enough alone, combine them: " + "; ".join(
        f"{what} (~{_gb(estimate['total'])})" for what, estimate in fixes)
    return (f"memory: ~{_gb(r.memory['total'])} a process (max_tokens {cfg.max_tokens:,}) does not fit "
            f"{USABLE:.0%} of a {_gb(device_bytes)} GPU; {named}")


# --- the timed probe ----------------------------------------------------------------------------------


def probe(report: Report, model: Seq2SeqTransformer, cfg: TrainConfig, epoch: Epoch, steps: int,
          device: str | None, precision: str = "no") -> None:
    """Time `steps` optimizer steps (forward, backward, AdamW) on this process's real micro-batches of
    `epoch.train` (the training split as epoch 0 sees it), with the probe the plan times with.

    Seconds per epoch = (median over the timed steps of seconds per padded token) x this process's padded
    tokens of an epoch, so a probe that happened to draw short or long batches does not skew the estimate.
    """
    device = default_device(device)
    plan = epoch.plan
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    chunks = (plan.micro_batches(i % len(plan)) for i in itertools.count())
    timed = timing.time_steps(model, cfg, timing.batches(cfg, epoch.train, chunks, device, model),
                                steps, device, precision)
    per_token = [s / sum(b["src_ids"].numel() + b["tgt_in_ids"].numel() for b in window) for s, window in timed]
    epoch_work = sum(_padded(chunk, epoch.src_len, epoch.tgt_len) for step in range(len(plan))
                     for chunk in plan.micro_batches(step))
    # the median step: one step slowed by a busy neighbour or a collection pause does not set the estimate
    report.seconds_per_epoch = float(np.median(per_token)) * epoch_work
    report.seconds_per_step = report.seconds_per_epoch / len(plan)
    report.probe_device, report.probe_steps, report.precision = str(device), len(per_token), precision
    if device.type == "cuda":
        report.measured_peak = int(torch.cuda.max_memory_allocated(device))


def _padded(chunk: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray) -> int:
    return len(chunk) * (int(src_len[chunk].max()) + int(tgt_len[chunk].max())) if len(chunk) else 0


# --- problems, each with what to change ------------------------------------------------------------------


def find_problems(r: Report, cfg: TrainConfig, model_cfg: ModelConfig, longest_cost: int) -> list[str]:
    problems = []
    if r.pairs["valid"] < MIN_VALID_PAIRS:
        problems.append(f"tiny validation set: {r.pairs['valid']} pairs (< {MIN_VALID_PAIRS}), so BLEU differences "
                        "between checkpoints are mostly noise; give data.valid a larger set or raise data.valid_ratio")
    n_dropped = sum(r.dropped.values())
    if r.read and n_dropped / r.read > MAX_DROPPED_SHARE:
        top = max(r.dropped, key=r.dropped.get)
        problems.append(f"cleaning dropped {n_dropped:,} of {r.read:,} training pairs ({n_dropped / r.read:.0%}), "
                        f"most as {top!r} ({r.dropped[top]:,}): {_drop_advice(top)}")
    for side, name in (("src", "source"), ("tgt", "target")):
        if r.unk_rate[side] > MAX_UNK_RATE:
            size = r.src_vocab_size if side == "src" else r.tgt_vocab_size
            problems.append(f"vocabulary too small: {r.unk_rate[side]:.1%} of the validation {name} subwords are <unk> "
                            f"(> {MAX_UNK_RATE:.0%}); raise tokenizer.vocab_size (now {size:,}), or check that "
                            f"the validation {name} is in the training {name}'s language and script")
    problems += r.fit["problems"] if r.fit else []
    if r.gpu_memory and (memory := memory_fixes(r, r.gpu_memory)):
        problems.append(memory)
    if cfg.max_tokens < longest_cost:
        problems.append(f"max_tokens={cfg.max_tokens:,} is smaller than the longest training pair "
                        f"({longest_cost:,} padded tokens): such pairs get a batch of their own, over budget "
                        f"(a memory spike); raise max_tokens to at least {longest_cost:,} or lower data.max_words")
    return problems


def _drop_advice(reason: str) -> str:
    return {
        "empty": "many empty sides: are the source and target files/columns the right ones?",
        "nul_byte": "NUL bytes: is the file binary or in UTF-16? convert it to UTF-8",
        "too_long": "raise data.max_words, or check that lines are sentences rather than documents",
        "too_many_subwords": "raise data.max_subwords or model.max_positions, or check that lines are sentences",
        "length_ratio": "are the files aligned line by line? if so, raise data.max_ratio",
        "duplicate": "the corpus repeats itself; set data.dedupe: false to keep repeats on purpose",
    }.get(reason, "check the files")


# --- the launch's process count -------------------------------------------------------------------------


def launch_processes(flag: int | None = None, profile: str | Path | None = None) -> tuple[int, str]:
    """The number of training processes, and where it came from.

    In order: `--num-processes N`; `num_processes` of an accelerate config file (`--profile`); the WORLD_SIZE
    that torchrun / `accelerate launch` set in each process; ACCELERATE_NUM_PROCESSES; else 1.
    """
    if flag is not None:
        return flag, "--num-processes"
    if profile:
        data = read_yaml(profile)
        n = data.get("num_processes", 1)
        if not isinstance(n, int) or n < 1:
            raise NmtError(f"{profile}: num_processes must be a positive integer, got {n!r}")
        return n, str(profile)
    for name in ("WORLD_SIZE", "ACCELERATE_NUM_PROCESSES"):
        value = os.environ.get(name)
        if value:
            if not value.isdigit() or int(value) < 1:
                raise NmtError(f"environment variable {name}={value!r}: expected a positive integer")
            return int(value), name
    return 1, "default: no --num-processes, --profile or WORLD_SIZE"


# --- the report: its numbers, and the few lines it prints for the terminal -------------------------------------


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
    memory: dict[str, int]  # bytes per process at its peak (`memory_estimate`): "states", "activations", "total"
    longest: int = 0  # the longest training pair's padded length, source or target
    attention: str = "math"  # the attention kernel the estimate assumes (`attention_kernel`)
    memory_precision: str = "no"  # the mixed precision it assumes (training's, or a GPU's when one is named)
    memory_device: str = "cpu"  # the device type it is for
    gpu_memory: int | None = None  # bytes of the GPU the estimate must fit (None: no GPU named or here)
    seconds_per_step: float | None = None  # from the timed probe (None: not probed)
    seconds_per_epoch: float | None = None
    probe_device: str = ""
    precision: str = "no"  # the mixed precision training (and the probe) runs in
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
        precision = self.memory_precision
        copies = "" if precision == "no" else f" + {precision} copies"
        kept = "layers' inputs (checkpointed)" if cfg.model.checkpoint_activations else "activations"
        where = "a GPU" if self.memory_device == "cuda" else self.memory_device
        out.append(f"model     {self.n_params / 1e6:.2f}M parameters; memory per process on {where} "
                   f"~{_gb(self.memory['total'])} = {_gb(self.memory['states'])} weights+grads+Adam (fp32{copies}) + "
                   f"{_gb(self.memory['activations'])} {kept} and loss of a max_tokens batch "
                   f"({'fp32' if precision == 'no' else precision}, {self.attention} attention){peak}")
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
