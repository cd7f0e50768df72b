"""Which language a text is in: language identification for LibreTranslate's `source: auto` and `POST /detect`.

py3langid (a maintained fork of langid.py: a naive Bayes model over byte n-grams, 142 languages, 4.5 MB, BSD),
chosen by measurement among four libraries (docs/serving.md, benchmarks/language_id.py): the most accurate on
Tatoeba's short English and German sentences and on the first 20 characters of Bible verses in 22 languages, and
10 to 100 times faster than the others. Probabilities are normalised over the languages considered, so a
confidence is comparable between texts; a text with too few letters, or none the model knows, is "too short to
tell" (`TooShort`) rather than given a language at random.
"""

from __future__ import annotations

import threading

from nmt.errors import NmtError

MIN_LETTERS = 3  # fewer letters than this tell no language (a name, "ok", "12:30")
MIN_CONFIDENCE = 0.2  # a best guess below this is no answer: the text is too short or mixed to tell


class TooShort(NmtError):
    """The text is too short (or holds too few letters) to tell its language."""


_IDENTIFIER = None
_LANGUAGES: frozenset[str] | None = None
_LOCK = threading.Lock()  # the identifier is restricted to a set of languages per call: one call at a time


def _identifier():
    global _IDENTIFIER
    if _IDENTIFIER is None:
        try:
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
        except ModuleNotFoundError:
            raise NmtError("telling a text's language needs py3langid: pip install 'nmt[serve]' (or py3langid)") \
                from None
        _IDENTIFIER = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    return _IDENTIFIER


def base(code: str) -> str:
    return code.split("_")[0].split("-")[0]  # "pt_BR" and "zh-Hans" are told as "pt" and "zh"


def _languages() -> frozenset[str]:
    """The codes the identifier tells (read once)."""
    global _LANGUAGES
    if _LANGUAGES is None:
        _LANGUAGES = frozenset(_identifier().nb_classes)
    return _LANGUAGES


def knows(code: str) -> bool:
    """Whether the identifier can tell language `code` ("pt_BR" as "pt")."""
    return base(code) in _languages()


def detect(text: str, among: list[str] | None = None, top: int = 3) -> list[tuple[str, float]]:
    """The `top` most likely languages of `text` with their probabilities (0-1, best first), among the codes of
    `among` that the identifier knows (all it knows where none or no `among`). TooShort for a text of fewer than
    MIN_LETTERS letters, or whose best guess is below MIN_CONFIDENCE."""
    if sum(c.isalpha() for c in text) < MIN_LETTERS:
        raise TooShort("the text is too short to tell its language (fewer than 3 letters): give its language")
    identifier = _identifier()
    with _LOCK:
        named = {base(c): c for c in among or () if knows(c)}  # the identifier's code -> the caller's
        identifier.set_languages(list(named) or None)
        try:
            ranked = identifier.rank(text)[:top]
        finally:
            identifier.set_languages(None)
    if not ranked or ranked[0][1] < MIN_CONFIDENCE:
        raise TooShort("the text is too short or mixed to tell its language: give its language")
    return [(named.get(code, code), float(p)) for code, p in ranked]
