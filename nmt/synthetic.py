"""Built-in parallel corpus for the quickstart: English sentences from a small grammar with their
translation into Tirelan (code "xx": no ISO 639 language has it), an invented SOV language.
Pure standard library and deterministic: no network, no data copied from anywhere."""

from __future__ import annotations

import argparse
import functools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

SRC_LANG = "en"
TGT_LANG = "xx"

# Tirelan in brief. Clause: [time] subject [adverb] [postposition phrase] [object ko] [mu = not]
# [lu = future] verb [ba = past] [ka = question]; wh-words stay in place. Noun phrase: noun,
# adjectives (mirrored), number, determiner, [ri + relative clause]: "the big dogs" is
# "zabiri zaltunai sa". Verbs agree with the subject (-m, -s, -, -mo, -n for I, you, he/she/it, we,
# they); animate nouns pluralise with -ri, inanimate ones with -n; adjectives agree with the noun's
# class and number (-a, -ai animate; -o, -on inanimate) and become adverbs with -u.

# ----------------------------------------------------------------------------------------------
# English lexicon. Kinds: P person, A animal, T thing, F food, L place; P and A are animate.
# Words whose past equals their base (read, put, cut) or whose plural equals the singular (fish,
# sheep) are left out on purpose: they would give one English sentence two translations.
# ----------------------------------------------------------------------------------------------

NOUNS = {  # "singular/irregular plural" where the plural is irregular
    "P": "man/men woman/women child/children boy girl friend teacher doctor farmer king queen "
    "soldier student baker singer driver",
    "A": "dog cat horse bird cow pig duck rabbit lion bear monkey goat frog snake",
    "T": "book letter box bag ball key cup chair table door window picture hat coat shoe bottle "
    "lamp clock knife/knives basket",
    "F": "apple cake egg banana potato/potatoes sandwich cookie orange pie carrot",
    "L": "house garden city village river forest school market park room kitchen church farm "
    "bridge tree",
}

ADJECTIVES = (  # adjective:kinds it can describe; a trailing "+" means it has a -ly adverb
    "big:PATFL small:PATFL old:PATL new:TL young:PA good:PATFL bad:PATF happy:PA+ sad:PA+ "
    "angry:PA+ hungry:PA tired:PA kind:P brave:PA+ quiet:PAL+ loud:PA+ quick:PA+ slow:PA+ "
    "careful:P+ clever:PA beautiful:PATL ugly:ATL heavy:TF empty:TL dirty:PATL red:ATF "
    "green:TF blue:T white:ATL black:AT yellow:TF warm:FL cold:FL sweet:F fresh:F long:TL "
    "strong:PA rich:P poor:P busy:PL famous:PL dark:L wide:L"
)

# (verb[/irregular past], object kinds, subject kinds); empty object kinds = intransitive.
VERBS = [
    ("see/saw", "PATFL", "PA"), ("watch", "PAT", "PA"), ("like", "PATFL", "PA"),
    ("love", "PAL", "P"), ("hate", "PATF", "P"), ("want", "TF", "PA"), ("need", "TF", "P"),
    ("find/found", "PAT", "PA"), ("lose/lost", "T", "P"), ("help", "PA", "P"),
    ("call", "PA", "P"), ("follow", "PA", "PA"), ("meet/met", "P", "P"), ("visit", "PL", "P"),
    ("know/knew", "PL", "P"), ("remember", "PTL", "P"), ("forget/forgot", "PT", "P"),
    ("hear/heard", "PA", "PA"), ("eat/ate", "F", "PA"), ("cook", "F", "P"),
    ("buy/bought", "TF", "P"), ("sell/sold", "TF", "P"), ("bring/brought", "TF", "P"),
    ("take/took", "TF", "P"), ("carry", "TF", "PA"), ("hold/held", "TFA", "P"),
    ("open", "T", "P"), ("close", "T", "P"), ("wash", "TA", "P"), ("paint", "TL", "P"),
    ("break/broke", "T", "PA"), ("build/built", "L", "P"), ("make/made", "TF", "P"),
    ("clean", "TL", "P"), ("draw/drew", "PATL", "P"), ("chase", "PA", "PA"),
    ("catch/caught", "AT", "PA"), ("kick", "TA", "PA"), ("leave/left", "L", "PA"),
    ("sleep/slept", "", "PA"), ("run/ran", "", "PA"), ("walk", "", "PA"), ("swim/swam", "", "PA"),
    ("sing/sang", "", "PA"), ("dance", "", "P"), ("laugh", "", "P"), ("cry", "", "P"),
    ("wait", "", "PA"), ("work", "", "P"), ("play", "", "PA"), ("sit/sat", "", "PA"),
    ("fall/fell", "", "PA"), ("smile", "", "P"), ("jump", "", "PA"), ("rest", "", "PA"),
    ("shout", "", "P"), ("arrive", "", "P"), ("hide/hid", "", "PA"),
]

PREPOSITIONS = "in:L on:T under:T near:PATL behind:PATL with:PA"  # preposition:kinds of its object
NUMBERS = "two three four five six seven eight nine ten"
FREQUENCY_ADVERBS = "often always sometimes"
TIME_ADVERBS = {"present": "today now", "past": "yesterday", "future": "tomorrow soon"}

# ----------------------------------------------------------------------------------------------
# Tirelan: hand-picked function words and suffixes; content words are coined below.
# ----------------------------------------------------------------------------------------------

PARTICLES = {
    "the": "sa", "this": "ve", "some": "pel", "many": "duro", "acc": "ko", "not": "mu",
    "will": "lu", "past": "ba", "question": "ka", "rel": "ri", "np_and": "ila", "and": "ome",
    "but": "sedi", "who": "kimo", "what": "kesa",
}
VERB_AGREEMENT = {"1sg": "m", "2sg": "s", "3sg": "", "1pl": "mo", "3pl": "n"}
NOUN_PLURAL = {True: "ri", False: "n"}  # keyed by animacy
ADJ_AGREEMENT = {(True, False): "a", (True, True): "ai", (False, False): "o", (False, True): "on"}
ADVERB_SUFFIX = "u"


@dataclass(frozen=True)
class Pronoun:
    subj: str
    obj: str
    poss: str | None
    word: str  # Tirelan; its possessive adds -n
    agr: str
    kinds: str


PRONOUNS = [
    Pronoun("I", "me", "my", "ano", "1sg", "P"), Pronoun("you", "you", "your", "teru", "2sg", "P"),
    Pronoun("he", "him", "his", "olo", "3sg", "P"), Pronoun("she", "her", "her", "ima", "3sg", "P"),
    Pronoun("it", "it", None, "eto", "3sg", "AT"), Pronoun("we", "us", "our", "amu", "1pl", "P"),
    Pronoun("they", "them", "their", "ise", "3pl", "PAT"),
]


@dataclass(frozen=True)
class Noun:
    sg: str
    pl: str
    kind: str
    stem: str  # Tirelan stem

    @property
    def animate(self) -> bool:
        return self.kind in "PA"


@dataclass(frozen=True)
class Verb:
    base: str
    s3: str
    past: str
    obj_kinds: str
    subj_kinds: str
    stem: str


@dataclass(frozen=True)
class Word:
    """An invariant word or an adjective: English form, kinds it goes with, Tirelan form/stem."""

    en: str
    kinds: str
    stem: str
    adverb: str | None = None  # English -ly adverb of an adjective


# ----------------------------------------------------------------------------------------------
# English morphology
# ----------------------------------------------------------------------------------------------


def _add_s(word: str) -> str:
    """Plural of a noun or 3rd-person singular of a verb."""
    if word.endswith(("s", "sh", "ch", "x", "o")):
        return word + "es"
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def _add_ed(word: str) -> str:
    if word.endswith("e"):
        return word + "d"
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ied"
    return word + "ed"


def _add_ly(word: str) -> str:
    return word[:-1] + "ily" if word.endswith("y") else word + "ly"


# ----------------------------------------------------------------------------------------------
# Coining Tirelan words: fixed seed, syllables from a small inventory, no two forms alike.
# ----------------------------------------------------------------------------------------------

LEXICON_SEED = 1729
# Real words (brands, English loans) that coining happened to produce while the seed was chosen.
_LOOKALIKES = {"subaru", "ziti", "memo", "kola", "dorsal", "miso", "pasta", "sofa"}
_ONSETS = "p t k d g m n l r s v h b z".split()
_VOWELS = "aaeiioouu"  # weighted: a, i, o, u are commoner than e
_CODAS = "nrl"
_FINALS = "nlrsk"  # adjective stems end in one of these so that the agreement vowel attaches


def _coin(rng: random.Random, ends_in_vowel: bool, taken: set[str], suffixes: list[str]) -> str:
    """A new stem whose inflected forms (stem + each suffix) clash with nothing already taken."""
    while True:
        n_syllables = rng.choice((2, 2, 2, 3))
        parts = []
        for i in range(n_syllables):
            coda = rng.choice(_CODAS) if i < n_syllables - 1 and rng.random() < 0.2 else ""
            parts.append(rng.choice(_ONSETS) + rng.choice(_VOWELS) + coda)
        stem = "".join(parts)
        if ends_in_vowel and stem.endswith("e"):
            continue  # final -e reads as English silent e (mole, dine): avoid look-alikes
        stem = stem if ends_in_vowel else stem + rng.choice(_FINALS)
        forms = {stem + s for s in suffixes}
        if not forms & taken:
            taken |= forms
            return stem


@dataclass(frozen=True)
class Lexicon:
    nouns: dict[str, list[Noun]]  # by kind
    verbs: list[Verb]
    adjectives: list[Word]
    prepositions: list[Word]
    numbers: list[Word]
    frequency: list[Word]
    time: dict[str, list[Word]]
    copula: str


def _english_words() -> set[str]:
    """Every English word the grammar can emit, so that no coined word is an English one."""
    words = {w.split(":")[0] for w in ADJECTIVES.split() + PREPOSITIONS.split()}
    words |= {_add_ly(w) for w in words} | set(NUMBERS.split()) | set(FREQUENCY_ADVERBS.split())
    for entry in " ".join(NOUNS.values()).split() + [v for v, _, _ in VERBS]:
        base, _, irregular = entry.partition("/")
        words |= {base, irregular, _add_s(base), _add_ed(base)}
    for p in PRONOUNS:
        words |= {p.subj.lower(), p.obj, p.poss or ""}
    words |= set(" ".join(TIME_ADVERBS.values()).split())
    return words | set("the a an this these some many not do does did will am is are was were be "
                       "and but who that what".split())


def _coin_nouns(rng: random.Random, taken: set[str]) -> dict[str, list[Noun]]:
    nouns: dict[str, list[Noun]] = {}
    for kind, entries in NOUNS.items():
        plural = NOUN_PLURAL[kind in "PA"]
        for entry in entries.split():
            sg, _, pl = entry.partition("/")
            stem = _coin(rng, True, taken, ["", plural])
            nouns.setdefault(kind, []).append(Noun(sg, pl or _add_s(sg), kind, stem))
    return nouns


def _coin_verbs(rng: random.Random, taken: set[str]) -> list[Verb]:
    verbs = []
    for entry, obj_kinds, subj_kinds in VERBS:
        base, _, past = entry.partition("/")
        stem = _coin(rng, True, taken, list(VERB_AGREEMENT.values()))
        verbs.append(Verb(base, _add_s(base), past or _add_ed(base), obj_kinds, subj_kinds, stem))
    return verbs


def _coin_adjectives(rng: random.Random, taken: set[str]) -> list[Word]:
    adjectives = []
    for entry in ADJECTIVES.split():
        word, _, kinds = entry.partition(":")
        adverb = _add_ly(word) if kinds.endswith("+") else None
        stem = _coin(rng, False, taken, list(ADJ_AGREEMENT.values()) + [ADVERB_SUFFIX])
        adjectives.append(Word(word, kinds.rstrip("+"), stem, adverb))
    return adjectives


def _coin_invariant(rng: random.Random, taken: set[str], spec: str) -> list[Word]:
    """Words without inflection; `spec` is "word" or "word:kinds" items."""
    pairs = [e.partition(":") for e in spec.split()]
    return [Word(w, kinds, _coin(rng, True, taken, [""])) for w, _, kinds in pairs]


def _build_lexicon() -> Lexicon:
    """Coin every Tirelan stem in a fixed order from a fixed seed, so the language never changes."""
    rng = random.Random(LEXICON_SEED)
    taken = _english_words() | set(PARTICLES.values()) | _LOOKALIKES
    taken |= {p.word for p in PRONOUNS} | {p.word + "n" for p in PRONOUNS}
    copula = _coin(rng, True, taken, list(VERB_AGREEMENT.values()))
    nouns, verbs = _coin_nouns(rng, taken), _coin_verbs(rng, taken)
    adjectives = _coin_adjectives(rng, taken)
    prepositions = _coin_invariant(rng, taken, PREPOSITIONS)
    numbers = _coin_invariant(rng, taken, NUMBERS)
    frequency = _coin_invariant(rng, taken, FREQUENCY_ADVERBS)
    time = {tense: _coin_invariant(rng, taken, words) for tense, words in TIME_ADVERBS.items()}
    return Lexicon(nouns, verbs, adjectives, prepositions, numbers, frequency, time, copula)


LEXICON = _build_lexicon()

# ----------------------------------------------------------------------------------------------
# Abstract syntax: one structure, rendered once per language.
# ----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class NP:
    noun: Noun | None = None
    plural: bool = False
    det: str = "the"  # the, a, bare, this, some, many, a number word, or "poss"
    adjs: tuple[Word, ...] = ()
    number: Word | None = None
    pron: Pronoun | None = None  # a pronoun NP, or the owner when det == "poss"
    rel: Clause | None = None  # subject relative clause ("who/that ...")
    coord: NP | None = None  # "X and Y"

    @property
    def agr(self) -> str:
        if self.pron is not None and self.noun is None:
            return self.pron.agr
        return "3pl" if self.plural or self.coord else "3sg"

    @property
    def animate(self) -> bool:
        # "it" and "they" count as animate whatever they stand for: English does not say, and each
        # English sentence must have exactly one translation.
        return self.noun.animate if self.noun else self.pron.kinds != "T"


@dataclass(slots=True)
class Clause:
    subj: NP  # in "who" questions and relative clauses only its agreement and kind are used
    verb: Verb | None  # None: copula
    obj: NP | None = None  # None with a transitive verb: "what" question
    pred: Word | None = None  # copula + adjective
    pp: tuple[Word, NP] | None = None
    tense: str = "present"
    neg: bool = False
    adv: Word | None = None  # manner adverb (an adjective with .adverb) or frequency adverb
    time: Word | None = None
    mood: str = "decl"  # decl, yn (yes/no question), who, what, rel (relative clause)

    @property
    def agr(self) -> str:
        return self.subj.agr


# ----------------------------------------------------------------------------------------------
# Rendering English
# ----------------------------------------------------------------------------------------------

_BE = {"present": {"1sg": "am", "3sg": "is"}, "past": {"1sg": "was", "3sg": "was"}}


def _en_np(np: NP, case: str = "subj") -> list[str]:
    if np.noun is None:
        return [np.pron.subj if case == "subj" else np.pron.obj]
    words = [w.en for w in np.adjs] + [np.noun.pl if np.plural else np.noun.sg]
    if np.det == "a":
        words.insert(0, "an" if words[0][0] in "aeiou" else "a")
    elif np.det == "poss":
        words.insert(0, np.pron.poss)
    elif np.det == "this":
        words.insert(0, "these" if np.plural else "this")
    elif np.det != "bare":
        words.insert(0, np.number.en if np.number else np.det)
    if np.rel:
        words += ["who" if np.noun.kind == "P" else "that"] + _en_clause(np.rel)
    if np.coord:
        words += ["and"] + _en_np(np.coord, case)
    return words


def _en_verb(c: Clause) -> tuple[list[str], list[str]]:
    """(auxiliaries, main verb words); the first auxiliary moves before the subject in questions."""
    agr, neg = c.agr, ["not"] if c.neg else []
    if c.verb is None:  # copula
        if c.tense == "future":
            return ["will"] + neg, ["be"]
        return [_BE[c.tense].get(agr, "are" if c.tense == "present" else "were")] + neg, []
    if c.tense == "future":
        return ["will"] + neg, [c.verb.base]
    if c.neg or c.mood in ("yn", "what"):  # do-support
        do = "did" if c.tense == "past" else "does" if agr == "3sg" else "do"
        return [do] + neg, [c.verb.base]
    if c.tense == "past":
        return [], [c.verb.past]
    return [], [c.verb.s3 if agr == "3sg" else c.verb.base]


def _en_clause(c: Clause) -> list[str]:
    aux, verb = _en_verb(c)
    if c.adv and not c.adv.adverb:  # frequency adverbs sit before the main verb: "will often see"
        verb = [c.adv.en] + verb
    rest = _en_np(c.obj, "obj") if c.obj else []
    rest += [c.pred.en] if c.pred else []
    rest += [c.pp[0].en] + _en_np(c.pp[1], "obj") if c.pp else []
    rest += [c.adv.adverb] if c.adv and c.adv.adverb else []
    rest += [c.time.en] if c.time else []
    if c.mood == "rel":
        subj = []  # the relative pronoun ("who", "that") before the clause stands for it
    else:
        subj = ["who"] if c.mood == "who" else _en_np(c.subj)
    if c.mood in ("yn", "what"):
        front = ["what"] if c.mood == "what" else []
        return front + aux[:1] + subj + aux[1:] + verb + rest
    return subj + aux + verb + rest


# ----------------------------------------------------------------------------------------------
# Rendering Tirelan
# ----------------------------------------------------------------------------------------------


def _xx_np(np: NP) -> list[str]:
    if np.noun is None:
        return [np.pron.word]
    animate = np.noun.animate
    words = [np.noun.stem + (NOUN_PLURAL[animate] if np.plural else "")]
    words += [a.stem + ADJ_AGREEMENT[animate, np.plural] for a in reversed(np.adjs)]  # mirrored
    if np.number:
        words.append(np.number.stem)
    elif np.det == "poss":
        words.append(np.pron.word + "n")
    elif np.det in ("the", "this", "some", "many"):  # "a" and bare plurals have no Tirelan word
        words.append(PARTICLES[np.det])
    if np.rel:
        words += [PARTICLES["rel"]] + _xx_clause(np.rel)
    if np.coord:
        words += [PARTICLES["np_and"]] + _xx_np(np.coord)
    return words


def _xx_verb(c: Clause) -> list[str]:
    stem = c.verb.stem if c.verb else LEXICON.copula
    words = [PARTICLES["not"]] if c.neg else []
    words += [PARTICLES["will"]] if c.tense == "future" else []
    words.append(stem + VERB_AGREEMENT[c.agr])
    return words + ([PARTICLES["past"]] if c.tense == "past" else [])


def _xx_clause(c: Clause) -> list[str]:
    words = [c.time.stem] if c.time else []
    if c.mood != "rel":
        words += [PARTICLES["who"]] if c.mood == "who" else _xx_np(c.subj)
    if c.adv:
        words.append(c.adv.stem + ADVERB_SUFFIX if c.adv.adverb else c.adv.stem)
    if c.pp:
        words += _xx_np(c.pp[1]) + [c.pp[0].stem]
    if c.obj or c.mood == "what":
        words += (_xx_np(c.obj) if c.obj else [PARTICLES["what"]]) + [PARTICLES["acc"]]
    if c.pred:
        words.append(c.pred.stem + ADJ_AGREEMENT[c.subj.animate, c.subj.agr == "3pl"])
    words += _xx_verb(c)
    return words + ([PARTICLES["question"]] if c.mood in ("yn", "who", "what") else [])


# ----------------------------------------------------------------------------------------------
# Random generation. Candidate lists are indexed once up front: filtering them per sentence was
# most of the generation time.
# ----------------------------------------------------------------------------------------------

_KINDS = "PATFL"
_ADJS_FOR = {k: [a for a in LEXICON.adjectives if k in a.kinds] for k in _KINDS}
_VERBS_FOR = {  # (transitive?, subject kind) -> verbs
    (t, k): [v for v in LEXICON.verbs if bool(v.obj_kinds) == t and k in v.subj_kinds]
    for t in (True, False) for k in _KINDS
}
_WHAT_VERBS = [v for v in LEXICON.verbs if set(v.obj_kinds) & set("TF")]
_MANNER = [a for a in LEXICON.adjectives if a.adverb]
_OWNERS = [p for p in PRONOUNS if p.poss]
_DETS = ["the"] * 7 + ["a"] * 4 + ["bare", "this", "poss", "poss", "poss", "some", "many", "number"]
_PLURAL_DETS = ("bare", "some", "many", "number")


def _weighted(rng: random.Random, table: tuple[tuple[str | int, float], ...]) -> str | int:
    """Pick from (value, probability) pairs; cheaper than rng.choices for these short tables."""
    r = rng.random()
    for value, p in table:
        if r < p:
            return value
        r -= p
    return table[-1][0]


def _pick(rng: random.Random, seq: Sequence[T]) -> T:
    """rng.choice without its overhead (it was the single biggest cost of generation)."""
    return seq[int(rng.random() * len(seq))]


@functools.cache
def _pronouns_for(kinds: str) -> list[Pronoun]:
    return [p for p in PRONOUNS if set(p.kinds) & set(kinds)]


def _pick_noun(rng: random.Random, kinds: str) -> Noun:
    return _pick(rng, LEXICON.nouns[_pick(rng, kinds)])


def _pick_tense(rng: random.Random) -> str:
    return _weighted(rng, (("present", 0.4), ("past", 0.35), ("future", 0.25)))


def _pick_adjectives(rng: random.Random, kind: str) -> tuple[Word, ...]:
    """No adjective (60%), one (30%) or two (10%; one if the same is drawn twice)."""
    r = rng.random()
    if r < 0.6:
        return ()
    first = _pick(rng, _ADJS_FOR[kind])
    second = _pick(rng, _ADJS_FOR[kind]) if r >= 0.9 else first
    return (first,) if second is first else (first, second)


def _make_np(rng: random.Random, kinds: str, allow_rel: bool = False) -> NP:
    noun, det = _pick_noun(rng, kinds), _pick(rng, _DETS)
    plural = det in _PLURAL_DETS or (det != "a" and rng.random() < 0.3)
    np = NP(noun, plural, det, _pick_adjectives(rng, noun.kind))
    if det == "number":
        np.number = _pick(rng, LEXICON.numbers)
    if det == "poss":
        np.pron = _pick(rng, _OWNERS)
    if allow_rel and noun.animate and rng.random() < 0.1:
        np.rel = _make_clause(rng, NP(noun, plural), nested=True)
        np.rel.tense, np.rel.mood = _pick(rng, ("present", "past")), "rel"
    return np


def _make_subject(rng: random.Random, kinds: str) -> NP:
    if rng.random() < 0.25:
        return NP(pron=_pick(rng, _pronouns_for(kinds)))
    np = _make_np(rng, kinds, allow_rel=True)
    if np.rel is None and np.noun.animate and rng.random() < 0.05:
        np.coord = _make_np(rng, "PA" if "A" in kinds else "P")
    return np


def _make_object(rng: random.Random, kinds: str, subj: NP, allow_rel: bool) -> NP:
    if rng.random() < 0.12:
        pronouns = _pronouns_for(kinds)
        if subj.noun is None:  # no "I see me": reflexives are not modelled
            pronouns = [p for p in pronouns if p.agr != subj.agr]
        if pronouns:
            return NP(pron=_pick(rng, pronouns))
    return _make_np(rng, kinds, allow_rel)


def _make_clause(rng: random.Random, subj: NP | None = None, nested: bool = False) -> Clause:
    """A clause about `subj` (or a new subject); `nested` makes a bare relative clause."""
    roll = rng.random()
    if roll < 0.15 and not nested:
        return _make_copula_clause(rng, subj)
    transitive = roll < 0.7
    kind = subj.noun.kind if subj else _pick(rng, "PPA")  # mostly verbs that people do
    verb = _pick(rng, _VERBS_FOR[transitive, kind])
    subj = subj or _make_subject(rng, verb.subj_kinds)
    obj = _make_object(rng, verb.obj_kinds, subj, not nested) if transitive else None
    clause = Clause(subj, verb, obj, tense=_pick_tense(rng))
    if not nested and not (obj and obj.rel):  # a PP after a relative clause would read ambiguously
        _decorate(rng, clause, pp_prob=0.2 if obj else 0.5)
    return clause


def _make_copula_clause(rng: random.Random, subj: NP | None) -> Clause:
    subj = subj or _make_subject(rng, _KINDS)
    kind = subj.noun.kind if subj.noun else _pick(rng, subj.pron.kinds)
    clause = Clause(subj, None, tense=_pick_tense(rng))
    if rng.random() < 0.7:
        clause.pred = _pick(rng, _ADJS_FOR[kind])  # "the dog is big"
    else:
        clause.pp = _make_pp(rng)  # "the dog is in the house"
    _decorate(rng, clause, pp_prob=0.0)
    return clause


def _make_pp(rng: random.Random) -> tuple[Word, NP]:
    prep = _pick(rng, LEXICON.prepositions)
    return prep, _make_np(rng, prep.kinds)


def _decorate(rng: random.Random, c: Clause, pp_prob: float) -> None:
    """Optional PP, adverb, time word and negation."""
    if rng.random() < pp_prob:
        c.pp = _make_pp(rng)
    if rng.random() < 0.15:
        c.adv = _pick(rng, LEXICON.frequency if c.verb is None or rng.random() < 0.4 else _MANNER)
    if rng.random() < 0.1:
        c.time = _pick(rng, LEXICON.time[c.tense])
    c.neg = rng.random() < 0.15 and not (c.adv and not c.adv.adverb)  # "does not often" is odd


def _make_question(rng: random.Random) -> Clause:
    mood = _weighted(rng, (("yn", 0.6), ("who", 0.2), ("what", 0.2)))
    if mood == "who":  # "who" stands for a singular person
        clause = _make_clause(rng, NP(_pick_noun(rng, "P")))
    elif mood == "what":  # "what" stands for a thing or food object
        verb = _pick(rng, _WHAT_VERBS)
        clause = Clause(_make_subject(rng, verb.subj_kinds), verb, tense=_pick_tense(rng))
        _decorate(rng, clause, pp_prob=0.2)
    else:
        clause = _make_clause(rng)
    clause.mood, clause.neg = mood, False
    return clause


def _make_sentence(rng: random.Random) -> tuple[list[str], list[str], str]:
    """(English words, Tirelan words, final punctuation)."""
    roll = rng.random()
    if roll < 0.2:
        c = _make_question(rng)
        return _en_clause(c), _xx_clause(c), "?"
    first = _make_clause(rng)
    if roll < 0.3:  # coordination of two clauses
        conj, second = _pick(rng, ("and", "but")), _make_clause(rng)
        en = _en_clause(first) + [conj] + _en_clause(second)
        return en, _xx_clause(first) + [PARTICLES[conj]] + _xx_clause(second), "."
    return _en_clause(first), _xx_clause(first), "."


def _finish(words: list[str], punct: str) -> str:
    text = " ".join(words)
    return text[0].upper() + text[1:] + punct


def _pairs(seed: int) -> Iterator[tuple[str, str]]:
    """Endless stream of (english, tirelan) pairs, 3 to 25 English words each."""
    rng = random.Random(seed)
    while True:
        en, xx, punct = _make_sentence(rng)
        if 3 <= len(en) <= 25:
            yield _finish(en, punct), _finish(xx, punct)


def generate_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n (english, invented) pairs, deterministic for a given seed; pure function."""
    stream = _pairs(seed)
    return [next(stream) for _ in range(n)]


def builtin_splits(
    n_train: int = 40000, n_valid: int = 1000, n_test: int = 1000, seed: int = 0
) -> dict[str, list[tuple[str, str]]]:
    """{"train": [...], "valid": [...], "test": [...]}: deterministic; no English sentence appears
    in two splits (dedupe across splits by source; within train, exact duplicates allowed but rare).
    """
    stream, held_out = _pairs(seed), set()
    splits: dict[str, list[tuple[str, str]]] = {"test": [], "valid": [], "train": []}
    # Test and valid are filled first, without duplicates; train then skips all their sources.
    for name, size in (("test", n_test), ("valid", n_valid), ("train", n_train)):
        while len(splits[name]) < size:
            pair = next(stream)
            if pair[0] not in held_out:
                splits[name].append(pair)
                if name != "train":
                    held_out.add(pair[0])
    return {name: splits[name] for name in ("train", "valid", "test")}


def main(argv: list[str] | None = None) -> None:
    """Write the built-in splits as OUT_DIR/{train,valid,test}.{en,xx}, one sentence per line."""
    parser = argparse.ArgumentParser(prog="python -m nmt.synthetic", description=__doc__)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, pairs in builtin_splits().items():
        for i, lang in enumerate((SRC_LANG, TGT_LANG)):
            text = "".join(pair[i] + "\n" for pair in pairs)
            (args.out_dir / f"{name}.{lang}").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
