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

# ISO 639-1 -> the ISO 639-3 code NLLB names the language (or its standard variety) by
ISO639_3 = dict(pair.split(":") for pair in """af:afr ak:aka am:amh ar:arb as:asm ay:ayr az:azj ba:bak be:bel bg:bul
bm:bam bn:ben bo:bod bs:bos ca:cat cs:ces cy:cym da:dan de:deu dz:dzo ee:ewe el:ell en:eng eo:epo es:spa et:est eu:eus
fa:pes ff:fuv fi:fin fj:fij fo:fao fr:fra ga:gle gd:gla gl:glg gn:grn gu:guj ha:hau he:heb hi:hin hr:hrv ht:hat hu:hun
hy:hye id:ind ig:ibo is:isl it:ita ja:jpn jv:jav ka:kat kg:kon ki:kik kk:kaz km:khm kn:kan ko:kor kr:knc ks:kas ku:kmr
ky:kir lb:ltz lg:lug li:lim ln:lin lo:lao lt:lit lv:lvs mg:plt mi:mri mk:mkd ml:mal mn:khk mr:mar ms:zsm mt:mlt my:mya
nb:nob ne:npi nl:nld nn:nno no:nob ny:nya oc:oci om:gaz or:ory pa:pan pl:pol ps:pbt pt:por qu:quy rn:run ro:ron ru:rus
rw:kin sa:san sc:srd sd:snd sg:sag si:sin sk:slk sl:slv sm:smo sn:sna so:som sq:als sr:srp ss:ssw st:sot su:sun sv:swe
sw:swh ta:tam te:tel tg:tgk th:tha ti:tir tk:tuk tl:tgl tn:tsn tr:tur ts:tso tt:tat tw:twi ug:uig uk:ukr ur:urd uz:uzn
vi:vie wo:wol xh:xho yi:ydd yo:yor zh:zho zu:zul""".split())
# NLLB's ISO 639-3 code -> ISO 639-1, the identifier's (the first where two share one: nob is nb, not no)
ISO639_1 = {iso3: iso1 for iso1, iso3 in reversed(ISO639_3.items())}
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
    """`code` as the identifier names its language: "pt_BR" and "zh-Hans" as "pt" and "zh", an NLLB code by its ISO
    639-1 code ("deu_Latn" as "de")."""
    head = code.split("_")[0].split("-")[0]
    return ISO639_1.get(head, head)


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
        named: dict[str, str] = {}  # the identifier's code -> the caller's (the first of two alike: zho_Hans)
        for code in among or ():
            if knows(code):
                named.setdefault(base(code), code)
        identifier.set_languages(list(named) or None)
        try:
            ranked = identifier.rank(text)[:top]
        finally:
            identifier.set_languages(None)
    if not ranked or ranked[0][1] < MIN_CONFIDENCE:
        raise TooShort("the text is too short or mixed to tell its language: give its language")
    return [(named.get(code, code), float(p)) for code, p in ranked]
