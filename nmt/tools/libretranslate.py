"""LibreTranslate's API on `nmt serve`, beside nmt's own: what LibreTranslate's clients send (libretranslatepy,
browser extensions, Nextcloud, Weblate ...), answered in the shapes of LibreTranslate's own app.

- `POST /translate`, a form (url-encoded or multipart) or a JSON object with "q": `q` (a text, or in JSON
  a list of texts), `source` (a code), `target`, `format` ("text" or "html"), `alternatives` (0-3), `api_key`.
  Answers {"translatedText": a text or a list, as `q` was} and, when asked, {"alternatives": [...]}. A text is a
  document: its paragraphs (runs of non-blank lines) are split into sentences (`nmt.sentences`), translated, and
  each paragraph written back as one line, blank lines kept; an html text is one piece of markup (`nmt.markup`).
- `POST /detect` (`q`): [{"language", "confidence" 0-100}], the most likely languages of q, best first
  (`nmt.language`); `source: auto` in /translate tells q's language among the model's source languages.
- `GET /languages`: [{"code", "name", "targets"}], the languages the model translates from and to.

Errors are {"error": "..."}: 400 for a bad or missing field, an unsupported language or format; 403 for a wrong
`api_key`; 429 when the queue is full. The sentences go through nmt's own pipeline: the same limits (--max-chars
a sentence, --max-sentences, --max-cost, the timeout), the same batching, the same key (`Authorization: Bearer`, or
`api_key` in the body as LibreTranslate's clients send it).
"""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse

from nmt.sentences import join_documents, split_documents
from nmt.tools.request_batcher import BadRequest, check_sentences

FORM = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"
ALTERNATIVES_LIMIT = 3  # as LibreTranslate's default --alternatives-limit
MAX_FIELDS = 16  # a form holds a handful of fields; more is no client of this API

# English names of the languages LibreTranslate and the common MT models serve (ISO 639-1; others show their code)
NAMES = dict(pair.split(":") for pair in """
af:Afrikaans am:Amharic ar:Arabic az:Azerbaijani be:Belarusian bg:Bulgarian bn:Bengali bs:Bosnian ca:Catalan
cs:Czech cy:Welsh da:Danish de:German el:Greek en:English eo:Esperanto es:Spanish et:Estonian eu:Basque fa:Persian
fi:Finnish fr:French ga:Irish gl:Galician gu:Gujarati he:Hebrew hi:Hindi hr:Croatian hu:Hungarian hy:Armenian
id:Indonesian is:Icelandic it:Italian ja:Japanese ka:Georgian kk:Kazakh km:Khmer kn:Kannada ko:Korean ky:Kyrgyz
lt:Lithuanian lv:Latvian mk:Macedonian ml:Malayalam mn:Mongolian mr:Marathi ms:Malay mt:Maltese my:Burmese
nb:Norwegian ne:Nepali nl:Dutch no:Norwegian pa:Punjabi pl:Polish ps:Pashto pt:Portuguese ro:Romanian ru:Russian
si:Sinhala sk:Slovak sl:Slovenian sq:Albanian sr:Serbian sv:Swedish sw:Swahili ta:Tamil te:Telugu th:Thai
tl:Tagalog tr:Turkish uk:Ukrainian ur:Urdu uz:Uzbek vi:Vietnamese zh:Chinese zu:Zulu
""".split())


def is_form(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower() in (FORM, MULTIPART)


async def form_fields(request: Request, body: bytes) -> dict[str, str]:
    """A form's fields (the first value of each), url-encoded or multipart (as browsers send a FormData; files are
    refused), line ends as LibreTranslate makes them (LF)."""
    if request.headers.get("content-type", "").split(";", 1)[0].strip().lower() == MULTIPART:
        from starlette.formparsers import MultiPartException, MultiPartParser

        async def chunks():
            yield body

        try:
            form = await MultiPartParser(request.headers, chunks(), max_files=0, max_fields=MAX_FIELDS).parse()
        except MultiPartException as e:  # a file too ("Too many files"): this API translates text fields
            raise BadRequest(400, f"the multipart form cannot be read ({e.message}): send text fields only") from None
        fields = {key: form.get(key) for key in form.keys()}
        return {key: "\n".join(value.splitlines()) for key, value in fields.items()}
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=MAX_FIELDS,
                          encoding="utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"the form is not UTF-8 (byte {e.start} cannot start a character)") from None
    except ValueError:
        raise BadRequest(400, f"the form has more than {MAX_FIELDS} fields") from None
    return {key: "\n".join(values[0].splitlines()) for key, values in fields.items()}


def check_key(key: str | None, data: dict, bearer_ok: bool) -> None:
    """With a server key: the request's Bearer header or its `api_key` field must be it (403 otherwise)."""
    if key is None or bearer_ok:
        return
    given = data.get("api_key")
    if not isinstance(given, str) or not given:
        raise BadRequest(403, "Invalid API key: this server needs one, sent as api_key (or 'Authorization: Bearer')")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise BadRequest(403, "Invalid API key")


def _field(data: dict, name: str) -> str:
    value = data.get(name)
    if value is None or value == "":
        raise BadRequest(400, f"Invalid request: missing {name} parameter")
    if not isinstance(value, str):
        raise BadRequest(400, f"Invalid request: {name} must be a string")
    return value


def parse(data: dict, translates: dict[str, list[str]]) -> tuple[list[str], bool, str, str, str, int]:
    """LibreTranslate's fields -> (texts, whether q was a list, source, target, format, alternatives)."""
    q = data.get("q")
    if q is None or q == "" or q == []:
        raise BadRequest(400, "Invalid request: missing q parameter")
    batch = isinstance(q, list)
    texts = q if batch else [q]
    if not all(isinstance(t, str) for t in texts):
        raise BadRequest(400, "Invalid request: q must be a text or a list of texts")
    source, target = _field(data, "source"), _field(data, "target")
    text_format = data.get("format") or "text"
    if text_format not in ("text", "html"):
        raise BadRequest(400, f"{str(text_format)[:40]} format is not supported")
    try:
        alternatives = max(0, int(data.get("alternatives") or 0))
    except (TypeError, ValueError):
        raise BadRequest(400, "Invalid request: alternatives parameter is not a number") from None
    if alternatives > ALTERNATIVES_LIMIT:
        raise BadRequest(400, f"Invalid request: alternatives parameter must be <= {ALTERNATIVES_LIMIT}")
    if source != "auto" and translates and source not in translates:
        raise BadRequest(400, f"{source[:40]} is not supported")
    if source != "auto" and translates and target not in translates[source]:
        raise BadRequest(400, f"{target[:40]} is not supported from {source} (targets: {', '.join(translates[source])})")
    return texts, batch, source, target, text_format, alternatives


async def translate(api, request: Request, data: dict, bearer_ok: bool) -> JSONResponse:
    """POST /translate in LibreTranslate's shape, run through `api` (serve.Api: its limits, queue and batching)."""
    try:
        check_key(api.cfg.api_key, data, bearer_ok)
        texts, batch, source, target, text_format, alternatives = parse(data, api.translates)
        detected = None
        if source == "auto":  # told among the model's source languages where it has several, else among all
            sources = list(api.translates)
            found = await api.loop.run_in_executor(api.prepare, _detect, "\n".join(texts),
                                                   sources if len(sources) > 1 else None)
            source = found[0]["language"]
            detected = found[0]
            parse({**data, "source": source}, api.translates)  # a language the model translates, to the target
        if text_format == "html":  # one piece of markup each: its tags are not cut apart
            layout = [[[i]] for i in range(len(texts))]
            sentences = list(texts)
        else:
            layout, sentences = split_documents(texts)
        check_sentences(sentences, api.cfg)
    except BadRequest as e:
        return JSONResponse({"error": str(e)}, status_code=400 if e.status == 413 else e.status)
    nbest = 1 if text_format == "html" else alternatives + 1  # as LibreTranslate: no alternatives for html ([])
    options = {"beam_size": max(api.cfg.beam, nbest), "confidence": False, **({"nbest": nbest} if nbest > 1 else {}),
               **({"format": "html"} if text_format == "html" else {}),
               **({"tgt_lang": target} if api.translator.target_languages else {}),
               **({"src_lang": source} if api.translator.source_languages else {}),
               **({"guard": True} if api.cfg.guard else {})}
    outputs: list = []
    if sentences:
        done = await api.run(request, sentences, options, api.cfg.timeout)
        if isinstance(done, JSONResponse):  # a limit (nmt's 413) is LibreTranslate's 400; 429, 503, 504 as they are
            done.status_code = 400 if done.status_code == 413 else done.status_code
            return done
        outputs = done[0]
    ranked = [[t.text for t in out.nbest] for out in outputs]  # per sentence: its n best texts
    written = [join_documents(layout, [r[k] for r in ranked]) for k in range(nbest)]  # k-th best of every text
    found = [[written[k][i] for k in range(nbest)] for i in range(len(layout))]
    result: dict = {"translatedText": [f[0] for f in found] if batch else found[0][0]}
    if detected is not None:
        result["detectedLanguage"] = [detected] * len(found) if batch else detected
    if alternatives:
        others = [list(dict.fromkeys(t for t in f[1:] if t != f[0])) for f in found]
        result["alternatives"] = others if batch else others[0]
    return JSONResponse(result)


DETECT_CHARS = 10_000  # enough text to tell a language; a longer q is told by its start


def _detect(text: str, among: list[str] | None = None) -> list[dict]:
    """LibreTranslate's detections: [{"language", "confidence" 0-100}], best first; BadRequest 400 when the text is
    too short to tell."""
    from nmt.language import TooShort, detect

    try:
        return [{"language": code, "confidence": round(100 * p, 1)} for code, p in detect(text[:DETECT_CHARS], among)]
    except TooShort as e:
        raise BadRequest(400, str(e)) from None


async def detect(api, request: Request, data: dict, bearer_ok: bool) -> JSONResponse:
    """POST /detect: q's most likely languages, among all the identifier knows (`nmt.language`)."""
    try:
        check_key(api.cfg.api_key, data, bearer_ok)
        q = _field(data, "q")
        return JSONResponse(await api.loop.run_in_executor(api.prepare, _detect, q))
    except BadRequest as e:
        return JSONResponse({"error": str(e)}, status_code=400 if e.status == 413 else e.status)


async def languages(api, request: Request) -> JSONResponse:
    """GET /languages: the model's source languages, each with its targets."""
    return JSONResponse([{"code": s, "name": NAMES.get(s.split("_")[0].split("-")[0], s), "targets": ts}
                         for s, ts in api.translates.items()])
