"""Resident memory of a training run over its steps: does it stay flat after the first epoch?

Runs the README's own-corpus command (`nmt train --data.train D/train ... --max_minutes M`) once per precision
(fp32, and bf16 through ACCELERATE_MIXED_PRECISION, as a user would choose it), reads the training process's
resident memory (/proc/PID/status VmRSS, Linux) every `--every` seconds beside the step and epoch its progress
line shows, until the training loop's last line (the test set's decoding after it is not counted), and prints
per precision: RSS at the end of the first epoch, at the end of the run, the largest, and the slope after the
first epoch (MiB per 1,000 steps, least squares) — flat memory is a slope near 0.

    python benchmarks/memory.py --data ../shared/data/tatoeba-en-de --minutes 10

Arguments after `--` are added to the command as a user's own settings, e.g. `-- --model.size tiny` for more
steps in the same minutes.

`--heap STEPS` measures instead what training's two memory settings buy, each in a fresh process: the release of
the C heap's free pages (`nmt.compat.release_free_memory`, every `RELEASE_EVERY` steps) and the bounded oneDNN
primitive caches (`nmt.compat.bound_onednn_primitive_caches`), on the training step alone (the model, its loss,
AdamW; bf16 autocast or fp32) on random batches of varied shapes: neither, each alone, both (what training
does); RSS every 100 steps.

    python benchmarks/memory.py --heap 1000

`--serve BATCHES` measures what the bound costs and buys in decoding, as a server decodes: beam 4 over BATCHES
batches of 1-64 random sentences of 3-60 tokens, through a random d256 3+3 model packed as `Translator` packs it,
one thread, in a fresh process with each cache at 64 primitives (`Translator`'s bound) and at 1,024 (the
libraries' default): seconds, and RSS every 100 batches.

    python benchmarks/memory.py --serve 400
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HEAP_STEP = """
import random, sys, time, torch
from nmt.compat import bound_onednn_primitive_caches, release_free_memory
from nmt.config import ModelConfig
from nmt.kernels import use_cpu_kernels
from nmt.model import Seq2SeqLoss, Seq2SeqTransformer
from nmt.training.loop import RELEASE_EVERY
precision, steps, release, bounded = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
if bounded:
    bound_onednn_primitive_caches()
rss = lambda: next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024
torch.manual_seed(0)
random.seed(0)
model = Seq2SeqTransformer(ModelConfig(src_vocab_size=8000, tgt_vocab_size=8000, d_model=128, n_heads=4, d_ff=512,
                                       n_encoder_layers=3, n_decoder_layers=3, dropout=0.1))
use_cpu_kernels(model, fast_dropout=True)  # as training on the CPU does
loss, opt, start = Seq2SeqLoss(model, 0.1), torch.optim.AdamW(model.parameters(), lr=1e-3), time.perf_counter()
for step in range(1, steps + 1):
    B, S, T = random.randint(8, 120), random.randint(4, 60), random.randint(4, 60)
    src, tgt_in, labels = (torch.randint(4, 8000, shape) for shape in ((B, S), (B, T), (B, T)))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        sums = loss(src, tgt_in, labels)
    (sums.loss / sums.tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if release and step % RELEASE_EVERY == 0:
        release_free_memory()
    if step % 100 == 0:
        print(step, rss(), round(time.perf_counter() - start, 1), flush=True)
"""
SERVE_DECODING = """
import random, sys, time, torch
from nmt.compat import bound_onednn_primitive_caches
batches, capacity = int(sys.argv[1]), int(sys.argv[2])
bound_onednn_primitive_caches(capacity)  # before decode_speed builds the packed model
from decode_speed import EOS, VOCAB, nmt_model
from nmt.decoding import SearchConfig, beam_search
torch.set_num_threads(1)
rss = lambda: next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024
model, rnd = nmt_model(0), random.Random(0)  # packed as Translator packs it
with torch.no_grad():  # </s> about as likely as the best other token, so sentences end at many lengths
    model.tgt_embed.weight[EOS] = 5.4 / model.cfg.d_model
start = time.perf_counter()
with torch.inference_mode():
    for i in range(1, batches + 1):
        B, S = rnd.randint(1, 64), rnd.randint(3, 60)
        src = torch.randint(4, VOCAB, (B, S))
        src[:, -1] = EOS
        beam_search(model, src, SearchConfig(beam_size=4, max_len_a=S, max_len_b=0.0, max_new_tokens=S))
        if i % 100 == 0:
            print(i, rss(), round(time.perf_counter() - start, 1), flush=True)
"""
LOSS_PEAK = """
import sys, torch
from nmt.kernels import _SmoothedCrossEntropy
from nmt.model import label_smoothed_nll
kind, dtype, n, v = sys.argv[1], getattr(torch, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
status = lambda key: next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) / 2**20
torch.manual_seed(0)
logits = torch.randn(n, v, dtype=dtype).requires_grad_()  # what the output projection hands the loss
labels = torch.randint(4, v, (n,))
labels[: n // 20] = 0  # 5% padding
if kind == "fused":
    loss = lambda: _SmoothedCrossEntropy.apply(logits, labels, 0, 0.1)[0]
else:
    loss = lambda: label_smoothed_nll(logits[None], labels[None], 0, 0.1)[0]
loss().backward()  # once, so that the gradient's buffer and the allocator's first growth are counted alike
logits.grad = None
base = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
loss().backward()
print(status("VmHWM") - base, logits.numel() * logits.element_size() / 2**30)
"""
PROGRESS = re.compile(r"step (\d+)/\d+.*?epoch=(\d+)")


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def command(data: Path, minutes: float, out: Path, src: str, tgt: str, extra: list[str]) -> list[str]:
    """The README's own-corpus command with the data paths and the budget, then the `extra` settings given."""
    return ["nmt", "train", "--data.train", str(data / "train"), "--data.valid", str(data / "valid"),
            "--data.test", str(data / "test"), "--data.src_lang", src, "--data.tgt_lang", tgt,
            "--max_minutes", f"{minutes:g}", "--output_dir", str(out), *extra]


def watch(argv: list[str], precision: str, every: float) -> list[tuple[float, int, int, float]]:
    """(seconds, step, epoch, RSS MiB) samples of the run; exits with the run's last lines if it fails."""
    env = dict(os.environ, ACCELERATE_MIXED_PRECISION=precision, PYTHONUNBUFFERED="1")
    nmt = Path(sys.executable).with_name("nmt")
    proc = subprocess.Popen([str(nmt) if nmt.exists() else "nmt", *argv[1:]], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    where = {"step": 0, "epoch": 1, "loop": 0.0}  # "loop": when the training loop last printed (progress, validation)
    tail: list[str] = []
    start = time.monotonic()

    def read() -> None:
        for line in proc.stdout:
            tail[:] = [*tail[-19:], line]
            for part in line.split("\r"):
                if (m := PROGRESS.search(part)) is not None:
                    where["step"], where["epoch"] = int(m[1]), int(m[2])
                if m is not None or part.startswith("valid @ step"):
                    where["loop"] = time.monotonic() - start

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples = []
    while proc.poll() is None:
        if (rss := rss_mib(proc.pid)) is not None and where["step"] > 0:
            samples.append((time.monotonic() - start, where["step"], where["epoch"], rss))
        time.sleep(every)
    reader.join(timeout=5)
    if proc.returncode != 0:
        sys.exit(f"the run with precision {precision} failed (exit {proc.returncode}):\n{''.join(tail)}")
    return [sample for sample in samples if sample[0] <= where["loop"]]  # the test set's decoding is not training


def slope_per_1000_steps(points: list[tuple[int, float]]) -> float:
    if len(points) < 2:
        return float("nan")
    n = len(points)
    mx, my = sum(s for s, _ in points) / n, sum(r for _, r in points) / n
    var = sum((s - mx) ** 2 for s, _ in points)
    return 1000 * sum((s - mx) * (r - my) for s, r in points) / var if var else float("nan")


def summary(samples: list[tuple[float, int, int, float]]) -> dict:
    first_epoch_end = next((i for i, (_, _, epoch, _) in enumerate(samples) if epoch >= 2), None)
    after = samples[first_epoch_end:] if first_epoch_end is not None else []
    return {"steps": samples[-1][1] if samples else 0, "epochs": samples[-1][2] if samples else 0,
            "after_epoch_1": after[0][3] if after else float("nan"), "end": samples[-1][3] if samples else float("nan"),
            "max": max((r for *_, r in samples), default=float("nan")),
            "slope": slope_per_1000_steps([(s, r) for _, s, _, r in after])}


def fresh_process(script: str, *args) -> list[tuple[float, ...]]:
    """Run `script` with `args` in a fresh Python (nmt and benchmarks/ importable, the primitive caches' variables
    unset): its lines of numbers (count, RSS MiB, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here)])
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                         check=True).stdout
    return [tuple(map(float, line.split())) for line in out.splitlines() if line.strip()]


def heap(steps: int, precisions: list[str]) -> None:
    """The training step alone with neither memory setting, each alone and both: RSS over the steps."""
    settings = {"neither": (0, 0), "heap release": (1, 0), "bounded caches": (0, 1), "both (training)": (1, 1)}
    for precision in precisions:
        for label, (release, bounded) in settings.items():
            samples = fresh_process(HEAP_STEP, precision, steps, release, bounded)
            shown = " ".join(f"{int(rss)}" for _, rss, _ in samples)
            name = "fp32" if precision == "no" else precision
            print(f"{name:<5} {label:<25} RSS MiB every 100 steps {shown}; {samples[-1][2]:.0f} s", flush=True)


def serve(batches: int) -> None:
    """Beam-4 decoding of batches of random shapes with each primitive cache at 64 and at 1,024: RSS over them."""
    for capacity in (64, 1024):
        samples = fresh_process(SERVE_DECODING, batches, capacity)
        shown = " ".join(f"{int(rss)}" for _, rss, _ in samples)
        print(f"{capacity:>5} primitives a cache: RSS MiB every 100 batches {shown}; {samples[-1][2]:.0f} s", flush=True)


def loss_peak(n: int, v: int) -> None:
    """The loss's own peak memory over its logits (N, V): forward and backward of the plain loss (log-softmax,
    nll, smoothing through autograd) and of nmt.kernels' fused one, with fp32 and bf16 logits, each in a fresh
    process: the most resident memory above what the logits and their gradient already hold."""
    print(f"loss forward + backward over logits ({n:,}, {v:,}), label smoothing 0.1, peak GiB above the logits "
          "(their gradient included):")
    for dtype in ("float32", "bfloat16"):
        found = {kind: fresh_process(LOSS_PEAK, kind, dtype, n, v)[0] for kind in ("plain", "fused")}
        size = found["plain"][1]
        print(f"  {dtype:<8} logits {size:.2f} GiB: plain {found['plain'][0]:.2f}, fused {found['fused'][0]:.2f} "
              f"(x{found['fused'][0] / found['plain'][0]:.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="folder with train/valid/test.{src,tgt}")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--minutes", type=float, default=10.0, help="the budget of each run")
    parser.add_argument("--precision", nargs="+", default=["no", "bf16"], choices=["no", "bf16"],
                        help="accelerate's mixed precision of each run (no = fp32)")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between two samples")
    parser.add_argument("--loss", type=int, nargs=2, metavar=("N", "V"), help="the loss's peak memory, plain and "
                        "fused, over logits of N target positions and V subwords (e.g. 8192 32000)")
    parser.add_argument("--heap", type=int, metavar="STEPS", help="measure the training step alone with and without "
                        "training's memory settings, for STEPS steps (no --data needed)")
    parser.add_argument("--serve", type=int, metavar="BATCHES", help="measure beam-4 decoding of BATCHES batches of "
                        "random shapes with the primitive caches bounded and not (no --data needed)")
    parser.add_argument("extra", nargs="*", help="after --: settings added to the command")
    args = parser.parse_args()
    if args.loss:
        return loss_peak(*args.loss)
    if args.heap:
        return heap(args.heap, args.precision)
    if args.serve:
        return serve(args.serve)
    if args.data is None:
        parser.error("give --data (or --heap STEPS, or --serve BATCHES)")
    rows = []
    for precision in args.precision:
        with tempfile.TemporaryDirectory() as tmp:
            argv = command(args.data, args.minutes, Path(tmp) / "run", args.src, args.tgt, args.extra)
            print("$", "ACCELERATE_MIXED_PRECISION=" + precision, " ".join(argv), flush=True)
            rows.append((precision, summary(watch(argv, precision, args.every))))
            print(row(*rows[-1]), flush=True)
    print(f"\n{'precision':<10}{'steps':>8}{'epochs':>8}{'RSS after epoch 1':>19}{'at the end':>12}{'largest':>10}"
          f"{'MiB / 1,000 steps after epoch 1':>33}")
    for precision, s in rows:
        print(row(precision, s))


def row(precision: str, s: dict) -> str:
    return (f"{'fp32' if precision == 'no' else precision:<10}{s['steps']:>8,}{s['epochs']:>8}"
            f"{s['after_epoch_1']:>15.0f} MiB{s['end']:>8.0f} MiB{s['max']:>6.0f} MiB{s['slope']:>33.1f}")


if __name__ == "__main__":
    main()
