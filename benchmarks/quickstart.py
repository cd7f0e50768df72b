"""The quickstart measured: `bash run.sh`'s config (configs/default.yaml) with nmt's defaults beside each candidate
change, side by side, one CPU core and one thread each, then the test set scored as run.sh scores it (`nmt
evaluate`, beam 4). Every default is screened here before it changes, beside the real corpora.

    python benchmarks/quickstart.py [--candidate NAME="--key value ..."]... [--config configs/default.yaml]
                                    [--output runs/quickstart] [--cores 0,1] [--without-default]
                                    [--sentences N] [key=value ...]

    python benchmarks/quickstart.py --candidate xavier="--model.init_std 0"

A candidate is a name and the flags it adds to run.sh's command, after any VAR=value environment it runs with
(PYTHONPATH=/path/to/a/patched/checkout screens a change that has no setting yet); "default" (no flags) runs
beside them unless --without-default. Runs go `len(cores)` at a time, each pinned to its core
(OMP_NUM_THREADS=1), each with its own data cache. key=value overrides go to every run alike (a tiny setting for a
smoke test). Prints, per run: steps, training minutes, test BLEU / chrF, and the test translations that repeat a
word (the same word twice in a row where the reference has no such repeat), with the first few; writes the table
to OUTPUT/quickstart.json as each run ends.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nmt.cli import overrides_from_flags  # noqa: E402
from nmt.config import load_config  # noqa: E402
from nmt.data import prepare  # noqa: E402
from nmt.textfiles import atomic_file  # noqa: E402


def repeats(line: str) -> bool:
    """Whether a word follows itself in `line` (the quickstart's failure: "maperukai maperukai")."""
    words = line.split()
    return any(a == b for a, b in zip(words, words[1:]))


def nmt_cmd(*argv: str) -> list[str]:
    nmt = Path(sys.executable).with_name("nmt")
    return [str(nmt) if nmt.is_file() else "nmt", *argv]


def start(name: str, words: list[str], args, core: int) -> tuple[subprocess.Popen, Path, float, dict]:
    """run.sh's training command for candidate `name` (its environment, then its flags), pinned to `core`."""
    out = Path(args.output) / name
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = list(words)
    while flags and "=" in flags[0] and not flags[0].startswith("-"):
        key, _, value = flags.pop(0).partition("=")
        env[key] = value
    argv = nmt_cmd("train", "--config", args.config, *flags, *overrides_from_flags(args.overrides),
                   "--output_dir", str(out / "run"), "--data.cache_dir", str(out / "cache"))
    print(f"$ [core {core}] " + shlex.join([*words[:len(words) - len(flags)], *argv[1:]]), flush=True)
    proc = subprocess.Popen(argv, env=env, preexec_fn=lambda: os.sched_setaffinity(0, {core}),
                            stdout=open(out.with_suffix(".log"), "w"), stderr=subprocess.STDOUT)
    return proc, out, time.time(), env


def score(name: str, out: Path, minutes: float, core: int, src: Path, ref: Path, env: dict) -> dict:
    """The test set translated and scored as run.sh does; the row of the table."""
    hyp = out / "test.hyp"
    done = subprocess.run(nmt_cmd("evaluate", str(out / "run" / "model"), "--src", str(src), "--ref", str(ref),
                                  "--output", str(hyp)),
                          env=env, capture_output=True, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    if done.returncode != 0:
        raise SystemExit(f"nmt evaluate failed for {name}:\n{done.stderr[-2000:]}")
    scores = {line.split()[0].lower(): float(line.split()[1]) for line in done.stdout.splitlines()
              if line.startswith(("BLEU ", "chrF "))}
    hyps = hyp.read_text(encoding="utf-8").splitlines()
    refs = ref.read_text(encoding="utf-8").splitlines()
    src_lines = src.read_text(encoding="utf-8").splitlines()
    repeated = [(s, h) for s, h, r in zip(src_lines, hyps, refs) if repeats(h) and not repeats(r)]
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"name": name, "core": core, "steps": max(r["step"] for r in rows), "minutes": round(minutes, 2),
            "bleu": scores["bleu"], "chrf": scores["chrf"], "repeating": len(repeated), "sentences": len(hyps),
            "examples": [f"{s}  =>  {h}" for s, h in repeated[:3]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidate", action="append", default=[], metavar='NAME="FLAGS"',
                        help="a change to screen: its name and the flags it adds to run.sh's command")
    parser.add_argument("--config", default="configs/default.yaml", help="run.sh's CONFIG")
    parser.add_argument("--output", default="runs/quickstart")
    parser.add_argument("--cores", default="0,1", help="the CPU cores the runs are pinned to, one run each")
    parser.add_argument("--sentences", type=int, default=None,
                        help="score the first N test sentences only (a smoke test; run.sh scores them all)")
    parser.add_argument("--without-default", action="store_true",
                        help="the candidates only (the default measured already, on this machine)")
    parser.add_argument("overrides", nargs="*", help="key=value for every run (a smoke test's tiny setting)")
    args = parser.parse_args()
    runs = {} if args.without_default else {"default": []}
    for item in args.candidate:
        name, _, flags = item.partition("=")
        if not name or name in runs or "/" in name:
            raise SystemExit(f"--candidate {item!r}: give NAME=\"FLAGS\" with a new name (no '/')")
        runs[name] = shlex.split(flags)
    cores = [int(c) for c in args.cores.split(",")]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)

    # the test set as run.sh writes it: the config's own test split, prepared once
    cfg = load_config(args.config, overrides_from_flags(args.overrides))
    cfg.data.cache_dir = str(out / "cache")
    test = prepare(cfg.data, cfg.tokenizer).splits["test"]
    src, ref = out / "test.src", out / "test.ref"
    n = len(test) if args.sentences is None else args.sentences
    src.write_text("".join(s + "\n" for s in test["src"][:n]), encoding="utf-8")
    ref.write_text("".join(s + "\n" for s in test["tgt"][:n]), encoding="utf-8")

    rows, pending = [], list(runs.items())
    while pending:
        batch, pending = pending[:len(cores)], pending[len(cores):]
        started = [(name, *start(name, flags, args, core), core) for (name, flags), core in zip(batch, cores)]
        for name, proc, run_out, t0, env, core in started:
            if proc.wait() != 0:
                raise SystemExit(f"{name}'s training failed; see {run_out.with_suffix('.log')}")
            rows.append(score(name, run_out, (time.time() - t0) / 60, core, src, ref, env))
            with atomic_file(out / "quickstart.json") as f:
                f.write(json.dumps(rows, indent=2))

    base = next((r for r in rows if r["name"] == "default"), rows[0])
    print(f"\nbash run.sh's config ({args.config}), one core each, test set {base['sentences']} sentences, beam 4")
    print(f"{'run':<16}{'core':>5}{'steps':>7}{'minutes':>9}{'BLEU':>8}{'chrF':>8}{'vs default':>16}{'repeating':>11}")
    for r in rows:
        vs = "" if r is base else f"{r['bleu'] - base['bleu']:+.2f} / {r['chrf'] - base['chrf']:+.2f}"
        print(f"{r['name']:<16}{r['core']:>5}{r['steps']:>7}{r['minutes']:>9.1f}{r['bleu']:>8.2f}{r['chrf']:>8.2f}"
              f"{vs:>16}{r['repeating']:>11}")
    for r in rows:
        for line in r["examples"]:
            print(f"  {r['name']}: {line}")


if __name__ == "__main__":
    main()
