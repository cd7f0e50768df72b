"""Data preparation at scale: corpora of 100k, 1M, 3M (10M) unique pairs, cold and warm, against `tokenizers` alone.

Each corpus joins two Tatoeba pairs into one (English i + English j, German i + German j; every (i, j) once),
written next to the cache in --work, never into the repository. For each size it prints:

- `nmt check --probe-steps 0`'s work (read, clean+dedupe, tokenizer, encode, epoch plan), timed per phase, in a
  fresh process with an empty cache (cold) and again with the cache filled (warm); the process's wall time
  (interpreter start and imports included) and its peak RSS;
- the limit: `tokenizers` alone, in a fresh process with all its threads, training the same BPE
  (`train_from_iterator`) and encoding both sides (`encode_batch`) of the same text;
- seconds from starting `nmt train` (tiny model) to its first optimizer step, cold and warm;
- linearity: seconds per million pairs of the largest size over those of the smallest.

    python benchmarks/scale.py ../shared/data/tatoeba-en-de --sizes 100k,1M,3M --work /tmp/nmt-scale
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
PHASES = ("read", "clean", "tokenizer", "encode", "plan")


def parse_size(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def build_corpus(data: Path, n: int, work: Path, langs: tuple[str, str] = ("en", "de")) -> Path:
    """`n` unique pairs at work/pairs-N.{en,de}: pair k joins Tatoeba pairs i = k mod m and (i + 1 + k // m) mod m."""
    prefix = work / f"pairs-{n}"
    if Path(f"{prefix}.de").is_file():
        return prefix
    en = (data / f"train.{langs[0]}").read_text(encoding="utf-8").splitlines()
    de = (data / f"train.{langs[1]}").read_text(encoding="utf-8").splitlines()
    m = len(en)
    if n > m * (m - 1):
        raise SystemExit(f"at most {m * (m - 1):,} pairs from {m:,} sentences")
    with open(f"{prefix}.en.tmp", "w", encoding="utf-8") as f_en, open(f"{prefix}.de.tmp", "w", encoding="utf-8") as f_de:
        for start in range(0, n, 100_000):
            ks = range(start, min(n, start + 100_000))
            pairs = [(k % m, (k % m + 1 + k // m) % m) for k in ks]
            f_en.write("".join(f"{en[i]} {en[j]}\n" for i, j in pairs))
            f_de.write("".join(f"{de[i]} {de[j]}\n" for i, j in pairs))
    os.replace(f"{prefix}.en.tmp", f"{prefix}.en")
    os.replace(f"{prefix}.de.tmp", f"{prefix}.de")
    return prefix


def overrides(prefix: Path, cache: Path, vocab: int) -> list[str]:
    return [f"data.train={prefix}", "data.src_lang=en", "data.tgt_lang=de", f"data.cache_dir={cache}",
            f"tokenizer.vocab_size={vocab}", "model.size=tiny", "max_tokens=4096"]


# --- the measured processes (run as `scale.py --child KIND ...`) ------------------------------------------


def child_prepare(args: argparse.Namespace) -> dict:
    """nmt check's data work without the model: prepare, then plan epoch 0 of the training sampler."""
    from nmt.batching import TokenBatchSampler
    from nmt.config import load_config
    from nmt.data import prepare
    from nmt.encoding import source_lengths
    from nmt.tables import column

    cfg = load_config(None, overrides(Path(args.prefix), Path(args.cache), args.vocab))
    corpus = prepare(cfg.data, cfg.tokenizer)
    start = time.perf_counter()
    train = corpus.splits["train"]
    TokenBatchSampler(column(train, "cost"), cfg.max_tokens, ties=source_lengths(train)).plan(0)
    return {**corpus.stats.seconds, "plan": time.perf_counter() - start, "pairs": corpus.stats.pairs["train"]}


def child_limit(args: argparse.Namespace) -> dict:
    """`tokenizers` alone on the same text: BPE trained from an iterator, both sides encoded, all threads."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    en = Path(f"{args.prefix}.en").read_text(encoding="utf-8").splitlines()
    de = Path(f"{args.prefix}.de").read_text(encoding="utf-8").splitlines()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizers.NFKC(), pre_tokenizers.Metaspace(), decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, min_frequency=2, show_progress=False,
                                  special_tokens=["<pad>", "<unk>", "<s>", "</s>"])
    start = time.perf_counter()
    batches = (side[i: i + 10_000] for side in (en, de) for i in range(0, len(side), 10_000))
    tok.train_from_iterator(batches, trainer=trainer, length=len(en) + len(de))
    trained = time.perf_counter()
    for side in (en, de):
        for i in range(0, len(side), 10_000):
            tok.encode_batch(side[i: i + 10_000], add_special_tokens=False)
    return {"train": trained - start, "encode": time.perf_counter() - trained}


def child_env() -> dict:
    """Offline; TOKENIZERS_PARALLELISM unset, so nmt uses the tokenizer's threads as it does by default."""
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    return {**env, "HF_HUB_OFFLINE": "1"}


class AnonPeak:
    """Peak anonymous memory (RssAnon, sampled every 20 ms). Peak RSS also counts the pages of memory-mapped
    Arrow files a process has touched, which the kernel drops under memory pressure: both are reported."""

    def __init__(self):
        self.peak, self.done = 0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.02):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    self.peak = max(self.peak, int(line.split()[1]))

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return self.peak / 1024


def run_child(kind: str, prefix: Path, cache: Path, vocab: int) -> dict:
    """Run a child in a fresh process: its JSON, its wall time and its peak RSS (MiB)."""
    cmd = [sys.executable, __file__, "--child", kind, "--prefix", str(prefix), "--cache", str(cache),
           "--vocab", str(vocab)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**out, "wall": wall}


def first_step_seconds(prefix: Path, cache: Path, vocab: int, out: Path, timeout: float = 3600) -> float:
    """Seconds from starting `nmt train` to its first optimizer step (the first metrics.jsonl row, logged after it)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "nmt.cli", "train", *overrides(prefix, cache, vocab), f"output_dir={out}",
           "max_steps=100000", "log_every=1", "eval_every=100000", "save_every=100000"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=child_env())
    metrics = out / "metrics.jsonl"
    try:
        while not (metrics.is_file() and metrics.stat().st_size > 0):
            if proc.poll() is not None:
                raise SystemExit(f"nmt train exited before its first step:\n{proc.stderr.read()[-3000:]}")
            if time.perf_counter() - start > timeout:
                raise SystemExit("nmt train: no first step within the timeout")
            time.sleep(0.05)
        return time.perf_counter() - start
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- one size, and the report ---------------------------------------------------------------------------


def measure(n: int, args: argparse.Namespace) -> dict:
    prefix = build_corpus(args.data, n, args.work, (args.src_lang, args.tgt_lang))
    cache = args.work / f"cache-{n}"
    shutil.rmtree(cache, ignore_errors=True)
    row = {"pairs": n, "cold": run_child("prepare", prefix, cache, args.vocab)}
    row["warm"] = run_child("prepare", prefix, cache, args.vocab)
    row["limit"] = run_child("limit", prefix, cache, args.vocab)
    if args.train:
        train_cache = args.work / f"train-cache-{n}"
        shutil.rmtree(train_cache, ignore_errors=True)
        row["first_step"] = {when: first_step_seconds(prefix, train_cache, args.vocab, args.work / f"run-{n}")
                             for when in ("cold", "warm")}
    print_row(row)
    sys.stdout.flush()  # one size at a time, for long runs
    return row


def print_row(row: dict) -> None:
    cold, warm, limit = row["cold"], row["warm"], row["limit"]
    print(f"\n{row['pairs']:,} pairs ({cold['pairs']:,} training pairs after carving and cleaning)")
    print(f"  {'phase':<34}{'cold s':>9}{'warm s':>9}")
    for phase in PHASES:
        print(f"  {phase:<34}{cold[phase]:>9.2f}{warm[phase]:>9.2f}")
    print(f"  {'process wall (nmt check, no probe)':<34}{cold['wall']:>9.2f}{warm['wall']:>9.2f}")
    print(f"  {'peak RSS MiB':<34}{cold['maxrss_mib']:>9.0f}{warm['maxrss_mib']:>9.0f}"
          f"   (tokenizers alone: {limit['maxrss_mib']:.0f})")
    print(f"  {'peak anonymous memory MiB':<34}{cold['anon_mib']:>9.0f}{warm['anon_mib']:>9.0f}"
          f"   (tokenizers alone: {limit['anon_mib']:.0f})")
    own = limit["train"] + limit["encode"]
    work = sum(cold[p] for p in ("tokenizer", "encode"))
    print(f"  limit: tokenizers alone, all threads: train {limit['train']:.2f} s + encode {limit['encode']:.2f} s "
          f"= {own:.2f} s; nmt tokenizer+encode {work:.2f} s ({work / own:.2f}x), whole cold process "
          f"{cold['wall'] / own:.2f}x")
    if "first_step" in row:
        fs = row["first_step"]
        print(f"  nmt train start -> first optimizer step: cold {fs['cold']:.2f} s, warm {fs['warm']:.2f} s")


def print_linearity(rows: list[dict]) -> None:
    if len(rows) < 2:
        return
    small, large = rows[-2], rows[-1]  # the two largest: the 1M -> 3M
    print(f"\nlinearity, seconds per million pairs at {large['pairs']:,} over those at {small['pairs']:,} "
          "(1.00 = linear):")
    for when in ("cold", "warm"):
        per = [r[when]["wall"] / r["pairs"] * 1e6 for r in (small, large)]
        print(f"  {when:<5} process wall {per[0]:8.2f} -> {per[1]:8.2f} s/M pairs: {per[1] / per[0]:.2f}")
    for name, key in (("peak RSS", "maxrss_mib"), ("peak anonymous memory", "anon_mib")):
        mib = [r["cold"][key] for r in (small, large)]
        per_pair = (mib[1] - mib[0]) * 2**20 / (large["pairs"] - small["pairs"])
        print(f"  {name}, cold {mib[0]:.0f} -> {mib[1]:.0f} MiB: {per_pair:.0f} bytes per added pair")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", type=Path, nargs="?", help="a folder with train.en / train.de (Tatoeba en-de)")
    p.add_argument("--sizes", default="100k,1M,3M", help="comma-separated pair counts (k, M suffixes)")
    p.add_argument("--work", type=Path, default=Path("/tmp/nmt-scale"), help="corpora, caches and runs go here")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--src-lang", default="en", help="DATA/train.SRC_LANG is the source side")
    p.add_argument("--tgt-lang", default="de", help="DATA/train.TGT_LANG is the target side")
    p.add_argument("--no-train", dest="train", action="store_false", help="skip the nmt train first-step timing")
    p.add_argument("--child", choices=("prepare", "limit"), help=argparse.SUPPRESS)
    p.add_argument("--prefix", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        anon = AnonPeak()
        out = child_prepare(args) if args.child == "prepare" else child_limit(args)
        out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["anon_mib"] = anon.stop()
        print(json.dumps(out))
        return
    if args.data is None:
        p.error("give the folder of train.en / train.de")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = [measure(parse_size(s), args) for s in args.sizes.split(",")]
    print_linearity(rows)


if __name__ == "__main__":
    main()
