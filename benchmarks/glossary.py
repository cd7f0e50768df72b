"""Glossaries on a real test set: how often the terms are used, what it does to BLEU, and what it costs in speed.

    python benchmarks/glossary.py MODEL_DIR ../shared/data/tatoeba-en-de [--src en --tgt de] [--beam 4]

The glossary is built from the corpus itself, dictionary style, never by hand:

1. word pairs aligned by the Dice coefficient of the sentences they occur in over the train split (a source word
   of 4 letters or more seen in 5 sentences or more, its best target word, Dice >= 0.3);
2. of those, the pairs whose source word occurs in 2 test sources or more and whose target word is in the reference
   of 80% of them or more (the translation the references use consistently);
3. of those, the pairs that the model translating without a glossary uses in fewer than half of those sentences
   (where it chooses another word).

Then the test set is translated with and without the glossary. Printed: the glossary's size; on the sentences
where a term applies, the term use rate (a target term appears in the translation as a whole word, case as given)
and BLEU (sacreBLEU, as nmt evaluate) with and without; whether every other sentence is translated exactly as
without; and the speed (sentences per second, best of 5 interleaved runs each) on the sentences with terms, with and without.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

WORD = re.compile(r"\w+")


def read(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def aligned_pairs(src: list[str], tgt: list[str], min_count: int = 5, min_dice: float = 0.3) -> dict[str, str]:
    """source word -> its best target word by the Dice coefficient over sentences: 2 c(s, t) / (c(s) + c(t)). Source
    words lower-case (as they appear mid-sentence), target words in their most frequent spelling."""
    src_count, tgt_count, both = Counter(), Counter(), Counter()
    spelling: dict[str, Counter] = {}
    for s, t in zip(src, tgt):
        sw = {w for w in WORD.findall(s) if w.islower() and len(w) >= 4}
        tw = set()
        for w in WORD.findall(t):
            if len(w) >= 4:
                spelling.setdefault(w.lower(), Counter())[w] += 1
                tw.add(w.lower())
        src_count.update(sw)
        tgt_count.update(tw)
        both.update((a, b) for a in sw for b in tw)
    best: dict[str, tuple[float, str]] = {}
    for (a, b), n in both.items():
        if src_count[a] < min_count:
            continue
        dice = 2 * n / (src_count[a] + tgt_count[b])
        if dice >= min_dice and dice > best.get(a, (0.0, ""))[0]:
            best[a] = (dice, b)
    return {a: spelling[b].most_common(1)[0][0] for a, (_, b) in best.items()}


def has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text) is not None


def timed(fns: list, runs: int = 5) -> list[tuple[float, object]]:
    """Per function: (best seconds of `runs` calls, the last result), the calls interleaved so that a load on a
    shared machine falls on all of them alike."""
    best, out = [float("inf")] * len(fns), [None] * len(fns)
    for _ in range(runs):
        for k, fn in enumerate(fns):
            start = time.perf_counter()
            out[k] = fn()
            best[k] = min(best[k], time.perf_counter() - start)
    return list(zip(best, out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("data", help="a folder of train/test.<src>/<tgt> files")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)

    import torch

    from nmt import Translator
    from nmt.constraints import Glossary
    from nmt.metrics import corpus_scores

    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(args.data)
    train_src, train_tgt = read(data / f"train.{args.src}"), read(data / f"train.{args.tgt}")
    test_src, test_ref = read(data / f"test.{args.src}"), read(data / f"test.{args.tgt}")
    translator = Translator.from_pretrained(args.model_dir)
    opts = dict(beam_size=args.beam, batch_tokens=args.batch_tokens)
    plain = translator.translate(test_src, **opts)

    dictionary = aligned_pairs(train_src, train_tgt)
    chosen = []
    for s, t in sorted(dictionary.items()):
        rows = [i for i, text in enumerate(test_src) if has_word(text, s)]
        if len(rows) < 2 or sum(has_word(test_ref[i], t) for i in rows) < 0.8 * len(rows):
            continue
        if sum(has_word(plain[i], t) for i in rows) < 0.5 * len(rows):
            chosen.append((s, t))
    glossary = Glossary.from_pairs(chosen)
    applies = [glossary.targets_in(text) for text in test_src]
    with_terms = [i for i, ts in enumerate(applies) if ts]
    without_terms = [i for i, ts in enumerate(applies) if not ts]
    print(f"$ python benchmarks/glossary.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"dictionary: {len(dictionary)} aligned word pairs from {len(train_src)} train pairs; glossary: "
          f"{len(glossary)} pairs, e.g. {', '.join(f'{s} -> {t}' for s, t in chosen[:8])}")
    print(f"test sentences: {len(test_src)}, with a term: {len(with_terms)} "
          f"({sum(len(applies[i]) for i in with_terms)} terms), without: {len(without_terms)}")

    glossed = translator.translate(test_src, glossary=glossary, **opts)
    same = sum(glossed[i] == plain[i] for i in without_terms)
    print(f"sentences without a term translated exactly as without the glossary: {same} of {len(without_terms)}")

    def use_rate(hyps: list[str]) -> float:
        used = [has_word(hyps[i], t) for i in with_terms for t in applies[i]]
        return 100 * sum(used) / len(used)

    sub_src, sub_ref = [test_src[i] for i in with_terms], [test_ref[i] for i in with_terms]
    (t_plain, hyp_plain), (t_gloss, hyp_gloss) = timed([lambda: translator.translate(sub_src, **opts),
                                                         lambda: translator.translate(sub_src, glossary=glossary, **opts)])
    bleu_plain, bleu_gloss = corpus_scores(hyp_plain, sub_ref)["bleu"], corpus_scores(hyp_gloss, sub_ref)["bleu"]
    print(f"term use rate where a term applies: {use_rate(glossed):.1f}% with the glossary, {use_rate(plain):.1f}% "
          "without")
    print(f"BLEU on the {len(with_terms)} sentences with a term: {bleu_gloss:.2f} with, {bleu_plain:.2f} without "
          f"({bleu_gloss - bleu_plain:+.2f})")
    print(f"speed on them (beam {args.beam}, best of 5 interleaved runs): {len(sub_src) / t_gloss:.1f} sentences/s with, "
          f"{len(sub_src) / t_plain:.1f} without: {t_plain / t_gloss:.2f}x")
    print(f"torch threads: {torch.get_num_threads()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
