"""The machine's GEMM ceiling and the model FLOPs utilisation (MFU) of nmt's training and HF Marian's.

Ceiling: fp32 and bf16 torch.matmul at 2048^3 and at the model's own shapes (N tokens of a batch times
the weight matrices, forward and backward). MFU: the training FLOPs a batch needs, counted from the model's
shapes on its real (non-pad) tokens, times measured target tokens/s, over the fp32 ceiling. The GEMM
ceiling and each system's training rounds are interleaved, so a load that comes and goes hits all alike.
With hf among the systems it also prints the most any model of these FLOPs could be over HF on this machine
(100% MFU against HF's): the bound on train_speed.py's ratio that no padded core doing the same products can
pass.

    python benchmarks/peak.py
    python benchmarks/peak.py --data ../shared/data/tatoeba-en-de --systems nmt,hf --profile
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_speed as ts  # noqa: E402  (the same batches and training step as the speed comparison)

FORMULA = """training FLOPs of a pair with s source and t target tokens (non-pad), 3 x forward (backward = 2 x forward):
  3 x 2 x [ Le x ( s (4D^2 + 2DF) + 2 s^2 D )                                 encoder: QKV+out, FFN, scores+values
          + Ld x ( t (6D^2 + 2DF) + s 2D^2 + 2 t^2 D + 2 t s D )              decoder: self QKV+out, cross Q+out,
                                                                              FFN, cross K,V of memory, self and
                                                                              cross scores+values
          + t D V ]                                                           output projection
  (self-attention scores counted in full, as computed; embeddings, norms, softmax, dropout, optimizer not counted)
MFU = (sum of FLOPs over the batches / target tokens) x target tokens/s / fp32 GEMM ceiling"""


def pair_flops(s: int, t: int, d: ts.Dims) -> int:
    D, F, V, L = d.d_model, d.ffn, d.vocab, d.layers
    enc = L * (s * (4 * D * D + 2 * D * F) + 2 * s * s * D)
    dec = L * (t * (6 * D * D + 2 * D * F) + s * 2 * D * D + 2 * t * t * D + 2 * t * s * D)
    return 3 * 2 * (enc + dec + t * D * V)


def batch_flops(b: dict, d: ts.Dims) -> int:
    src_len = b["src_ids"].ne(ts.PAD).sum(1).tolist()
    tgt_len = b["labels"].ne(ts.PAD).sum(1).tolist()
    return sum(pair_flops(s, t, d) for s, t in zip(src_len, tgt_len))


def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """GFLOP/s of torch.matmul (m, k) @ (k, n), best of repeated timings over about `seconds`."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    start = time.perf_counter()
    torch.matmul(a, b)  # warm-up; when one call already takes longer than `seconds` (bf16 without bf16
    first = time.perf_counter() - start  # units: ~1 minute at 2048^3), it is the measurement
    if first > seconds:
        return 2 * m * k * n / first / 1e9
    best, spent = float("inf"), 0.0
    while spent < seconds:
        start = time.perf_counter()
        torch.matmul(a, b)
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
    return 2 * m * k * n / best / 1e9


def model_shapes(d: ts.Dims, n: int) -> dict[str, tuple[int, int, int]]:
    """(m, k, n) of the model's matmuls for a batch of n tokens, forward and the two backward products."""
    D, F, V = d.d_model, d.ffn, d.vocab
    return {"QKV fwd": (n, D, 3 * D), "out fwd": (n, D, D), "FFN up fwd": (n, D, F), "FFN down fwd": (n, F, D),
            "vocab fwd": (n, D, V), "vocab bwd dX": (n, V, D), "vocab bwd dW": (V, n, D), "FFN up bwd dW": (F, n, D)}


def ceilings(d: ts.Dims, n: int, dtypes=(torch.float32, torch.bfloat16), size: int = 2048) -> list[tuple[str, str, float]]:
    rows = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        rows.append((name, f"{size}^3", gemm_rate(size, size, size, dtype)))
        for label, shape in model_shapes(d, n).items():
            rows.append((name, f"{label} {shape}", gemm_rate(*shape, dtype, seconds=0.3 if dtype == torch.float32 else 0.2)))
    return rows


def profile_step(batch: dict, d: ts.Dims, name: str = "nmt") -> str:
    """Share of one training step's CPU time by operator (system `name`): what is matmul and what is not."""
    from torch.profiler import ProfilerActivity, profile

    trainer = ts.Trainer(name, d, 0.1, bf16=False)
    trainer.step(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(batch)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    lines = [f"profile of one {name} step: matmuls (mm, addmm, bmm) {matmul / total:.1%} of aten time; top operators:"]
    lines += [f"  {e.key:32s} {e.self_cpu_time_total / total:6.1%}  ({e.count} calls)" for e in top]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = ts.arg_parser()
    p.add_argument("--profile", action="store_true", help="also print the operator breakdown of one step")
    p.add_argument("--ceiling-size", type=int, default=2048, help="the square GEMM that measures the ceiling")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 ceilings (minutes without bf16 units)")
    p.set_defaults(systems="nmt")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    d = ts.Dims(args.vocab, args.d_model, args.heads, args.layers, args.ffn, args.dropout)
    batches = ts.load_batches(args)
    tokens = sum(int(b["labels"].ne(ts.PAD).sum()) for b in batches)
    flops_per_token = sum(batch_flops(b, d) for b in batches) / tokens
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {d}; max_tokens {args.max_tokens}; "
          f"data {args.data or 'synthetic lognormal lengths'}")
    print(ts.describe(batches))
    print(FORMULA)
    print(f"model training FLOPs per target token: {flops_per_token / 1e6:.1f} MFLOP")
    print("GEMM ceiling (GFLOP/s, best of repeats):")
    dtypes = (torch.float32,) if args.no_bf16 else (torch.float32, torch.bfloat16)
    for dtype, shape, rate in ceilings(d, args.max_tokens, dtypes, args.ceiling_size):
        print(f"  {dtype:9s} {shape:36s} {rate:7.1f}")
    names = args.systems.split(",")
    trainers = {n: ts.Trainer(n, d, 0.1, bf16=False) for n in names}
    for t in trainers.values():  # warm-up: every batch shape once
        for b in batches:
            t.step(b)
    fp32_ceiling, speeds = [], {n: [] for n in names}
    for r in range(args.rounds):  # interleaved: the ceiling, then a round of each system
        fp32_ceiling.append(gemm_rate(*[args.ceiling_size] * 3, torch.float32))
        for n in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            for b in batches:
                trainers[n].step(b)
            speeds[n].append(tokens / (time.perf_counter() - start))
        print(f"  round {r + 1}/{args.rounds}: ceiling {fp32_ceiling[-1]:.1f} GFLOP/s, " + ", ".join(
            f"{n} {speeds[n][-1]:.0f} tokens/s MFU {flops_per_token * speeds[n][-1] / 1e9 / fp32_ceiling[-1]:.1%}"
            for n in names))
    ceiling = statistics.median(fp32_ceiling)
    for n in names:
        speed = statistics.median(speeds[n])
        mfus = [flops_per_token * s / 1e9 / c for s, c in zip(speeds[n], fp32_ceiling)]
        print(f"{n} fp32 training: {speed:.0f} target tokens/s (median of {args.rounds}; {min(speeds[n]):.0f}-"
              f"{max(speeds[n]):.0f}) x {flops_per_token / 1e6:.1f} MFLOP = {flops_per_token * speed / 1e9:.1f} "
              f"GFLOP/s; fp32 GEMM ceiling {ceiling:.1f} GFLOP/s ({args.ceiling_size}^3, median); "
              f"MFU {flops_per_token * speed / 1e9 / ceiling:.1%} (per round {min(mfus):.1%}-{max(mfus):.1%})")
    if "hf" in speeds:
        bounds = [c * 1e9 / flops_per_token / s for s, c in zip(speeds["hf"], fp32_ceiling)]
        print(f"the most a model of these FLOPs can be over HF here (100% MFU against HF's): "
              f"{statistics.median(bounds):.2f}x HF (per round {min(bounds):.2f}-{max(bounds):.2f})")
    if args.profile:
        for n in names:
            print(profile_step(batches[len(batches) // 2], d, n))


if __name__ == "__main__":
    main()
