"""Are tags kept? Real test sentences with tags put around some of their words, translated with
`nmt translate --format html` (and xml), checked against the plain translation of the same sentences.

    python benchmarks/markup.py --data ../shared/data/tatoeba-en-de --model runs/mine/model --sentences 500

N sentences of two words or more, taken at even steps through the test file, each get, by a seeded draw, one to
three elements around runs of its words (some nested, some with attributes), a void element (<br>, <img>) and `&`
written as `&amp;`. Prints the three translate commands (plain, html, xml) and their times, then per format: how
many outputs parse (html.parser with every non-void element closed in order; xml.etree for xml), how many hold
exactly the source's elements with their attributes in the same nesting (siblings in any order: they follow their
words), and how many have, outside the tags, the plain translation's text.
"""

from __future__ import annotations

import argparse
import html
import os
import random
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VOID = {"br", "img", "hr"}


def tagged(sentence: str, rng: random.Random, format: str) -> str:
    """`sentence` with elements around runs of its words, a void element, and its text escaped."""
    words = [html.escape(w, quote=False) for w in sentence.split()]
    opens, closes = [""] * len(words), [""] * len(words)
    for k in range(rng.randint(1, min(3, len(words)))):
        a = rng.randrange(len(words))
        z = min(len(words) - 1, a + rng.randint(0, 2))
        name, attrs = rng.choice([("b", ""), ("i", ""), ("em", ' class="x"'), ("a", f' href="/p?q={k}&amp;r=1"'),
                                  ("span", f' id="s{k}"')])
        if any(opens[a + 1: z + 1]) or any(closes[a: z]):
            continue  # keep it well formed: no element may start or end inside this one
        opens[a] += f"<{name}{attrs}>"
        closes[z] = f"</{name}>" + closes[z]
    void = rng.choice(["<br/>", '<img src="i.png" alt="x"/>']) if format == "xml" else rng.choice(
        ["<br>", '<img src="i.png" alt="x">'])
    spot = rng.randrange(len(words))
    words[spot] += void
    return " ".join(o + w + c for o, w, c in zip(opens, words, closes))


class _Tree(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.text, self.ok = [("", (), [])], [], True

    def handle_starttag(self, tag, attrs):
        node = (tag, tuple(attrs), [])
        self.stack[-1][2].append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1][2].append((tag, tuple(attrs), []))

    def handle_endtag(self, tag):
        if self.stack[-1][0] != tag:
            self.ok = False
        elif len(self.stack) > 1:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def tree(markup: str, format: str) -> tuple[list, str] | None:
    """(elements with siblings sorted, text) of well-formed markup; None where it is not."""
    def unordered(nodes):
        return sorted((t, a, unordered(c)) for t, a, c in nodes)

    if format == "xml":
        try:
            root = ET.fromstring(f"<root>{markup}</root>")
        except ET.ParseError:
            return None

        def node(e):
            return (e.tag, tuple(sorted(e.attrib.items())), [node(c) for c in e])

        return unordered([node(c) for c in root]), "".join(root.itertext())
    parser = _Tree()
    parser.feed(markup)
    parser.close()
    if not parser.ok or len(parser.stack) != 1:
        return None
    return unordered([(t, tuple(sorted(a)), c) for t, a, c in parser.stack[0][2]]), "".join(parser.text)


def translate(model: str, src: Path, out: Path, beam: int, *flags: str) -> float:
    nmt = Path(sys.executable).with_name("nmt")
    argv = [str(nmt) if nmt.is_file() else "nmt", "translate", model, "--input", str(src), "--output", str(out),
            "--beam", str(beam), *flags]
    print("$ " + " ".join(["nmt", *argv[1:]]), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        sys.exit(f"nmt translate failed ({proc.returncode})")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a folder with test.<src> (one sentence a line)")
    ap.add_argument("--src", default="en", help="the source language's suffix")
    ap.add_argument("--model", required=True, help="a model directory")
    ap.add_argument("--sentences", type=int, default=500, help="N test sentences of two words or more, spread evenly "
                    "over the file")
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="runs/markup", help="a folder for the inputs and outputs")
    args = ap.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    lines = (Path(args.data) / f"test.{args.src}").read_text(encoding="utf-8").splitlines()
    eligible = [s.strip() for s in lines if len(s.split()) >= 2]
    plain = eligible[:: max(1, len(eligible) // args.sentences)][: args.sentences]  # spread over the file
    (out / "plain.txt").write_text("\n".join(plain) + "\n", encoding="utf-8")
    seconds = {"text": translate(args.model, out / "plain.txt", out / "plain.out", args.beam)}
    expected = (out / "plain.out").read_text(encoding="utf-8").splitlines()
    results = {}
    for format in ("html", "xml"):
        rng = random.Random(args.seed)
        sources = [tagged(s, rng, format) for s in plain]
        (out / f"tagged.{format}").write_text("\n".join(sources) + "\n", encoding="utf-8")
        seconds[format] = translate(args.model, out / f"tagged.{format}", out / f"out.{format}", args.beam,
                                    "--format", format)
        got = (out / f"out.{format}").read_text(encoding="utf-8").splitlines()
        parsed = [tree(g, format) for g in got]
        wanted = [tree(s, format) for s in sources]
        results[format] = (sum(p is not None for p in parsed),
                           sum(p is not None and p[0] == w[0] for p, w in zip(parsed, wanted)),
                           sum(p is not None and p[1] == e for p, e in zip(parsed, expected)))
    print(f"{len(plain)} sentences of {Path(args.data) / f'test.{args.src}'}, beam {args.beam}; translate took "
          + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
    for format, (ok, tags, text) in results.items():
        print(f"  {format}: parse {ok}/{len(plain)}, same tags and nesting {tags}/{len(plain)}, text as the plain "
              f"translation {text}/{len(plain)}")


if __name__ == "__main__":
    main()
