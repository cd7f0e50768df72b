"""Documents into sentences and back: the paragraphs of a text (`nmt translate --paragraphs`) and a rule-based
sentence splitter, with no model to download.

A paragraph is a run of non-blank lines; blank lines separate paragraphs and are kept as they are. A paragraph's
lines are joined with a space (a paragraph wrapped over several lines is one text) and split into sentences:

- after `.`, `!`, `?`, `…` (one or more, then any closing quotes or brackets) followed by white space and a
  character that can start a sentence: an upper-case letter, a digit, an opening quote or bracket, `¿` or `¡`, or
  a letter of a script without case (Arabic, Hebrew, Devanagari, ...);
- after the full stops of Chinese and Japanese (`。`, `！`, `？`, `．`), with or without white space after them;
- never after a known abbreviation (`Mr.`, `Dr.`, `e.g.`, `z.B.`, `usw.`, `Mme.`, ... see `ABBREVIATIONS`) or a
  single letter and a full stop (an initial: `J. R. R. Tolkien`).

It is the rule of Moses' split-sentences with its non-breaking prefixes, for the languages of Europe. Like that
rule, it reads a listed abbreviation as never ending a sentence, and an unlisted one before a capital as ending
one ("We met at 5 p.m. Then he left." is two sentences; "Dr. Smith left." is one).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Iterator

# words that end with a full stop without ending the sentence (lower-cased, without the stop): English, German,
# French, Spanish, Italian, Portuguese, Dutch titles and abbreviations, as Moses' non-breaking prefixes list them
ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st mt vs etc e.g i.e cf al approx dept est fig inc ltd co corp jan feb mar apr jun jul aug
sep sept oct nov dec no nos vol pp u.s u.k
z.b usw bzw ca nr hr fr frl dipl ing evtl ggf inkl vgl s.o s.u u.a d.h z.t bspw
m mme mlle mm me cie p.ex
sra srta ud uds pág
sig dott sig.ra
""".split())

# a run of end marks starts where no mark is before it, and is taken whole (possessive): on a run of n marks not
# followed by a space the search fails once, not n times with n backtracking steps each
_END = re.compile(r"""(?<![.!?…])([.!?…]++["'”’»)\]]*+)(\s+)(?=\S)""")
_CJK_END = re.compile(r"([。！？．][」』”’）]*)\s*(?=\S)")
_OPENERS = set("\"'“‘«„‚([{¿¡")


def split_sentences(text: str) -> list[str]:
    """The sentences of `text` (one paragraph), each stripped; none for blank text. See the module's rule."""
    text = " ".join(text.split())
    if not text:
        return []
    cuts = [m.end(1) for m in _CJK_END.finditer(text)]
    cuts += [m.end(1) for m in _END.finditer(text) if _breaks(text, m)]
    out, start = [], 0
    for cut in sorted(set(cuts)):
        piece = text[start:cut].strip()
        if piece:
            out.append(piece)
        start = cut
    rest = text[start:].strip()
    return out + [rest] if rest else out


def _breaks(text: str, m: re.Match) -> bool:
    """Whether the end punctuation `m` ends a sentence: what follows can start one, and a single full stop is not
    that of an abbreviation or an initial."""
    following = text[m.end():m.end() + 1]  # slices of a few characters: no copy of the text at each mark
    if not (following.isupper() or following.isdigit() or following in _OPENERS or _caseless_letter(following)):
        return False
    if m.group(1).rstrip("\"'”’»)]") != ".":
        return True  # ! ? … or several stops
    end = m.start() - (text[m.start() - 1:m.start()] == " ")  # the word before the stop (text: single spaces)
    word = text[text.rfind(" ", 0, end) + 1:end]
    word = word.lstrip("\"'“‘«„‚([{").lower()
    return not (word in ABBREVIATIONS or (len(word) == 1 and word.isalpha()))


def _caseless_letter(c: str) -> bool:
    return bool(c) and unicodedata.category(c) == "Lo"


def paragraphs(lines: Iterable[str]) -> Iterator[tuple[int, list[str] | None]]:
    """(number of the paragraph's first line, from 1; its sentences) for each paragraph of `lines`, and (line
    number, None) for each blank line, in order: what `nmt translate --paragraphs` translates and writes back."""
    block: list[str] = []
    first = 0
    for number, line in enumerate(lines, 1):
        if line.strip():
            if not block:
                first = number
            block.append(line)
            continue
        if block:
            yield first, split_sentences(" ".join(block))
            block = []
        yield number, None
    if block:
        yield first, split_sentences(" ".join(block))


def split_documents(texts: list[str]) -> tuple[list[list[list[int] | None]], list[str]]:
    """Documents into sentences: each text's paragraphs (`paragraphs` of its lines) as the numbers of their
    sentences in the list of all the texts' sentences (None: a blank line, kept), and that list. `join_documents`
    puts translations of those sentences back: what `Translator.translate_documents`, `nmt translate --paragraphs`
    and the server's documents share."""
    layout, sentences = [], []
    for text in texts:
        lines: list[list[int] | None] = []
        for _, found in paragraphs(text.splitlines()):
            if found is None:
                lines.append(None)
            else:
                lines.append(list(range(len(sentences), len(sentences) + len(found))))
                sentences.extend(found)
        layout.append(lines)
    return layout, sentences


def join_documents(layout: list[list[list[int] | None]], translations: list[str]) -> list[str]:
    """Each document of `layout` (`split_documents`) written back: a paragraph's translated sentences joined by a
    space on one line, a blank line for each blank line."""
    return ["\n".join("" if line is None else " ".join(translations[i] for i in line) for line in lines)
            for lines in layout]
