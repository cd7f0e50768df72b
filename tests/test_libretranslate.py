"""nmt.tools.libretranslate: LibreTranslate's API on `nmt serve`, as its real client (libretranslatepy) and raw
requests meet it: translate (a form or JSON, q a text or a list, html, alternatives), languages, detect, the key,
and its untrusted fields refused with 400, never 500."""

from __future__ import annotations

import pytest
from helpers import MULTIPART, asgi_requests, multipart, nmt_translate, serving

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def model_dir(served_model):
    return served_model


def test_libretranslates_client_and_requests_get_libretranslates_answers(model_dir):
    """Issue 45, part 1: LibreTranslate's API beside nmt's own. Its real client (libretranslatepy: a form with q,
    source, target and api_key) translates a document as nmt translate --paragraphs does and lists the languages;
    raw requests: q as a list, html, alternatives, a wrong or missing key, an unknown language, a multipart form
    (a browser's FormData; with a file: 400);
    /detect and source auto (part 2), and a text too short to tell.
    nmt's own JSON still needs the Bearer key."""
    from libretranslatepy import LibreTranslateAPI

    document = "the dog sleeps .\n\nthe cat eats a fish .\nthe dog runs ."
    with serving(model_dir, "--beam", "2", "--api-key", "k") as server:
        client = LibreTranslateAPI(f"http://127.0.0.1:{server.port}", api_key="k")
        translated = client.translate(document, "en", "xx")
        languages = client.languages()
        detected = client.detect("Der Hund schläft im Garten.")
        told = server.call("POST", "/translate", {"q": ["the dog sleeps .", "the cat eats ."], "source": "auto",
                                                  "target": "xx", "api_key": "k"})
        short = [server.call("POST", "/detect", {"q": "ok", "api_key": "k"}),
                 server.call("POST", "/translate", {"q": "Der Hund schläft im Garten.", "source": "auto",
                                                    "target": "xx", "api_key": "k"}),
                 server.call("POST", "/detect", {"q": "the dog", "api_key": "x"})]
        lt = {"source": "en", "target": "xx", "api_key": "k"}
        listed = server.call("POST", "/translate", {**lt, "q": ["the dog sleeps .", "the cat eats ."]})
        marked = server.call("POST", "/translate", {**lt, "q": "the <b>dog</b> sleeps .", "format": "html",
                                                    "alternatives": 1})
        other = server.call("POST", "/translate", {**lt, "q": "the dog sleeps .", "alternatives": 2})
        refused = [server.call("POST", "/translate", {**lt, "q": "a", "api_key": "x"}),
                   server.call("POST", "/translate", {"q": "a", "source": "en", "target": "xx"}),
                   server.call("POST", "/translate", {**lt, "q": "a", "target": "fr"}),
                   server.call("POST", "/translate", {**lt, "q": "a", "source": "auto"}),
                   server.call("POST", "/translate", {**lt, "q": ""}),
                   server.call("POST", "/translate", {**lt, "q": "a", "format": "markdown"}),
                   server.call("POST", "/translate", {**lt, "q": "a", "alternatives": 9}),
                   server.call("POST", "/translate", multipart({**lt, "q": "a"}, file=True), headers=MULTIPART),
                   server.call("POST", "/translate", {"sentences": ["a"]})]
        browser = server.call("POST", "/translate", multipart({**lt, "q": "the dog sleeps ."}), headers=MULTIPART)
    assert translated == "\n".join(nmt_translate(model_dir, document.split("\n"), "--beam", "2", "--paragraphs"))
    assert translated.count("\n") == 2 and "\n\n" in translated  # two paragraphs, the blank line kept
    assert languages == [{"code": "en", "name": "English", "targets": ["xx"]}]
    assert detected[0]["language"] == "de" and 50 < detected[0]["confidence"] <= 100, detected
    assert told[0] == 200 and [d["language"] for d in told[1]["detectedLanguage"]] == ["en", "en"], told
    assert told[1]["translatedText"] == nmt_translate(model_dir, ["the dog sleeps .", "the cat eats ."], "--beam", "2")
    assert [s for s, _ in short] == [400, 400, 403], short
    assert "too short to tell its language" in short[0][1]["error"] and short[1][1]["error"] == "de is not supported"
    assert listed == (200, {"translatedText": nmt_translate(model_dir, ["the dog sleeps .", "the cat eats ."],
                                                            "--beam", "2")})
    assert marked == (200, {"translatedText": nmt_translate(model_dir, ["the <b>dog</b> sleeps ."], "--beam", "2",
                                                            "--format", "html")[0], "alternatives": []})
    assert other[0] == 200 and 1 <= len(other[1]["alternatives"]) <= 2 and other[1]["translatedText"] not in \
        other[1]["alternatives"]
    assert [status for status, _ in refused] == [403, 403, 400, 400, 400, 400, 400, 400, 401], refused
    assert [answer["error"] for _, answer in refused[:3]] == [
        "Invalid API key", "Invalid API key: this server needs one, sent as api_key (or 'Authorization: Bearer')",
        "fr is not supported from en (targets: xx)"]
    assert refused[4][1]["error"] == "Invalid request: missing q parameter"
    assert refused[7][1]["error"].startswith("the multipart form cannot be read (Too many files")
    assert browser == (200, {"translatedText": nmt_translate(model_dir, ["the dog sleeps ."], "--beam", "2")[0]})


def test_hostile_libretranslate_fields_get_400_json(model_dir):
    """LibreTranslate's fields are untrusted like the rest: a form that is not UTF-8 or has too many fields, q of
    the wrong type or over the limits, a lone surrogate: 400 naming what is wrong, never 500."""
    from nmt.tools.request_batcher import ServeConfig
    from nmt.tools.serve import build_app
    from nmt.translate import Translator

    form = {"content-type": "application/x-www-form-urlencoded"}
    lt = {"source": "en", "target": "xx"}
    hostile = [(b"q=%FF%FE&source=en&target=xx", form, "the form is not UTF-8"),
               ("&".join(f"f{i}=1" for i in range(40)).encode(), form, "more than 16 fields"),
               ({"q": [1, 2], **lt}, {}, "q must be a text or a list of texts"),
               ({"q": {"a": 1}, **lt}, {}, "q must be a text or a list of texts"),
               ({"q": "a", "source": ["en"], "target": "xx"}, {}, "source must be a string"),
               ({"q": "word " * 2000, **lt}, {}, "characters; the limit is 4096 per sentence"),
               ({"q": ["a ."] * 300, **lt}, {}, "300 sentences in one request; the limit is 256"),
               (b'{"q": "\\ud800 x", "source": "en", "target": "xx"}', {}, "not valid Unicode"),
               ({"q": "a", "alternatives": "many", **lt}, {}, "alternatives parameter is not a number")]
    hostile.append(({"q": "the dog sleeps . " * 40, **lt}, {}, "the request's decoding cost is"))  # over --max-cost
    app = build_app(Translator.from_pretrained(model_dir), ServeConfig(max_cost=2000, batch_cost=2000,
                                                                      max_queued_cost=2000))
    answers = asgi_requests(app, *(("POST", "/translate", body, headers) for body, headers, _ in hostile))
    for (status, answer), (_, _, needle) in zip(answers, hostile):
        assert status == 400 and needle in answer["error"], (status, answer, needle)
