"""Translations gone wrong in a way a reader sees at once, found and decoded again: output in another language than
the one asked for (a multilingual model's commonest fault), and loops ("I'm sorry, but I'm sorry, but ...").

`Translator.translate(..., guard=True)` checks each translation; a flagged one is searched for again with the
fallback (`Guard`: a wider beam whose n-best list is read best first, and no n-gram twice where it looped), and
the first candidate that passes both checks replaces it. What no candidate mends keeps its first translation and
says why it is doubtful (`Guard.doubt`, `Translation.doubt`: "off-target: en", "loop"). Sentences that pass are not
decoded again, so their translations are exactly those without the guard.

The checks:
- **Loop**: a run of 1 to `MAX_SPAN` words said back to back at least 3 times (4 for a single word), or a run of 1
  to 4 characters 6 times (a subword loop inside a word), more times than any run of the source: "ha ha ha ha"
  translated as itself is not a loop. Text without spaces (Chinese, Japanese) is read character by character.
- **Off target**: the translation's language, told by `nmt.language.detect` among the model's own languages (so
  that it chooses between the languages the model can write), is another than the one asked for, with probability
  at least `OFF_TARGET_CONFIDENCE`, on a translation of at least `MIN_LETTERS` letters (shorter ones are too short to
  tell). Only where the model names its languages (a multilingual model's or an imported M2M100/NLLB's
  languages.json) and the identifier knows the target.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

MAX_SPAN = 8  # the longest run of words a loop is looked for in
MIN_LETTERS = 20  # a translation with fewer letters is too short to tell its language
OFF_TARGET_CONFIDENCE = 0.9  # the identifier's probability for another language than the target
PUNCTUATION = string.punctuation + "«»‹›“”„‘’‚…¡¿、。，！？：；"


@dataclass(frozen=True)
class Guard:
    """What `Translator.translate(..., guard=...)` checks and how it decodes a flagged sentence again."""

    languages: bool = True  # check the translation's language (where the model names its languages)
    loops: bool = True  # check for loops
    beam_factor: int = 2  # the fallback's beam: this many times the call's own, all of its hypotheses read
    no_repeat_ngram_size: int = 3  # the fallback of a loop never says an n-gram of this many tokens twice (0: off)
    pivot: bool = True  # a translation still off target goes through a pivot language, where the model has one

    def doubt(self, translation: str, source: str, target: str | None, among: list[str]) -> str:
        """Why `translation` of `source` is doubtful ("off-target: en", "loop"), or "" when it passes; `target` and
        `among` as `Translator.guard_languages` gives them (None: no language check)."""
        if self.languages and target is not None:
            other = off_target(translation, target, among)
            if other is not None:
                return f"off-target: {other}"
        if self.loops and loops(translation, source):
            return "loop"
        return ""


def _units(text: str) -> list[str]:
    """The words of `text` as a loop repeats them (case and the punctuation around them aside: "Yes, yes, yes"),
    or its characters where it has no spaces."""
    words = text.split()
    if len(words) <= 1 and len(text) > 1:
        return list("".join(words))
    return [w.lower().strip(PUNCTUATION) or w for w in words]


def most_repeats(units: list[str], spans: int = MAX_SPAN) -> int:
    """The most times a run of 1 to `spans` units follows itself back to back in `units` (1: none does)."""
    most = 1
    for span in range(1, spans + 1):
        i = 0
        while i + 2 * span <= len(units):
            times = 1
            while units[i + times * span: i + (times + 1) * span] == units[i: i + span]:
                times += 1
            most = max(most, times if times >= (4 if span == 1 else 3) else 1)
            i += (times - 1) * span if times > 1 else 1  # a run's rotations repeat no more often than it does
    return most


def loops(translation: str, source: str) -> bool:
    """Whether `translation` says a run of words over and over (3 times, a single word 4 times), or a run of 1 to
    4 characters 6 times within its words ("TTTTTT", "lalalalalala"), more often than `source` does."""
    if most_repeats(_units(translation)) > most_repeats(_units(source)):
        return True
    glued = [c for c in translation if not c.isspace()]
    times = most_repeats(glued, spans=4)
    return times >= 6 and times > most_repeats([c for c in source if not c.isspace()], spans=4)


def language_of(text: str, among: list[str]) -> str | None:
    """The language of `text` among the codes of `among` where the identifier is sure of it (as `off_target`
    tells); None when the text is too short or mixed to tell."""
    from nmt.language import TooShort, detect

    if sum(c.isalpha() for c in text) < MIN_LETTERS or not among:
        return None
    try:
        language, p = detect(text, among=sorted(set(among)), top=1)[0]
    except TooShort:
        return None
    return language if p >= OFF_TARGET_CONFIDENCE else None


def off_target(translation: str, target: str, among: list[str]) -> str | None:
    """The language `translation` is in when it is confidently not `target` (a code the identifier knows), told
    among the codes of `among`; None when it is the target, or too short or mixed to tell."""
    from nmt.language import TooShort, base, detect, knows

    if sum(c.isalpha() for c in translation) < MIN_LETTERS or not knows(target):
        return None  # too short to tell, or a language the identifier cannot tell (it would name another)
    try:
        language, p = detect(translation, among=sorted({*among, target}), top=1)[0]
    except TooShort:
        return None
    return language if base(language) != base(target) and p >= OFF_TARGET_CONFIDENCE else None
