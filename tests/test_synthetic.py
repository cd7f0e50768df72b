"""The built-in synthetic corpus: deterministic, split cleanly, and worth learning (not a copy)."""

import re
import time
from collections import defaultdict

import pytest

from nmt import synthetic
from nmt.synthetic import builtin_splits, generate_pairs

FRAME = re.compile(r"^The (\w+) (\w+) the (\w+)\.$")  # "The dog sees the cat."
COPULA_FRAME = re.compile(r"^The (\w+) (is|are) (\w+)\.$")  # "The dog is big."


def words(sentence: str) -> list[str]:
    return sentence.lower().rstrip(".?").split()


@pytest.fixture(scope="module")
def splits() -> dict[str, list[tuple[str, str]]]:
    # The default corpus, timed here so the file builds it only once.
    start = time.process_time()
    result = builtin_splits()
    assert time.process_time() - start < 3.0
    return result


@pytest.fixture(scope="module")
def train(splits: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]]:
    return splits["train"]


def test_same_seed_same_pairs_and_other_seed_other_pairs() -> None:
    assert generate_pairs(500, seed=3) == generate_pairs(500, seed=3)
    assert generate_pairs(500, seed=3) != generate_pairs(500, seed=4)
    assert generate_pairs(200) == generate_pairs(500)[:200]  # a prefix of a longer run
    small = {"n_train": 300, "n_valid": 50, "n_test": 50}
    assert builtin_splits(**small) == builtin_splits(**small)
    assert builtin_splits(**small) != builtin_splits(**small, seed=1)


def test_split_sizes_and_no_source_in_two_splits(splits: dict) -> None:
    assert {name: len(pairs) for name, pairs in splits.items()} == {
        "train": 40000, "valid": 1000, "test": 1000,
    }
    sources = {name: {en for en, _ in pairs} for name, pairs in splits.items()}
    assert not sources["train"] & sources["valid"]
    assert not sources["train"] & sources["test"]
    assert not sources["valid"] & sources["test"]
    assert len(sources["valid"]) == 1000 and len(sources["test"]) == 1000
    assert len(sources["train"]) > 0.95 * 40000  # duplicates within train are rare


def test_each_english_sentence_has_exactly_one_translation(train: list) -> None:
    translations = defaultdict(set)
    for en, xx in train:
        translations[en].add(xx)
    assert all(len(xs) == 1 for xs in translations.values())


def test_lines_are_clean_sentences(splits: dict) -> None:
    for pairs in splits.values():
        for en, xx in pairs:
            for side in (en, xx):
                assert side.strip() == side and side
                assert "\t" not in side and "\n" not in side and "\r" not in side
                assert side[0].isupper() and side[-1] in ".?"
            assert en[-1] == xx[-1]


def test_lengths_within_bounds(train: list) -> None:
    en_lengths = [len(words(en)) for en, _ in train]
    xx_lengths = [len(words(xx)) for _, xx in train]
    assert min(en_lengths) >= 3 and max(en_lengths) <= 25
    assert min(xx_lengths) >= 2 and max(xx_lengths) <= 35
    assert sum(4 <= n <= 15 for n in en_lengths) > 0.85 * len(train)
    assert sum(n > 15 for n in en_lengths) > 0.01 * len(train)  # some long sentences
    assert 6 <= sum(en_lengths) / len(train) <= 10


def test_vocabulary_sizes_in_range(train: list) -> None:
    en_vocab = {w for en, _ in train for w in words(en)}
    xx_vocab = {w for _, xx in train for w in words(xx)}
    assert 300 <= len(en_vocab) <= 700
    assert 300 <= len(xx_vocab) <= 700


def test_target_is_not_a_copy(train: list) -> None:
    shared = total = 0
    for en, xx in train:
        en_words = set(words(en))
        shared += sum(w in en_words for w in words(xx))
        total += len(words(xx))
    assert shared / total < 0.02
    assert sum(en.endswith("?") for en, _ in train) > 0.1 * len(train)  # questions occur


def is_function(pairs: list[tuple[str, str]]) -> bool:
    mapping = defaultdict(set)
    for key, value in pairs:
        mapping[key].add(value)
    return all(len(values) == 1 for values in mapping.values())


def transitive_frames(train: list) -> list[tuple[tuple[str, ...], list[str]]]:
    """English (subject, verb, object) and Tirelan words of present "The N Vs the N." sentences:
    "The dog sees the cat." is "Zabi sa mohuza sa ko nodu." (the past adds a seventh word, ba)."""
    found = []
    for en, xx in train:
        match = FRAME.match(en)
        if match and match.group(2) not in ("is", "are", "was", "were") and len(words(xx)) == 6:
            found.append((match.groups(), words(xx)))
    return found


def test_word_order_is_subject_object_verb(train: list) -> None:
    matches = transitive_frames(train)
    assert len(matches) > 50
    # English subject, object and verb each predict one Tirelan position: 1st, 3rd and last.
    assert is_function([(en[0], xx[0]) for en, xx in matches])
    assert is_function([(en[2], xx[2]) for en, xx in matches])
    assert is_function([(en[1], xx[5]) for en, xx in matches])
    # A noun is the same Tirelan word as subject and as object: a lexical mapping.
    subject_words = {en[0]: xx[0] for en, xx in matches}
    assert all(subject_words.get(en[2], xx[2]) == xx[2] for en, xx in matches)
    # The last English word does not predict the last Tirelan one: the order really changed.
    assert not is_function([(en[2], xx[5]) for en, xx in matches])


def test_verb_agrees_with_subject_number(train: list) -> None:
    # "The dog sees the cat." vs "The dogs see the cat.": one verb, two Tirelan forms.
    forms = defaultdict(set)
    for en, xx in transitive_frames(train):
        forms[en[1]].add(xx[5])
    pairs = [(v, v[: -len(s)]) for v in forms for s in ("es", "s") if v.endswith(s)]
    pairs = [(sg, pl) for sg, pl in pairs if pl in forms]
    assert len(pairs) >= 5
    for sg, pl in pairs:
        assert not forms[sg] & forms[pl]
        (sg_form,), (pl_form,) = forms[sg], forms[pl]
        assert pl_form.startswith(sg_form)  # same stem, plural suffix


def test_noun_plural_and_adjective_agreement(train: list) -> None:
    adjective_forms = defaultdict(set)  # (adjective, number) -> Tirelan forms
    noun_forms = {}
    for en, xx in train:
        match = COPULA_FRAME.match(en)
        if match and len(words(xx)) == 4:  # "Zabi sa zaltuna leva."
            noun, be, adjective = match.groups()
            adjective_forms[adjective, be].add(words(xx)[2])
            noun_forms[noun] = words(xx)[0]
    # Plural nouns are marked: "dogs" is "dog" plus a suffix.
    plural_pairs = [(n, n + "s") for n in noun_forms if n + "s" in noun_forms]
    assert len(plural_pairs) >= 5
    assert all(noun_forms[pl].startswith(noun_forms[sg]) and noun_forms[pl] != noun_forms[sg]
               for sg, pl in plural_pairs)
    # Adjectives agree in number, and in class: "big" has two singular forms (dog vs house).
    shared = [a for a, be in adjective_forms if be == "is" and (a, "are") in adjective_forms]
    assert shared and all(not adjective_forms[a, "is"] & adjective_forms[a, "are"] for a in shared)
    assert any(len(adjective_forms[a, "is"]) == 2 for a in shared)


def test_invented_words_are_not_english(train: list) -> None:
    en_vocab = {w for en, _ in train for w in words(en)}
    xx_vocab = {w for _, xx in train for w in words(xx)}
    assert not en_vocab & xx_vocab
    assert all(re.fullmatch(r"[a-z]+", w) for w in xx_vocab)


def test_main_writes_one_file_per_split_and_language(tmp_path, monkeypatch) -> None:
    small = {"train": [("A dog sleeps.", "Zabi zoko.")], "valid": [], "test": []}
    monkeypatch.setattr(synthetic, "builtin_splits", lambda: small)
    synthetic.main([str(tmp_path)])
    assert (tmp_path / "train.en").read_text() == "A dog sleeps.\n"
    assert (tmp_path / f"train.{synthetic.TGT_LANG}").read_text() == "Zabi zoko.\n"
    assert (tmp_path / "test.en").read_text() == ""
