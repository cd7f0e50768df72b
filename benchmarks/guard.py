"""The guard measured: a multilingual model's test sets translated with `nmt translate --scores` and with
`nmt translate --guard --scores`, in both directions.

    python benchmarks/guard.py --data ../shared/data/tatoeba-en-de --model runs/guard/both/model
    python benchmarks/guard.py --data ../shared/data/tatoeba-en-de --minutes 8 --output runs/guard
    python benchmarks/guard.py --data ../shared/data/tatoeba-en-de --also data/bible-en-fr --also-tgt fr --minutes 10

With --model, that model directory (one that translates src->tgt and tgt->src) is used; without, it is trained
first for --minutes with docs/multilingual.md's config (benchmarks/multilingual.py: the corpus read both ways).
With --also, a second corpus pairs --src with a third language (Bible en-fr: `benchmarks/bible_corpus.py`): the model
learns the four directions, and the two between the languages it never saw together (de->fr, fr->de: zero-shot,
where a many-language model answers in the wrong language most often) are measured too, without references.
Per direction and per setting it prints: the translations off target (told by nmt.guard's check, among the model's
languages) and looping (nmt.guard.loops), corpus BLEU/chrF, and BLEU/chrF of the sentences the guard did not flag
(untouched: the same with and without it), how many it flagged, mended and left doubtful, and the seconds each
command took. Then, through the Python API, the fallbacks side by side on the flagged sentences: the default (a
twice wider beam read best first, no 3-gram twice for a loop, then a pivot language for what is still in the wrong
language), the same without the pivot, the wider beam alone, and no-repeat alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from multilingual import multilingual_config  # noqa: E402
from quality import run_user_command  # noqa: E402

from nmt.guard import Guard, loops  # noqa: E402
from nmt.metrics import corpus_scores  # noqa: E402


def translate(model: Path, src: Path, tgt_lang: str, beam: int, out: Path, guard: bool) -> tuple[list, float]:
    """`nmt translate MODEL --input SRC --tgt-lang L --beam B --scores [--guard]` -> (rows of fields, seconds)."""
    nmt = Path(sys.executable).with_name("nmt")
    argv = [str(nmt) if nmt.is_file() else "nmt", "translate", str(model), "--input", str(src), "--output", str(out),
            "--tgt-lang", tgt_lang, "--beam", str(beam), "--scores", *(["--guard"] if guard else [])]
    print("$ " + " ".join(["nmt", *argv[1:]]), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"nmt translate failed with exit code {proc.returncode}")
    return [line.split("\t") for line in out.read_text(encoding="utf-8").split("\n")[:-1]], seconds


def direction(model: Path, data: Path, src: str, tgt: str, beam: int, out: Path, refs: bool = True) -> list[str]:
    """The table rows of one direction, and the fallbacks compared on its flagged sentences; without `refs` (a
    zero-shot direction: data's test.<src> asked in `tgt`), the rates only."""
    from nmt.translate import Translator

    sources = (data / f"test.{src}").read_text(encoding="utf-8").splitlines()
    refs = (data / f"test.{tgt}").read_text(encoding="utf-8").splitlines() if refs else None
    scores = (lambda texts, rows: corpus_scores(texts, [refs[i] for i in rows])) if refs else \
        (lambda texts, rows: {"bleu": float("nan"), "chrf": float("nan")})
    plain, t_plain = translate(model, data / f"test.{src}", tgt, beam, out / f"plain.{src}-{tgt}", guard=False)
    guarded, t_guard = translate(model, data / f"test.{src}", tgt, beam, out / f"guard.{src}-{tgt}", guard=True)
    translator = Translator.from_pretrained(model)
    target, among = translator.guard_languages(tgt)
    check = Guard()
    reasons = [check.doubt(row[0], s, target, among) for row, s in zip(plain, sources)]
    flagged = [i for i, r in enumerate(reasons) if r]
    untouched = [i for i, r in enumerate(reasons) if not r]
    assert all(guarded[i][0] == plain[i][0] for i in untouched), "a sentence the guard passed was changed"
    rows = []
    for name, outs, seconds in (("plain", plain, t_plain), ("--guard", guarded, t_guard)):
        texts = [row[0] for row in outs]
        off = sum(Guard(loops=False).doubt(t, s, target, among) != "" for t, s in zip(texts, sources))
        looped = sum(loops(t, s) for t, s in zip(texts, sources))
        every = scores(texts, range(len(texts)))
        kept = (f"{'-':>10} {'-':>10}" if not untouched else "{bleu:10.2f} {chrf:10.2f}".format(
            **scores([texts[i] for i in untouched], untouched)))  # none: all flagged
        rows.append(f"{src}-{tgt} {name:<8} {off / len(texts):9.2%} {looped / len(texts):9.2%} "
                    f"{every['bleu']:7.2f} {every['chrf']:7.2f} {kept} {seconds:8.1f}")
    doubtful = sum(1 for row in guarded if row[3])
    rows.append(f"{src}-{tgt}: {len(sources)} sentences, {len(flagged)} flagged "
                f"({sum(r.startswith('off-target') for r in reasons)} off target, {reasons.count('loop')} loops), "
                f"{len(flagged) - doubtful} mended, {doubtful} left doubtful")
    if flagged:  # the fallbacks side by side on the flagged sentences (Python API: Guard's settings)
        base = [plain[i][0] for i in flagged]
        first = scores(base, flagged)
        for name, fallback in (("default (+ pivot for the wrong language)", Guard()),
                               ("wider beam + no 3-gram twice, no pivot", Guard(pivot=False)),
                               ("wider beam alone", Guard(no_repeat_ngram_size=0, pivot=False)),
                               ("no 3-gram twice alone", Guard(beam_factor=1, pivot=False))):
            found = translator.translations([sources[i] for i in flagged], beam_size=beam, tgt_lang=tgt,
                                            confidence=False, guard=fallback)
            mended = sum(not f.doubt for f in found)
            then = scores([f.text for f in found], flagged)
            rows.append(f"  fallback {name:<40} mends {mended:4d} of {len(flagged)}; flagged sentences' BLEU "
                        f"{first['bleu']:.2f} -> {then['bleu']:.2f}, chrF {first['chrf']:.2f} -> {then['chrf']:.2f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train/valid/test.<src>/<tgt>")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--also", help="a second corpus folder pairing --src with --also-tgt (train/valid/test)")
    parser.add_argument("--also-tgt", default="fr", help="the second corpus's other language")
    parser.add_argument("--model", help="a model directory translating both ways (default: train one)")
    parser.add_argument("--minutes", type=float, default=8.0, help="without --model: the training budget")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--output", default="runs/guard")
    args = parser.parse_args()
    data, out = Path(args.data).resolve(), Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else None
    if model is None:
        config = out / "both.yaml"
        config.write_text(multilingual_config(data, args.src, args.tgt, *(
            [(Path(args.also).resolve(), args.src, args.also_tgt)] if args.also else [])))
        run_user_command(["nmt", "train", "--config", str(config), "--max_minutes", f"{args.minutes:g}",
                          "--output_dir", str(out / "both")])
        model = out / "both" / "model"
    rows = [f"{'':5} {'setting':<8} {'off target':>9} {'loops':>9} {'BLEU':>7} {'chrF':>7} {'untouched BLEU':>10} "
            f"{'chrF':>10} {'seconds':>8}"]
    for src, tgt in ((args.src, args.tgt), (args.tgt, args.src)):
        rows += direction(model, data, src, tgt, args.beam, out)
    if args.also:
        also, third = Path(args.also).resolve(), args.also_tgt
        for src, tgt in ((args.src, third), (third, args.src)):
            rows += direction(model, also, src, tgt, args.beam, out)
        rows += direction(model, data, args.tgt, third, args.beam, out, refs=False)  # zero-shot: never seen together
        rows += direction(model, also, third, args.tgt, args.beam, out, refs=False)
    print("\n".join(["", *rows]))


if __name__ == "__main__":
    main()
