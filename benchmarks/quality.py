"""Translation quality for a wall-clock budget, from the command a user runs: README's own-corpus `nmt train`
with the data paths and `--max_minutes`, nothing else; then the test set scored once, beam 4.

    python benchmarks/quality.py --data ../shared/data/tatoeba-en-de --minutes 25 [--output runs/quality] [--baseline]
    python benchmarks/quality.py --data D --src en --tgt fr --minutes 25 --side-by-side [--seed 2]

The data folder holds train/valid/test.<src>/<tgt>. Prints the command, the plan nmt printed, the minutes, steps
and epochs, validation and test BLEU/chrF (cased, detokenized sacreBLEU, 13a). --baseline then trains two HF
MarianMTModel peers (benchmarks/hf_baseline.py) for the same minutes on the same data and machine: the published
recipe (its own size, batch, rate and 1,000-step warmup) and the Marian given nmt's own plan (the size, vocabulary,
batch, rate, warmup, dropout, label smoothing and clipping nmt chose, from the run's config.yaml and plan.json),
and prints the three side by side with nmt minus each.

--side-by-side trains nmt and the Marian given its plan at once, one CPU core and one thread each (nmt's command
on the first core of this process's, the peer in this process on the second): the peer starts when nmt's plan
has been re-timed after its first validation, and takes the plan as it stands then. Half the wall time of
--baseline for the comparison the floor is about, and both systems meet the same machine load. --seed N adds
`--seed N` to nmt's command (a second seed of the same command) and gives the peer the same seed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def user_command(data: Path, src: str, tgt: str, minutes: float, output: Path, seed: int | None = None) -> list[str]:
    """README's own-corpus command for this corpus and budget, word for word (tests/test_benchmarks.py holds it
    to the README); with `seed`, that command with `--seed` added."""
    return ["nmt", "train", "--data.train", f"{data}/train", "--data.valid", f"{data}/valid", "--data.test",
            f"{data}/test", "--data.src_lang", src, "--data.tgt_lang", tgt, "--max_minutes", f"{minutes:g}",
            "--output_dir", str(output), *(["--seed", str(seed)] if seed is not None else [])]


def start_user_command(argv: list[str], env: dict | None = None, core: int | None = None) -> subprocess.Popen:
    """Starts `argv` (an `nmt ...` command) with the nmt next to this Python, its output shown as it comes; with
    `core`, pinned to that CPU core."""
    nmt = Path(sys.executable).with_name("nmt")
    print("$ " + " ".join(argv), flush=True)
    pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    return subprocess.Popen([str(nmt) if nmt.is_file() else argv[0], *argv[1:]], env={**os.environ, **(env or {})},
                            preexec_fn=pin)


def run_user_command(argv: list[str], env: dict | None = None) -> dict:
    """Runs `argv` to its end; returns the run's summary (`finish_user_command`)."""
    return finish_user_command(argv, start_user_command(argv, env))


def finish_user_command(argv: list[str], proc: subprocess.Popen) -> dict:
    """Waits for `proc` (started from `argv`); returns the run's summary.json (steps, minutes, validation and test
    scores) and its median target tokens/s."""
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(argv)} failed with exit code {proc.returncode}")
    out = Path(argv[argv.index("--output_dir") + 1])
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    return {**summary, "tokens_per_s": speeds[len(speeds) // 2] if speeds else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train/valid/test.<src>/<tgt>")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--minutes", type=float, default=25.0, help="the time budget (wall clock)")
    parser.add_argument("--output", default="runs/quality")
    parser.add_argument("--baseline", action="store_true",
                        help="also train the HF MarianMTModel baseline for the same minutes and compare")
    parser.add_argument("--side-by-side", action="store_true",
                        help="train nmt and the HF Marian given its plan at once, one core each")
    parser.add_argument("--seed", type=int, help="add --seed N to nmt's command (the peer gets the same seed)")
    args = parser.parse_args()
    start = time.perf_counter()
    argv = user_command(Path(args.data), args.src, args.tgt, args.minutes, Path(args.output), args.seed)
    if args.side_by_side:
        return side_by_side(args, argv, start)
    nmt = run_user_command(argv)
    report(args, nmt, start)
    if args.baseline:
        from hf_baseline import BaselineConfig
        peers = {"hf recipe": BaselineConfig(), "hf + plan": given_nmts_plan(Path(args.output))}
        compare(nmt, {name: train_peer(args, name, recipe) for name, recipe in peers.items()})


def side_by_side(args: argparse.Namespace, argv: list[str], start: float) -> None:
    """nmt's command on one core and the Marian given its plan on another, at once (module docstring)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--side-by-side needs two CPU cores; this process may use one")
    proc = start_user_command(argv, {"OMP_NUM_THREADS": "1"}, core=cores[0])
    plan = Path(args.output) / "plan.json"
    while proc.poll() is None and not (plan.is_file() and (json.loads(plan.read_text()).get("retimed") or {})
                                       .get("validation_s")):
        time.sleep(2)
    os.sched_setaffinity(0, {cores[1]})
    import torch
    torch.set_num_threads(1)
    peer = train_peer(args, "hf + plan", given_nmts_plan(Path(args.output)))
    nmt = finish_user_command(argv, proc)
    report(args, nmt, start)
    compare(nmt, {"hf + plan": peer})


def report(args: argparse.Namespace, nmt: dict, start: float) -> None:
    print(f"\nthe whole command: {(time.perf_counter() - start) / 60:.1f} min; training {nmt['minutes']:.1f} of "
          f"{args.minutes:g} min ({nmt['stop_reason']}); {nmt['steps']} steps, {nmt['epochs']:.1f} epochs, "
          f"{nmt['tokens_per_s']:.0f} target tokens/s")
    best = nmt["best"]
    print(f"validation: BLEU {best.get('bleu', float('nan')):.2f}, chrF {best.get('chrf', float('nan')):.2f}")
    print(f"test BLEU {nmt['test']['bleu']:.2f}  chrF {nmt['test']['chrf']:.2f}  ({nmt['test']['pairs']} pairs, beam 4)")


def given_nmts_plan(run_dir: Path):
    """The HF baseline's recipe with what nmt's run chose (its resolved config.yaml, the re-timed plan.json
    over it): the same size, vocabulary, batch, rate, dropout on embeddings and residual branches, betas, label
    smoothing, clipping and mixed precision (the one nmt's run took on this machine), and a warmup sized to the
    peer's own steps as nmt's plan sizes nmt's (WARMUP_SHARE of the steps the budget holds, timed). Marian keeps
    its own defaults elsewhere: no dropout on the attention weights or activations, transformers' decoding."""
    import torch
    from hf_baseline import BaselineConfig

    from nmt.config import load_config
    from nmt.plan import MAX_WARMUP, WARMUP_SHARE
    from nmt.training.loop import run_precision

    cfg = load_config(run_dir / "config.yaml")
    chosen = json.loads((run_dir / "plan.json").read_text()).get("chosen", {})
    m, o = cfg.model, cfg.optim
    planned_warmup = "optim.warmup_steps" in chosen
    return BaselineConfig(vocab_size=chosen.get("tokenizer.vocab_size", cfg.tokenizer.vocab_size),
                          d_model=m.d_model, layers=m.n_encoder_layers, decoder_layers=m.n_decoder_layers,
                          heads=m.n_heads, ffn=m.d_ff, dropout=m.dropout, lr=chosen.get("optim.lr", o.lr),
                          betas=tuple(o.betas), warmup_steps=chosen.get("optim.warmup_steps", o.warmup_steps),
                          warmup_share=WARMUP_SHARE if planned_warmup else None, max_warmup=MAX_WARMUP,
                          precision=run_precision(cfg, "cuda" if torch.cuda.is_available() else "cpu")[0],
                          label_smoothing=o.label_smoothing, max_grad_norm=o.clip_norm,
                          max_tokens=chosen.get("max_tokens", cfg.max_tokens), seed=cfg.seed)


def train_peer(args: argparse.Namespace, name: str, recipe) -> dict:
    """Trains one HF peer on the same data for the same minutes; its steps, tokens/s and test scores."""
    from hf_baseline import train_baseline

    from nmt.config import DataConfig

    data = Path(args.data)
    corpus = DataConfig(train=str(data / "train"), valid=str(data / "valid"), test=str(data / "test"),
                        src_lang=args.src, tgt_lang=args.tgt)
    print(f"\nHF MarianMTModel ({name}: d_model {recipe.d_model}, {recipe.layers}+"
          f"{recipe.decoder_layers or recipe.layers} layers, FFN {recipe.ffn}, vocabulary {recipe.vocab_size:,}, "
          f"{recipe.max_tokens:,}-token batches, lr {recipe.lr:g}, "
          f"warmup {'sized to its steps' if recipe.warmup_share else f'{recipe.warmup_steps:,}'}, "
          f"precision {recipe.precision}), "
          f"{args.minutes:g} minutes, same data and machine:", flush=True)
    base = train_baseline(corpus, args.minutes, recipe, log=lambda line: print("  " + line, flush=True))
    for phase, seconds in base.phases.items():
        print(f"  {phase}: {seconds / 60:.1f} min")
    return {"steps": base.steps, "tokens_per_s": base.tokens_per_s, **base.scores}


def compare(nmt: dict, peers: dict[str, dict]) -> None:
    """nmt's figures and each peer's, one table, and nmt minus each."""
    rows = {"nmt": {"steps": nmt["steps"], "tokens_per_s": nmt["tokens_per_s"], **nmt["test"]}, **peers}
    print(f"\n{'system':<11}{'steps':>8}{'tgt tok/s':>11}{'BLEU':>8}{'chrF':>8}")
    for name, r in rows.items():
        print(f"{name:<11}{r['steps']:>8}{r['tokens_per_s']:>11.0f}{r['bleu']:>8.2f}{r['chrf']:>8.2f}")
    n = rows["nmt"]
    for name in peers:
        b = rows[name]
        print(f"nmt - {name}: BLEU {n['bleu'] - b['bleu']:+.2f}, chrF {n['chrf'] - b['chrf']:+.2f}; steps "
              f"x{n['steps'] / max(b['steps'], 1):.2f}, tokens/s x{n['tokens_per_s'] / max(b['tokens_per_s'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
