"""Training speed: nmt's Seq2SeqTransformer vs HF MarianMTModel vs the DataParallel question's nn.Transformer
model (docs/coming-from-dataparallel.md; `--systems seed`).

Equal dimensions, the same token-budget batches, forward + backward + gradient clipping + AdamW step.
The systems are interleaved over several rounds in one process (the machine may be shared, so only
ratios measured side by side mean much); each round times every system on the same batches.
Prints non-pad target tokens/s (median, min-max over rounds) and each system's ratio to HF.

    python benchmarks/train_speed.py --mode both
    python benchmarks/train_speed.py --data ../shared/data/tatoeba-en-de --mode fp32
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nmt.batching import (
    Collator,  # noqa: E402
    global_batches,  # noqa: E402
)
from nmt.config import ModelConfig  # noqa: E402
from nmt.encoding import pair_cost  # noqa: E402
from nmt.kernels import use_cpu_kernels  # noqa: E402
from nmt.model import (
    Seq2SeqLoss,  # noqa: E402
    Seq2SeqTransformer,  # noqa: E402
)

PAD, BOS, EOS = 0, 2, 3


# --- batches ------------------------------------------------------------------------------------


def synthetic_pairs(n: int, vocab: int, seed: int) -> list[dict]:
    """Pairs of random ids with lognormal lengths like short-sentence corpora (median ~9 subwords)."""
    rng = np.random.default_rng(seed)
    src_len = np.clip(np.round(rng.lognormal(math.log(9), 0.5, n)), 1, 120).astype(int)
    tgt_len = np.clip(np.round(src_len * rng.lognormal(0.1, 0.2, n)), 1, 120).astype(int)
    ids = lambda k: rng.integers(4, vocab, k).tolist()
    return [{"src_ids": ids(s), "tgt_ids": ids(t)} for s, t in zip(src_len, tgt_len)]


def corpus_pairs(path: str, vocab: int) -> list[dict]:
    """The real pipeline (nmt.data.prepare, cache in a temporary directory) on `path`/train.{en,de}."""
    from nmt.config import DataConfig, TokenizerConfig
    from nmt.data import prepare

    with tempfile.TemporaryDirectory() as cache:
        p = Path(path)
        data = DataConfig(train=str(p / "train"), valid=str(p / "valid"), test=str(p / "test"), src_lang="en",
                          tgt_lang="de", cache_dir=cache)
        corpus = prepare(data, TokenizerConfig(vocab_size=vocab), splits=("train",))
        train = corpus.splits["train"]
        return [{"src_ids": s, "tgt_ids": t} for s, t in zip(train["src_ids"], train["tgt_ids"])]


def pick_batches(pairs: list[dict], max_tokens: int, n: int, seed: int) -> list[dict]:
    """`n` token-budget batches (nmt.batching.global_batches), evenly spaced over the length range."""
    cost = np.array([pair_cost(p["src_ids"], p["tgt_ids"]) for p in pairs])
    batches = sorted(global_batches(cost, max_tokens, 1, seed), key=lambda b: cost[b].max())
    batches = batches[: max(len(batches) - 1, 1)]  # the last one may be a merged tail over budget
    picks = np.linspace(0, len(batches) - 1, n).round().astype(int)
    collate = Collator()
    return [collate([pairs[i] for i in batches[k]]) for k in picks]


# --- the three systems ---------------------------------------------------------------------------


class PositionalEncoding(nn.Module):
    """The DataParallel question's (from a Medium article) sinusoidal positions, sequence-first, with dropout."""

    def __init__(self, dim_model: int, dropout_p: float, max_len: int = 5000):
        super().__init__()
        self.dropout = nn.Dropout(dropout_p)
        pos = torch.arange(max_len, dtype=torch.float)[:, None]
        div = torch.exp(torch.arange(0, dim_model, 2).float() * (-math.log(10000.0) / dim_model))
        table = torch.zeros(max_len, 1, dim_model)
        table[:, 0, 0::2], table[:, 0, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pos_encoding", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (L, B, D)
        return self.dropout(x + self.pos_encoding[: x.size(0)])


class SeedTransformer(nn.Module):
    """The DataParallel question's model as written there: sequence-first nn.Transformer, masks passed in.

    One change: the memory padding mask is passed too (the question forgot it), so it computes what the others do.
    """

    def __init__(self, vocab: int, d: int, heads: int, n_enc: int, n_dec: int, ffn: int, dropout: float):
        super().__init__()
        self.dim_model = d
        self.positional_encoder = PositionalEncoding(d, dropout)
        self.src_embedding, self.tgt_embedding = nn.Embedding(vocab, d), nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(d, heads, n_enc, n_dec, ffn, dropout)
        self.out = nn.Linear(d, vocab)

    def forward(self, src, tgt, tgt_mask, src_pad_mask, tgt_pad_mask):  # (B, S), (B, T) ids; (T, T) mask
        src = self.positional_encoder((self.src_embedding(src) * math.sqrt(self.dim_model)).permute(1, 0, 2))
        tgt = self.positional_encoder((self.tgt_embedding(tgt) * math.sqrt(self.dim_model)).permute(1, 0, 2))
        out = self.transformer(src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=src_pad_mask,
                               tgt_key_padding_mask=tgt_pad_mask, memory_key_padding_mask=src_pad_mask)
        return self.out(out)  # (T, B, V)


@dataclass
class Dims:
    vocab: int = 8000
    d_model: int = 256
    heads: int = 4
    layers: int = 3
    ffn: int = 1024
    dropout: float = 0.1


def build_nmt(dims: Dims) -> nn.Module:
    model = Seq2SeqTransformer(ModelConfig(src_vocab_size=dims.vocab, tgt_vocab_size=dims.vocab, d_model=dims.d_model,
                                           n_heads=dims.heads, n_encoder_layers=dims.layers,
                                           n_decoder_layers=dims.layers, d_ff=dims.ffn, dropout=dims.dropout))
    return use_cpu_kernels(model, fast_dropout=True)  # as training on the CPU does


def build_plain(dims: Dims) -> nn.Module:
    """nmt's model as a GPU trains it: no CPU fast path (torch's dropout)."""
    return use_cpu_kernels(build_nmt(dims))


def build_hf(dims: Dims) -> nn.Module:
    from hf_baseline import marian  # benchmarks/ is on sys.path when this file runs as a script

    return marian(dims.vocab, dims.d_model, dims.layers, dims.heads, dims.ffn, dims.dropout, use_cache=False)


def build_seed(dims: Dims) -> nn.Module:
    return SeedTransformer(dims.vocab, dims.d_model, dims.heads, dims.layers, dims.layers, dims.ffn, dims.dropout)


def trainers_objective(model, smoothing: float, compile: bool) -> nn.Module:
    """The objective nmt's training builds for `model` on the CPU (nmt.training.loop.make_objective), made once:
    the fused cross-entropy of nmt.kernels, or with `compile` the plain objective compiled whole."""
    name = "compiled_objective" if compile else "objective"
    if not hasattr(model, name):
        from nmt.config import TrainConfig
        from nmt.training.loop import make_objective

        cfg = TrainConfig(compile=compile)
        cfg.optim.label_smoothing = smoothing
        object.__setattr__(model, name, make_objective(model, cfg))
    return getattr(model, name)


def loss_nmt(model, b: dict, smoothing: float) -> torch.Tensor:
    """What nmt's train_step does on a CPU: the objective training builds, its loss."""
    return trainers_objective(model, smoothing, False)(b["src_ids"], b["tgt_in_ids"], b["labels"]).loss


def loss_nmt_plain(model, b: dict, smoothing: float) -> torch.Tensor:
    """The plain objective (a GPU's): Seq2SeqLoss, the model's logits through F.log_softmax and autograd."""
    return Seq2SeqLoss(model, smoothing)(b["src_ids"], b["tgt_in_ids"], b["labels"]).loss


def loss_nmt_compiled(model, b: dict, smoothing: float) -> torch.Tensor:
    """What `compile: true` trains: the plain objective compiled whole."""
    return trainers_objective(model, smoothing, True)(b["src_ids"], b["tgt_in_ids"], b["labels"]).loss


def loss_hf(model, b: dict, smoothing: float) -> torch.Tensor:
    logits = model(input_ids=b["src_ids"], attention_mask=b["src_ids"].ne(PAD),
                   decoder_input_ids=b["tgt_in_ids"], decoder_attention_mask=b["tgt_in_ids"].ne(PAD)).logits
    ce = nn.CrossEntropyLoss(label_smoothing=smoothing, ignore_index=PAD, reduction="sum")
    return ce(logits.view(-1, logits.shape[-1]), b["labels"].view(-1))


def loss_seed(model, b: dict, smoothing: float) -> torch.Tensor:
    src, tgt = b["src_ids"], b["tgt_in_ids"]
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])  # (T, T), built by the caller
    logits = model(src, tgt, tgt_mask, src.eq(PAD), tgt.eq(PAD))  # (T, B, V)
    ce = nn.CrossEntropyLoss(label_smoothing=smoothing, ignore_index=PAD, reduction="sum")
    return ce(logits.permute(1, 2, 0), b["labels"])


# nmt: what a CPU trains (nmt.kernels' fast dropout and fused loss); nmt_unfused: the fast dropout and the plain
# loss (nmt against it: the fused loss's worth); nmt_plain: the plain core, a GPU's (nmt_unfused against it: the
# fast dropout's worth)
SYSTEMS = {"nmt": (build_nmt, loss_nmt), "nmt_unfused": (build_nmt, loss_nmt_plain),
           "nmt_plain": (build_plain, loss_nmt_plain),
           "nmt_compiled": (build_nmt, loss_nmt_compiled),
           "hf": (build_hf, loss_hf), "seed": (build_seed, loss_seed)}


class Trainer:
    """One system: model, fused AdamW (as nmt's make_optimizer), clip at 1.0 (as nmt and HF's Trainer)."""

    def __init__(self, name: str, dims: Dims, smoothing: float, bf16: bool):
        build, self.loss_fn = SYSTEMS[name]
        torch.manual_seed(0)
        self.model = build(dims).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
        self.smoothing, self.bf16 = smoothing, bf16

    def step(self, b: dict) -> float:
        n_tokens = int(b["labels"].ne(PAD).sum())
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with ctx:
            loss = self.loss_fn(self.model, b, self.smoothing)
        (loss / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach()) / n_tokens


def measure(names: list[str], batches: list[dict], dims: Dims, bf16: bool, rounds: int, smoothing: float = 0.1,
            log=print) -> dict[str, list[float]]:
    """Tokens/s of each system per round; systems interleaved, order rotated every round."""
    trainers = {n: Trainer(n, dims, smoothing, bf16) for n in names}
    tokens = sum(int(b["labels"].ne(PAD).sum()) for b in batches)
    for name, t in trainers.items():  # warm-up: every batch shape once (allocator, oneDNN primitives)
        start = time.perf_counter()
        losses = [t.step(b) for b in batches]
        log(f"  warm-up {name:10s} {time.perf_counter() - start:6.1f}s  loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    speeds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            start = time.perf_counter()
            for b in batches:
                trainers[name].step(b)
            speeds[name].append(tokens / (time.perf_counter() - start))
        log(f"  round {r + 1}/{rounds}: " + "  ".join(f"{n} {speeds[n][-1]:.0f}" for n in names))
    return speeds


def report(speeds: dict[str, list[float]], title: str) -> str:
    """Median tokens/s with min-max, and the ratio to HF: of the medians, and the median of per-round ratios
    (the systems of one round ran back to back, so a load that comes and goes cancels out in those)."""
    lines = [title, f"  {'system':12s} {'tokens/s (median)':>18s} {'min-max':>13s} {'x HF (medians)':>15s} "
                    f"{'x HF (per round: median, min-max)':>34s}"]
    hf = speeds.get("hf")
    for name, s in speeds.items():
        med = statistics.median(s)
        ratios = [a / b for a, b in zip(s, hf)] if hf else []
        of_medians = f"{med / statistics.median(hf):15.2f}" if hf else f"{'-':>15s}"
        per_round = (f"{statistics.median(ratios):20.2f}, {min(ratios):.2f}-{max(ratios):.2f}" if hf else f"{'-':>20s}")
        lines.append(f"  {name:12s} {med:18.0f} {min(s):6.0f}-{max(s):<6.0f} {of_medians} {per_round}")
    return "\n".join(lines)


def middle(batches: list[dict], n: int) -> list[dict]:
    start = max((len(batches) - n) // 2, 0)
    return batches[start : start + n]


def describe(batches: list[dict]) -> str:
    real = sum(int(b["labels"].ne(PAD).sum()) for b in batches)
    padded = sum(b["labels"].numel() for b in batches)
    shapes = ", ".join(f"{tuple(b['src_ids'].shape)}/{tuple(b['labels'].shape)}" for b in batches)
    return (f"{len(batches)} batches (src/tgt shapes {shapes}); {real} non-pad target tokens per round, "
            f"target padding {1 - real / padded:.1%}")


def arg_parser() -> argparse.ArgumentParser:
    """The flags shared with peak.py: model dimensions, data and batches, rounds, threads."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["fp32", "bf16", "both"], default="fp32")
    p.add_argument("--systems", default="nmt,hf,seed", help=f"comma-separated, from {','.join(SYSTEMS)}")
    p.add_argument("--data", help="a corpus folder with train.en/train.de (e.g. ../shared/data/tatoeba-en-de)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=3, help="encoder and decoder layers each")
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per batch (nmt's max_tokens)")
    p.add_argument("--batches", type=int, default=4, help="batches per round, spread over the length range")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bf16-rounds", type=int, default=2, help="rounds in bf16 mode (slow on CPUs without bf16 units)")
    p.add_argument("--bf16-batches", type=int, default=1, help="batches per round in bf16 mode (the middle ones)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    return p


def load_batches(args) -> list[dict]:
    pairs = corpus_pairs(args.data, args.vocab) if args.data else synthetic_pairs(20000, args.vocab, args.seed)
    return pick_batches(pairs, args.max_tokens, args.batches, args.seed)


def main(argv=None) -> None:
    args = arg_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)  # nn.Transformer's notes on nested tensors and masks
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = Dims(args.vocab, args.d_model, args.heads, args.layers, args.ffn, args.dropout)
    batches = load_batches(args)
    names = args.systems.split(",")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {dims}; max_tokens {args.max_tokens}; "
          f"data {args.data or 'synthetic lognormal lengths'}")
    print(describe(batches))
    print(f"load average before: {os.getloadavg()[0]:.2f} (other processes on these cores distort every figure)")
    results = []
    for mode in (["fp32", "bf16"] if args.mode == "both" else [args.mode]):
        print(f"{mode}:")
        rounds = args.bf16_rounds if mode == "bf16" else args.rounds
        subset = batches if mode == "fp32" else middle(batches, args.bf16_batches)
        if mode == "bf16":
            print("  " + describe(subset))
        speeds = measure(names, subset, dims, mode == "bf16", rounds)
        results.append(report(speeds, f"{mode}: non-pad target tokens/s over {rounds} rounds"))
    print("\n".join(results))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
