"""The budget recipe measured: nmt's budget-aware defaults against the fixed defaults they replace, the hand-tuned
config and the HF baseline, on the same corpus and machine, side by side in one run, per corpus and budget.

    python benchmarks/recipe.py --data ../shared/data/tatoeba-en-de --minutes 10 25 --subset 10000 \
        [--subset-only] [--systems budget,fixed,tuned,baseline] [--output runs/recipe] [key=value ...]

Corpora: the data folder, and with --subset N also its first N training pairs (same validation and test sets).
Systems, each trained for the same wall-clock minutes:
  budget    nmt's defaults: README's own-corpus command, `nmt train` with the data paths and --max_minutes and
            nothing else (the subset is written to its own files first), the rest planned (nmt.plan)
  fixed     the fixed defaults before the plan (lr 5e-4, warmup 1,000, 4,096-token batches, validation every
            500 steps, no averaging, model and vocabulary by corpus size)
  tuned     the hand-tuned configs/tatoeba-en-de.yaml (--tuned-config)
  baseline  benchmarks/hf_baseline.py's MarianMTModel recipe (needs the bench extra)
An nmt system named with "-fp32" (budget-fp32, tuned-fp32) trains in fp32 whatever the hardware: the others take
the precision a run takes by default (nmt.training.loop.run_precision: bf16 under a time budget where the device
multiplies bf16 in hardware).
key=value overrides apply to the fixed and tuned systems (a tiny setting for a smoke test), never to budget.
Choices are made on validation (nmt: best validation BLEU, greedy; baseline: best validation loss); the test set
is read once per system, at the end, with beam 4. Prints one table per corpus and budget: steps, target
tokens/s, validation and test BLEU/chrF.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from accelerate.utils import patch_environment  # noqa: E402
from quality import run_user_command, user_command  # noqa: E402

from nmt import Translator, load_config, train  # noqa: E402
from nmt.compat import reset_accelerate_state  # noqa: E402
from nmt.config import TrainConfig  # noqa: E402
from nmt.data import prepare  # noqa: E402
from nmt.metrics import corpus_scores  # noqa: E402
from nmt.plan import size_row  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXED = ["optim.lr=5e-4", "optim.warmup_steps=1000", "max_tokens=4096", "eval_every=500", "save_every=500",
         "keep_last=2", "average_last=0", "tokenizer.dropout=0"]  # TrainConfig's defaults before the budget plan
SYSTEMS = ("budget", "fixed", "tuned", "baseline", "budget-fp32", "fixed-fp32", "tuned-fp32")


def data_overrides(args: argparse.Namespace, subset: int | None, out: Path, minutes: float) -> list[str]:
    data = Path(args.data)
    return [f"data.train={data / 'train'}", f"data.valid={data / 'valid'}", f"data.test={data / 'test'}",
            f"data.src_lang={args.src}", f"data.tgt_lang={args.tgt}",
            f"data.max_train_pairs={'null' if subset is None else subset}", f"output_dir={out}",
            f"max_minutes={minutes}"]


def nmt_config(system: str, args: argparse.Namespace, base: list[str]) -> TrainConfig:
    """The system's config: its own settings, then the corpus and budget, then the user's overrides."""
    if system == "tuned":
        return load_config(args.tuned_config, [*base, *args.overrides])
    cfg = load_config(None, [*base, *args.overrides])
    pairs = prepare(cfg.data, cfg.tokenizer).stats.sizing_pairs  # the fixed defaults sized by corpus only
    size = [] if any(o.startswith("model.") for o in args.overrides) else [f"model.size={size_row(pairs)[1]}"]
    return load_config(None, [*FIXED, *size, *base, *args.overrides])


def run_nmt(cfg: TrainConfig, beam: int, fp32: bool = False) -> dict:
    """Train (in fp32 if asked: as a launcher that chose "no" would), then translate the test set once with the kept
    model."""
    reset_accelerate_state()
    with patch_environment(accelerate_mixed_precision="no") if fp32 else contextlib.nullcontext():
        result = train(cfg)
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    speeds = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    test = prepare(cfg.data, cfg.tokenizer, splits=("test",)).splits["test"]
    hyps = Translator.from_pretrained(result.model_dir).translate(test["src"], beam_size=beam)
    scores = corpus_scores(hyps, test["tgt"])
    return {"steps": result.steps, "tokens_per_s": speeds[len(speeds) // 2] if speeds else 0.0,
            "valid_bleu": result.best.get("bleu"), "valid_chrf": result.best.get("chrf"),
            "valid_nll": result.best.get("valid_nll"), "bleu": scores["bleu"], "chrf": scores["chrf"]}


def run_budget(args: argparse.Namespace, subset: int | None, out: Path, minutes: float, fp32: bool = False) -> dict:
    """README's own-corpus command on the corpus (its first `subset` training pairs written to files of their own)."""
    data = Path(args.data)
    if subset is not None:
        data = write_subset(data, args.src, args.tgt, subset, Path(args.output) / f"data-first-{subset}")
    # -fp32: as a launcher that chose "no" would (the environment, not a flag: the command stays the user's)
    r = run_user_command(user_command(data, args.src, args.tgt, minutes, out),
                         env={"ACCELERATE_MIXED_PRECISION": "no"} if fp32 else None)
    best = r["best"]
    return {"steps": r["steps"], "tokens_per_s": r["tokens_per_s"], "valid_bleu": best.get("bleu"),
            "valid_chrf": best.get("chrf"), "valid_nll": best.get("valid_nll"), "bleu": r["test"]["bleu"],
            "chrf": r["test"]["chrf"]}


def write_subset(data: Path, src: str, tgt: str, n: int, folder: Path) -> Path:
    """A corpus folder of the first `n` training pairs and the same validation and test files."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for lang in (src, tgt):
        with open(data / f"train.{lang}", encoding="utf-8") as f, open(folder / f"train.{lang}", "w", encoding="utf-8") as g:
            for _, line in zip(range(n), f):
                g.write(line)
        for split in ("valid", "test"):
            shutil.copyfile(data / f"{split}.{lang}", folder / f"{split}.{lang}")
    return folder


def run_baseline(cfg: TrainConfig, minutes: float, tiny: bool) -> dict:
    from hf_baseline import BaselineConfig, train_baseline

    base = BaselineConfig(vocab_size=300, d_model=32, layers=1, heads=2, ffn=64, max_tokens=400) if tiny else None
    res = train_baseline(cfg.data, minutes, base, log=lambda line: print("  " + line, flush=True), valid=True)
    return {"steps": res.steps, "tokens_per_s": res.tokens_per_s, "valid_bleu": res.valid_scores.get("bleu"),
            "valid_chrf": res.valid_scores.get("chrf"), "valid_nll": res.best_valid_loss, **res.scores}


def table(rows: dict[str, dict]) -> list[str]:
    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    out = [f"{'system':<12}{'steps':>8}{'tgt tok/s':>11}{'valid nll':>11}{'valid BLEU':>12}{'valid chrF':>12}"
           f"{'test BLEU':>11}{'test chrF':>11}"]
    for name, r in rows.items():
        out.append(f"{name:<12}{r['steps']:>8}{f(r['tokens_per_s'], '>11.0f')}{f(r['valid_nll'], '>11.3f')}"
                   f"{f(r['valid_bleu'], '>12.2f')}{f(r['valid_chrf'], '>12.2f')}{r['bleu']:>11.2f}{r['chrf']:>11.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train/valid/test.<src>/<tgt>")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--minutes", type=float, nargs="+", default=[10.0, 25.0], help="budgets (wall clock)")
    parser.add_argument("--subset", type=int, nargs="*", default=[], help="also the first N training pairs")
    parser.add_argument("--subset-only", action="store_true", help="only the --subset corpora, not the whole one")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated of {', '.join(SYSTEMS)}")
    parser.add_argument("--tuned-config", default=str(ROOT / "configs" / "tatoeba-en-de.yaml"))
    parser.add_argument("--output", default="runs/recipe")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--tiny-baseline", action="store_true", help="shrink the baseline's model (smoke tests)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every nmt system, key=value")
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    results = {}
    if args.subset_only and not args.subset:
        parser.error("--subset-only needs --subset N")
    for subset in [*([] if args.subset_only else [None]), *args.subset]:
        for minutes in args.minutes:
            corpus = f"{Path(args.data).name}{f' first {subset:,} pairs' if subset else ''}, {minutes:g} min"
            print(f"\n=== {corpus} ===", flush=True)
            rows = {}
            for system in systems:
                out = Path(args.output) / f"{subset or 'all'}-{minutes:g}min-{system}"
                base = data_overrides(args, subset, out, minutes)
                t = time.perf_counter()
                if system == "baseline":
                    rows[system] = run_baseline(load_config(None, [*base, *args.overrides]), minutes, args.tiny_baseline)
                elif system.startswith("budget"):
                    rows[system] = run_budget(args, subset, out, minutes, fp32=system.endswith("-fp32"))
                else:
                    name, _, precision = system.partition("-")
                    rows[system] = run_nmt(nmt_config(name, args, base), args.beam, fp32=precision == "fp32")
                r = rows[system]
                print(f"{system}: done in {(time.perf_counter() - t) / 60:.1f} min, {r['steps']} steps, "
                      f"test BLEU {r['bleu']:.2f} chrF {r['chrf']:.2f}", flush=True)
            results[corpus] = rows
            print("\n".join(table(rows)), flush=True)
    print("\nsummary (test BLEU)")
    for corpus, rows in results.items():
        print(f"  {corpus}: " + ", ".join(f"{name} {r['bleu']:.2f}" for name, r in rows.items()))
    Path(args.output).mkdir(parents=True, exist_ok=True)
    (Path(args.output) / "recipe.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
