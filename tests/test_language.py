"""nmt.language: a text's language told among the languages a caller names (a model's, in its own codes), what
the guard, `src_lang="auto"` and the server's /detect ask; too little text is said to be too little, never guessed."""

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("py3langid")

from nmt.language import TooShort, base, detect, knows  # noqa: E402

ENGLISH = "The children were playing in the garden all afternoon."
GERMAN = "Die Kinder haben den ganzen Nachmittag im Garten gespielt."
FRENCH = "Les enfants ont joué dans le jardin tout l'après-midi."


def test_a_code_is_read_as_its_language():
    assert [base(c) for c in ("pt_BR", "zh-Hans", "deu_Latn", "eng_Latn", "de")] == ["pt", "zh", "de", "en", "de"]
    assert knows("pt_BR") and knows("deu_Latn") and not knows("xx")


def test_detect_ranks_languages_among_those_named_in_the_callers_codes():
    ranked = detect(ENGLISH)
    assert ranked[0][0] == "en" and len(ranked) == 3
    assert [p for _, p in ranked] == sorted((p for _, p in ranked), reverse=True) and 0 < sum(p for _, p in ranked) <= 1
    nllb = ["deu_Latn", "eng_Latn", "fra_Latn", "xx_Unknown"]  # an imported NLLB's codes; one the identifier lacks
    [(code, p)] = detect(GERMAN, nllb, top=1)
    assert code == "deu_Latn" and 0.5 < p <= 1
    assert {code for code, _ in detect(FRENCH, nllb)} <= set(nllb)
    assert detect(FRENCH, ["xx"])[0][0] == "fr"  # none it knows: every language it knows
    for text in ("", "ok", "12 34 !!"):
        with pytest.raises(TooShort, match="too short"):
            detect(text)


def test_concurrent_callers_each_get_their_own_languages():
    """The identifier is restricted to a caller's languages for one call: threads asking with other lists (the
    server's model thread, its /detect) never see each other's restriction."""
    asks = [(ENGLISH, ["en", "de"]), (GERMAN, ["de", "fr"]), (FRENCH, ["fr", "en"]), (ENGLISH, None)] * 25
    alone = [detect(text, among) for text, among in asks]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda ask: detect(*ask), asks))
    assert together == alone
