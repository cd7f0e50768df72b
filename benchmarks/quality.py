"""Translation quality for a wall-clock budget: train nmt on a corpus given by path, score the test set once.

    python benchmarks/quality.py --data ../shared/data/tatoeba-en-de --minutes 25 \
        --config configs/tatoeba-en-de.yaml [--output runs/quality] [--baseline] [key=value ...]

Prints every setting that differs from nmt's defaults, the wall time of each phase, steps and tokens/s,
and test BLEU and chrF (cased, detokenized sacreBLEU, 13a) with their signatures. Choices are made on the
validation set during training; the test set is read once, at the end.

--baseline then trains issue #8's HF MarianMTModel baseline (benchmarks/hf_baseline.py) for the same
minutes on the same data and machine, and prints both systems side by side with the differences.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from nmt import Translator, load_config, train
from nmt.config import TrainConfig
from nmt.data import prepare
from nmt.metrics import corpus_scores
from nmt.strict import to_dict


def non_defaults(cfg: TrainConfig) -> dict:
    """Dotted keys whose value differs from TrainConfig()'s."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out
    mine, default = flat(to_dict(cfg)), flat(to_dict(TrainConfig()))
    return {k: v for k, v in mine.items() if default.get(k) != v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train/valid/test.<src>/<tgt>")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--config", default="configs/tatoeba-en-de.yaml")
    parser.add_argument("--minutes", type=float, default=25.0, help="training budget (wall clock)")
    parser.add_argument("--output", default="runs/quality")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--baseline", action="store_true",
                        help="also train the HF MarianMTModel baseline for the same minutes and compare")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    data = Path(args.data)
    cfg = load_config(args.config, [f"data.train={data / 'train'}", f"data.valid={data / 'valid'}",
                                    f"data.test={data / 'test'}", f"data.src_lang={args.src}",
                                    f"data.tgt_lang={args.tgt}", f"output_dir={args.output}",
                                    f"max_minutes={args.minutes}", *args.overrides])
    print("settings that differ from nmt's defaults:")
    for key, value in non_defaults(cfg).items():
        print(f"  {key} = {value}")
    phases = {}
    t = time.perf_counter()
    corpus = prepare(cfg.data, cfg.tokenizer, splits=("test",))  # fills the cache training then reads
    phases["data + tokenizer"] = time.perf_counter() - t
    t = time.perf_counter()
    result = train(cfg)
    phases["training (incl. validation, checkpoints, averaging)"] = time.perf_counter() - t
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    speeds = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    speed = speeds[len(speeds) // 2]
    t = time.perf_counter()
    test = corpus.splits["test"]
    hyps = Translator.from_pretrained(result.model_dir).translate(test["src"], beam_size=args.beam)
    scores = corpus_scores(hyps, test["tgt"])
    phases[f"test translation (beam {args.beam}, {len(hyps)} sentences)"] = time.perf_counter() - t
    (Path(cfg.output_dir) / "test.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    print("\nphases (wall time):")
    for name, seconds in phases.items():
        print(f"  {name}: {seconds / 60:.1f} min")
    print(f"steps: {result.steps}; target tokens/s (median of log rows): {speed:.0f}")
    print(f"kept model: {result.best}")
    print(f"test BLEU {scores['bleu']:.2f}  {scores['bleu_signature']}")
    print(f"test chrF {scores['chrf']:.2f}  {scores['chrf_signature']}")
    for src, hyp, ref in list(zip(test["src"], hyps, test["tgt"]))[:5]:
        print(f"  {src}\n    -> {hyp}\n    ref {ref}")
    if args.baseline:
        compare(cfg, args.minutes, {"steps": result.steps, "tokens_per_s": speed,
                                    **scores})


def compare(cfg: TrainConfig, minutes: float, nmt: dict) -> None:
    """Trains the HF baseline on cfg.data for `minutes` and prints it beside nmt's figures."""
    from hf_baseline import train_baseline  # benchmarks/ is on sys.path when this file runs as a script

    print(f"\nHF MarianMTModel baseline (benchmarks/hf_baseline.py), {minutes:g} minutes, same data and machine:")
    base = train_baseline(cfg.data, minutes, log=lambda line: print("  " + line, flush=True))
    for name, seconds in base.phases.items():
        print(f"  {name}: {seconds / 60:.1f} min")
    b = {"steps": base.steps, "tokens_per_s": base.tokens_per_s, **base.scores}
    print(f"\n{'system':<10}{'steps':>8}{'tgt tok/s':>11}{'BLEU':>8}{'chrF':>8}")
    for name, r in (("nmt", nmt), ("baseline", b)):
        print(f"{name:<10}{r['steps']:>8}{r['tokens_per_s']:>11.0f}{r['bleu']:>8.2f}{r['chrf']:>8.2f}")
    print(f"nmt - baseline: BLEU {nmt['bleu'] - b['bleu']:+.2f}, chrF {nmt['chrf'] - b['chrf']:+.2f}; "
          f"steps x{nmt['steps'] / max(b['steps'], 1):.2f}, tokens/s x{nmt['tokens_per_s'] / b['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
