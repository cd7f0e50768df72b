"""Does the confidence rank translations? A test set translated with `nmt translate --scores`, each sentence's chrF
against its reference, and the sentences cut into quarters by confidence: the lowest quarter should score clearly
below the highest.

    python benchmarks/confidence.py --data ../shared/data/tatoeba-en-de --model runs/mine/model
    python benchmarks/confidence.py --data ../shared/data/tatoeba-en-de --minutes 8 --output runs/confidence

With --model, that model directory is used; without, README's own-corpus `nmt train` command trains one on the
data folder (train/valid/test.<src>/<tgt>) for --minutes first. Prints the translate command, then per quarter
of confidence (lowest first): its sentences, mean confidence, mean sentence chrF (sacreBLEU's chrF, each sentence
alone) and corpus chrF; the Spearman correlation of confidence and sentence chrF over all sentences; and, as a
reference point, the same quarters cut by source length instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import sacrebleu

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from quality import run_user_command, user_command  # noqa: E402


def translate_with_scores(model: Path, src: Path, beam: int, out: Path) -> list[tuple[str, float, float]]:
    """`nmt translate MODEL --input SRC --scores` -> (translation, mean log-probability, confidence) per line."""
    nmt = Path(sys.executable).with_name("nmt")
    argv = [str(nmt) if nmt.is_file() else "nmt", "translate", str(model), "--input", str(src), "--output", str(out),
            "--beam", str(beam), "--scores"]
    print("$ " + " ".join(["nmt", *argv[1:]]), flush=True)
    proc = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    if proc.returncode != 0:
        raise SystemExit(f"nmt translate failed with exit code {proc.returncode}")
    rows = [line.split("\t") for line in out.read_text(encoding="utf-8").split("\n")[:-1]]
    return [(text, float(mean), float(conf)) for text, mean, conf in rows]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for value in np.unique(x):  # ties: their mean rank
            tied = x == value
            r[tied] = r[tied].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def quarters(key: np.ndarray, hyps: list[str], refs: list[str], chrf: np.ndarray, conf: np.ndarray) -> list[dict]:
    """The sentences in four quarters by `key` (lowest first; ties by input order): their figures."""
    order = np.argsort(key, kind="stable")
    out = []
    for q, rows in enumerate(np.array_split(order, 4), 1):
        corpus = sacrebleu.corpus_chrf([hyps[i] for i in rows], [[refs[i] for i in rows]]).score
        out.append({"quarter": q, "sentences": len(rows), "confidence": float(conf[rows].mean()),
                    "sentence_chrf": float(chrf[rows].mean()), "corpus_chrf": corpus})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with test.<src>/<tgt> (and train/valid to train)")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--model", help="a trained model directory; without it one is trained for --minutes")
    parser.add_argument("--minutes", type=float, default=8.0, help="the training budget when --model is not given")
    parser.add_argument("--output", default="runs/confidence", help="where the run and the translations go")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    data, output = Path(args.data), Path(args.output)
    if args.model:
        model = Path(args.model)
    else:
        run_user_command(user_command(data, args.src, args.tgt, args.minutes, output / "run"))
        model = output / "run" / "model"
    output.mkdir(parents=True, exist_ok=True)
    src_lines = (data / f"test.{args.src}").read_text(encoding="utf-8").splitlines()
    refs = (data / f"test.{args.tgt}").read_text(encoding="utf-8").splitlines()
    rows = translate_with_scores(model, data / f"test.{args.src}", args.beam, output / f"test.{args.tgt}.tsv")
    if not len(rows) == len(refs) == len(src_lines):
        raise SystemExit(f"{len(rows)} translations, {len(refs)} references and {len(src_lines)} sources")
    hyps = [text for text, _, _ in rows]
    conf = np.array([c for _, _, c in rows])
    chrf = np.array([sacrebleu.sentence_chrf(h, [r]).score for h, r in zip(hyps, refs)])
    by_conf = quarters(conf, hyps, refs, chrf, conf)
    by_length = quarters(-np.array([len(s.split()) for s in src_lines], dtype=float), hyps, refs, chrf, conf)
    rho = spearman(conf, chrf)
    print(f"\n{len(hyps)} sentences, beam {args.beam}; corpus chrF {sacrebleu.corpus_chrf(hyps, [refs]).score:.2f}")
    print("quarter by confidence (1: lowest)  sentences  mean confidence  mean sentence chrF  corpus chrF")
    for q in by_conf:
        print(f"  {q['quarter']:<32} {q['sentences']:>9}  {q['confidence']:>15.3f}  {q['sentence_chrf']:>18.2f}  "
              f"{q['corpus_chrf']:>11.2f}")
    gap = by_conf[-1]["sentence_chrf"] - by_conf[0]["sentence_chrf"]
    print(f"top quarter - bottom quarter: {gap:+.2f} sentence chrF")
    print(f"Spearman(confidence, sentence chrF): {rho:.3f}")
    print("reference: quarters by source length (1: longest)")
    for q in by_length:
        print(f"  {q['quarter']:<32} {q['sentences']:>9}  {q['confidence']:>15.3f}  {q['sentence_chrf']:>18.2f}  "
              f"{q['corpus_chrf']:>11.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(model), "beam": args.beam, "by_confidence": by_conf,
                                               "by_source_length": by_length, "spearman": rho}, indent=2))


if __name__ == "__main__":
    main()
