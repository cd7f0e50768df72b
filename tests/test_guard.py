"""The guard (nmt.guard): loops and output in another language than the target found, flagged translations
decoded again, the others left exactly as they were, and what stays doubtful said."""

from __future__ import annotations

import pytest
from helpers import model_dir

from nmt import Translator
from nmt.cli import main
from nmt.guard import Guard, loops, off_target
from nmt.synthetic import generate_pairs


@pytest.mark.parametrize("translation, source, looped", [
    ("I'm sorry, but I'm sorry, but I'm sorry, but", "Excuse me.", True),  # a phrase three times
    ("the the the the house", "das Haus", True),  # a word four times
    ("the the the house", "das Haus", False),  # three times is a stutter, not yet a loop
    ("Ha ha ha ha!", "Ha ha ha ha!", False),  # the source says it as often
    ("It is very, very good.", "Es ist sehr, sehr gut.", False),
    ("Yes, yes, yes, yes, yes.", "Ja.", True),  # case and punctuation aside
    ("She said: go, go, go!", "Sie sagte: Los!", False),
    ("Bitte hier klicken: TTTTTTTTTTT", "Click here: T", True),  # a subword loop inside a word
    ("Mississippi", "Mississippi", False),
    ("谢谢谢谢谢谢", "thank you", True),  # no spaces: read character by character
    ("", "", False),
])
def test_a_loop_is_a_run_said_more_often_than_the_source_says_any(translation, source, looped):
    assert loops(translation, source) is looped


def test_off_target_names_the_language_a_translation_is_in_when_it_is_not_the_target():
    pytest.importorskip("py3langid")
    english = "The children were playing in the garden all afternoon."
    german = "Die Kinder haben den ganzen Nachmittag im Garten gespielt."
    assert off_target(english, "de", ["en", "de"]) == "en"
    assert off_target(german, "de", ["en", "de"]) is None
    assert off_target(german, "de_DE", ["en", "de_DE"]) is None  # a regional code is its language
    nllb = ["deu_Latn", "eng_Latn", "zho_Hans", "zho_Hant"]  # an imported NLLB's codes, told by ISO 639-1
    assert off_target(english, "deu_Latn", nllb) == "eng_Latn"
    assert off_target(german, "deu_Latn", nllb) is None
    assert off_target("Hallo, Tom!", "en", ["en", "de"]) is None  # too few letters to tell
    assert off_target(english, "xx", ["en", "xx"]) is None  # a language the identifier cannot tell: no check


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_the_guard_decodes_flagged_sentences_again_and_leaves_the_others_as_they_were(engine, tmp_path, capsys):
    """A random model loops on most sentences: with the guard each translation either passes or says "loop" and
    is the first one; those that passed without the guard are unchanged; some are mended; the CLI writes the
    reason as a 4th --scores column. The same with CTranslate2 (--ct2)."""
    directory = model_dir(tmp_path / "model", seed=3)
    translator, model = Translator.from_pretrained(directory), [str(directory)]
    if engine == "ctranslate2":
        pytest.importorskip("ctranslate2")
        assert main(["export", str(directory), "--to", "ctranslate2", str(tmp_path / "ct2")]) == 0
        translator, model = Translator.from_ctranslate2(tmp_path / "ct2"), ["--ct2", str(tmp_path / "ct2")]
    sources = [a for a, _ in generate_pairs(20, seed=5)]
    first = translator.translations(sources)
    guarded = translator.translations(sources, guard=True)
    assert translator.translate(sources, guard=True) == [g.text for g in guarded]
    flagged = [i for i, (f, s) in enumerate(zip(first, sources)) if loops(f.text, s)]
    assert 0 < len(flagged) < len(sources) if engine == "torch" else flagged  # CTranslate2's beam: all loop
    for i, (f, g, s) in enumerate(zip(first, guarded, sources)):
        if i not in flagged:
            assert g == f  # passed: not decoded again
        elif g.doubt:
            assert g.doubt == "loop" and g.text == f.text
        else:
            assert not loops(g.text, s)
    assert any(not guarded[i].doubt for i in flagged)  # the fallback mended some
    unguarded = translator.translations(sources, guard=Guard(loops=False))
    assert unguarded == first  # nothing to check (the model names no languages): nothing decoded again

    path = tmp_path / "in.txt"
    path.write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", *model, "--input", str(path), "--scores", "--guard"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [(r[0], r[3]) for r in rows] == [(g.text, g.doubt) for g in guarded]


def test_a_translation_still_in_the_wrong_language_goes_through_a_pivot_the_model_was_trained_for(tmp_path,
                                                                                                monkeypatch):
    """A model trained on en<->de and en<->fr asked for de->fr (zero-shot): what the wider beam leaves off target is
    translated de->en, then en->fr, and that replaces it where it passes; without a pivot it stays doubtful. The
    language identifier is replaced by one that calls every direct translation English (a random model writes no
    language), so the test follows the searches made."""
    pytest.importorskip("py3langid")
    import json

    from helpers import tiny_model

    import nmt.guard
    from nmt.checkpoint import LANGUAGES_FILE, languages_record
    from nmt.config import TokenizerConfig, lang_tag
    from nmt.tokenizer import PairTokenizer, train_tokenizer

    german = ["Die Kinder haben den ganzen Nachmittag im Garten gespielt.",
              "Ich habe gestern einen langen Brief an meine Schwester geschrieben.",
              "Der Zug nach Berlin fährt heute viel später als sonst."]
    targets, directory = ["de", "en", "fr"], tmp_path / "model"
    texts = german + [t for pair in generate_pairs(100, seed=7) for t in pair]
    tok = train_tokenizer(texts, TokenizerConfig(vocab_size=120, min_frequency=1,
                                                 reserved=[lang_tag(t) for t in targets]))
    tiny_model(seed=3, vocab=tok.get_vocab_size()).save_pretrained(directory)
    PairTokenizer(tok).save(directory)
    (directory / LANGUAGES_FILE).write_text(json.dumps(languages_record(
        ["en-de", "de-en", "en-fr", "fr-en"], targets, [lang_tag(t) for t in targets])))
    translator = Translator.from_pretrained(directory)
    assert translator.pivot_languages("fr", "de") == ["en"]
    assert translator.pivot_languages("fr", "en") == []  # en->fr was trained: nothing goes between
    assert translator.pivot_languages("de") == ["en"]  # the source's language unknown: any trained into de

    searches, direct = [], set()
    translations = translator.translations

    def spy(texts, *args, **kwargs):
        found = translations(texts, *args, **kwargs)
        searches.append((list(texts), kwargs.get("tgt_lang"), found))
        if kwargs.get("tgt_lang") == "fr" and set(texts) <= set(german):  # the sources searched into French
            direct.update(c.text for f in found for c in f.nbest)
        return found

    monkeypatch.setattr(translator, "translations", spy)
    monkeypatch.setattr(nmt.guard, "off_target", lambda text, target, among: "en" if text in direct else None)
    stuck = translations(german, tgt_lang="fr", guard=Guard(loops=False, pivot=False))
    assert [s.doubt for s in stuck] == ["off-target: en"] * 3  # the wider beam mends none of them
    searches.clear()
    guarded = translations(german, tgt_lang="fr", guard=Guard(loops=False))
    (legs, into_en, first), (second, into_fr, through) = searches[-2:]
    assert (legs, into_en, into_fr) == (german, "en", "fr") and second == [t.text for t in first]
    assert [g.text for g in guarded] == [t.text for t in through]
    assert all(g.doubt == "" and g.text not in direct for g in guarded)
    from nmt.tools.serve import decoding_costs

    plain = decoding_costs(translator, [5], {"beam_size": 4, "tgt_lang": "fr"})[0]
    assert decoding_costs(translator, [5], {"beam_size": 4, "tgt_lang": "fr", "guard": True})[0] == 5 * plain  # 1+2+2


def test_the_guard_needs_one_beam_searched_translation_per_sentence(tmp_path):
    translator = Translator.from_pretrained(model_dir(tmp_path / "model"))
    from nmt.decoding import SamplingConfig
    from nmt.errors import NmtError

    for kwargs in ({"nbest": 2}, {"sampling": SamplingConfig()}):
        with pytest.raises(NmtError, match="guard checks one translation per sentence"):
            translator.translations(["a b"], guard=True, **kwargs)


def test_nmt_serve_guards_what_its_flag_or_a_request_asks_and_prices_the_second_search(tmp_path):
    """`nmt serve --guard` checks every request that does not say "guard": false, a request may ask for it on a
    server without the flag, and "scores" then carry each translation's doubt, as Translator.translate says it;
    the decoding cost counts the wider search every sentence may get; LibreTranslate's route is guarded too."""
    from helpers import asgi_requests

    from nmt.tools.request_batcher import ServeConfig
    from nmt.tools.serve import build_app, decoding_costs

    translator = Translator.from_pretrained(model_dir(tmp_path / "model", seed=3))
    sources = [a for a, _ in generate_pairs(8, seed=5)]
    guarded = [{"text": g.text, "mean_logprob": g.mean_logprob, "confidence": g.confidence, "doubt": g.doubt}
               for g in translator.translations(sources, guard=True)]
    plain = translator.translate(sources)
    assert [g["text"] for g in guarded] != plain
    tokens = [len(ids) for ids in translator.tokenizer.encode_src(sources)]
    cost = sum(decoding_costs(translator, tokens, {"beam_size": 4}))
    assert sum(decoding_costs(translator, tokens, {"beam_size": 4, "guard": True})) == 3 * cost
    on, off = ServeConfig(guard=True), ServeConfig(max_cost=2 * cost, max_queued_cost=2 * cost)
    answers = asgi_requests(build_app(translator, on),
                            ("POST", "/translate", {"sentences": sources, "scores": True}),
                            ("POST", "/translate", {"sentences": sources, "guard": False}),
                            ("POST", "/translate", {"q": sources, "source": "en", "target": "xx"}))
    assert [a[1].get("translations", a[1].get("translatedText")) for a in answers] == [
        guarded, plain, [g["text"] for g in guarded]]
    answers = asgi_requests(build_app(translator, off),
                            ("POST", "/translate", {"sentences": sources, "guard": True}),
                            ("POST", "/translate", {"sentences": sources}),
                            ("POST", "/translate", {"sentences": sources, "guard": "yes"}))
    assert answers[0][0] == 413 and answers[1] == (200, {"translations": plain, "batch": answers[1][1]["batch"]})
    assert answers[2] == (400, {"error": "'guard' must be true or false, got 'yes'"})
