"""One model for both directions of a corpus against one model per direction, at the same total budget: the
multilingual model trains M minutes on src->tgt and tgt->src together (docs/multilingual.md's config, the corpus
read both ways, tagged), each single-direction model M/2 minutes with README's own-corpus command.

    python benchmarks/multilingual.py --data ../shared/data/tatoeba-en-de --minutes 50 [--output runs/multilingual]

The data folder holds train/valid/test.<src>/<tgt>. Prints each command, then test BLEU/chrF (cased, detokenized
sacreBLEU, 13a; beam 4) per direction for both setups, with their means.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from quality import run_user_command, user_command  # noqa: E402


def multilingual_config(data: Path, src: str, tgt: str, *more: tuple[Path, str, str]) -> str:
    """docs/multilingual.md's config for the corpus read both ways: one model, two directions (and two more for
    each further (folder, src, tgt) corpus)."""
    both = lambda split: "".join(f"    - {{path: {d}/{split}, src_lang: {a}, tgt_lang: {b}}}\n"
                                 f"    - {{path: {d}/{split}, src_lang: {b}, tgt_lang: {a}}}\n"
                                 for d, a, b in ((data, src, tgt), *more))
    return f"data:\n  train:\n{both('train')}  valid:\n{both('valid')}  test:\n{both('test')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train/valid/test.<src>/<tgt>")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--minutes", type=float, default=50.0, help="the total budget (wall clock) of each setup")
    parser.add_argument("--output", default="runs/multilingual")
    args = parser.parse_args()
    data, out, src, tgt = Path(args.data).resolve(), Path(args.output), args.src, args.tgt
    out.mkdir(parents=True, exist_ok=True)
    config = out / "both.yaml"
    config.write_text(multilingual_config(data, src, tgt))
    both = run_user_command(["nmt", "train", "--config", str(config), "--max_minutes", f"{args.minutes:g}",
                             "--output_dir", str(out / "both")])
    single = {f"{a}-{b}": run_user_command(user_command(data, a, b, args.minutes / 2, out / f"{a}-{b}"))
              for a, b in ((src, tgt), (tgt, src))}
    print(table(both, single, args.minutes))


def table(both: dict, single: dict[str, dict], minutes: float) -> str:
    """Test BLEU/chrF per direction: the two-direction model, the single-direction ones, and their means."""
    pairs = list(single)
    rows = [f"{'setup':<36}" + "".join(f"{p + ' BLEU':>13}{p + ' chrF':>13}" for p in pairs) + f"{'mean BLEU':>11}"
            f"{'mean chrF':>11}"]

    def row(name: str, scores: list[tuple[float, float]]) -> str:
        cells = "".join(f"{b:13.2f}{c:13.2f}" for b, c in scores)
        mean_b, mean_c = (sum(s[i] for s in scores) / len(scores) for i in (0, 1))
        return f"{name:<36}{cells}{mean_b:11.2f}{mean_c:11.2f}"

    rows.append(row(f"one model, both ({minutes:g} min)",
                    [(both["test"][f"bleu_{p}"], both["test"][f"chrf_{p}"]) for p in pairs]))
    rows.append(row(f"one model per direction ({minutes / 2:g} min each)",
                    [(single[p]["test"]["bleu"], single[p]["test"]["chrf"]) for p in pairs]))
    steps = f"steps: both {both['steps']}, " + ", ".join(f"{p} {single[p]['steps']}" for p in pairs)
    return "\n".join(["", *rows, steps])


if __name__ == "__main__":
    main()
