"""Ensemble gain: train the same config with two seeds, then test BLEU of each model and of their ensemble.

    python benchmarks/ensemble.py --data ../shared/data/tatoeba-en-de --minutes 12 \
        --config configs/tatoeba-en-de.yaml [--output runs/ensemble] [--seeds 1 2] [key=value ...]

Both runs share one tokenizer (trained on the same data with the same settings), so `nmt translate DIR_A DIR_B`
can ensemble them: every step averages the models' log-probabilities (`nmt.decoding`). Prints each model's and
the ensemble's test BLEU and chrF (beam 4, sacreBLEU 13a) and decoding time; the test set is read at the end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nmt import Translator, load_config, train
from nmt.data import prepare
from nmt.metrics import corpus_scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train/valid/test.<src>/<tgt>")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--config", default="configs/tatoeba-en-de.yaml")
    parser.add_argument("--minutes", type=float, default=12.0, help="training budget per seed (wall clock)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--output", default="runs/ensemble")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    data = Path(args.data)
    common = [f"data.train={data / 'train'}", f"data.valid={data / 'valid'}", f"data.test={data / 'test'}",
              f"data.src_lang={args.src}", f"data.tgt_lang={args.tgt}", f"max_minutes={args.minutes}", *args.overrides]
    model_dirs = []
    for seed in args.seeds:
        cfg = load_config(args.config, [*common, f"seed={seed}", f"output_dir={args.output}/seed{seed}"])
        start = time.perf_counter()
        result = train(cfg)
        print(f"seed {seed}: {result.steps} steps in {(time.perf_counter() - start) / 60:.1f} min -> {result.model_dir}")
        model_dirs.append(result.model_dir)
    test = prepare(cfg.data, cfg.tokenizer, splits=("test",)).splits["test"]
    systems = {f"seed {s}": [d] for s, d in zip(args.seeds, model_dirs)}
    systems[f"ensemble of {len(model_dirs)}"] = model_dirs
    print(f"\n{'system':<16}{'BLEU':>8}{'chrF':>8}{'decode s':>10}   ({len(test['src'])} test sentences, beam {args.beam})")
    for name, dirs in systems.items():
        translator = Translator.from_pretrained(dirs if len(dirs) > 1 else dirs[0])
        start = time.perf_counter()
        hyps = translator.translate(test["src"], beam_size=args.beam)
        seconds = time.perf_counter() - start
        scores = corpus_scores(hyps, test["tgt"])
        print(f"{name:<16}{scores['bleu']:>8.2f}{scores['chrf']:>8.2f}{seconds:>10.1f}")
    print(f"BLEU signature: {scores['bleu_signature']}")


if __name__ == "__main__":
    main()
