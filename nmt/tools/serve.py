"""`nmt serve`: an HTTP JSON API over a model directory (Starlette app, served by uvicorn).

POST /translate {"sentences": [...], "beam": 4, ...} -> {"translations": [...], "batch": {...}}
GET / (a page to try the model: nmt/tools/page.html), GET /health, GET /info (the model's architecture, metrics and
target languages, and the server's limits), GET /stats (batch sizes).
Concurrent requests are batched by `nmt.tools.request_batcher.Batcher`; the one home of starlette and uvicorn.

Every request a client gets wrong is answered 4xx with {"error": "..."}; what a request may cost is bounded
before it is queued (its decoding cost: sentences x beam x length limit), and what a client holds is bounded in
time (headers and body deadlines, keep-alive, a connection limit). See docs/serving.md.

The event loop only reads, parses and answers: a request's work (normalising, tokenising, decoding) runs in
threads, in pieces bounded before they start. Sentences, characters per sentence (before and after NFKC, which
expands one character into up to 18) and a lower bound of the decoding cost are checked on the loop, cheaply,
before any of it; the exact cost once the sentences are tokenised, before they are queued.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import hmac
import importlib.resources
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sys
import unicodedata
import uuid

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nmt import markup
from nmt.compat import uvicorn_protocol_with_header_deadline
from nmt.config import RANGE, Range
from nmt.constraints import MAX_TERM_CHARS, Glossary
from nmt.decoding import SearchConfig
from nmt.engines import GLOSSARY
from nmt.errors import NmtError
from nmt.guard import Guard
from nmt.sentences import join_documents, split_documents
from nmt.tools import libretranslate
from nmt.tools.request_batcher import (
    API_KEY_ENV,
    BadRequest,
    Batcher,
    Job,
    QueueFull,
    ServeConfig,
    Stopping,
    check_sentences,
)
from nmt.translate import Translation

log = logging.getLogger(__name__)

# Request options: JSON key -> (Translator.translations keyword, type). Their ranges are SearchConfig's: what a request
# may cost is bounded by --max-cost, not by a second set of numbers here.
OPTIONS = {"beam": ("beam_size", int), "alpha": ("alpha", float), "nbest": ("nbest", int),
           "max_new_tokens": ("max_new_tokens", int), "no_repeat_ngram_size": ("no_repeat_ngram_size", int)}
SEARCH_RANGES = {f.name: f.metadata[RANGE] for f in dataclasses.fields(SearchConfig) if RANGE in f.metadata}
# what GET /info shows of `nmt info --json`: no paths, no command lines
MAX_GLOSSARY_PAIRS = 256  # a request's glossary: at most this many pairs, of at most MAX_TERM_CHARS characters a term
PUBLIC_INFO = ("architecture", "parameters", "tensors", "dtypes", "vocab", "step", "best", "num_processes", "search",
               "languages")


def _page() -> tuple[str, dict]:
    """The page GET / serves (nmt/tools/page.html, one file: its script and style inline) and its headers: a
    Content-Security-Policy that runs only that script and style (by their hashes) and lets it reach this server
    only."""
    page = importlib.resources.files("nmt.tools").joinpath("page.html").read_text(encoding="utf-8")

    def hashes(tag: str) -> str:
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
                        for body in re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.S))

    policy = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; connect-src 'self'; "
              "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return page, {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store",
                  "Referrer-Policy": "no-referrer"}


PAGE, PAGE_HEADERS = _page()


def json_object(body: bytes) -> dict:
    """A request body as the JSON object it must be; BadRequest 400 saying what is wrong with it."""
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"the body is not UTF-8 (byte {e.start} cannot start a character)") from None
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"the body is not valid JSON ({e})") from None
    except RecursionError:
        raise BadRequest(400, "the body nests JSON too deeply") from None
    except ValueError as e:  # a number of more digits than Python converts
        raise BadRequest(400, f"the body holds a number too long to read ({str(e).split(':')[0]})") from None
    if not isinstance(data, dict):
        raise BadRequest(400, 'the body must be a JSON object like {"sentences": ["Hello."]}')
    return data


def parse_request(data: dict, cfg: ServeConfig) -> tuple[list[str], dict, float, list | None]:
    """A request's JSON object -> (sentences, Translator.translations keywords, timeout in seconds, and with
    "paragraphs": true the documents' layout, `nmt.sentences.split_documents`, else None); BadRequest names the
    field. With paragraphs each item of `sentences` is a document, split into sentences that the limits apply to."""
    unknown = sorted(set(data) - {"sentences", "timeout", "tgt_lang", "src_lang", "scores", "glossary", "format",
                                  "paragraphs", "guard", *OPTIONS})
    if unknown:
        raise BadRequest(400, f"unknown field {_short(unknown[0])}; known: sentences, timeout, tgt_lang, src_lang, scores, "
                         f"glossary, format, paragraphs, guard, {', '.join(OPTIONS)}")
    sentences = data.get("sentences")
    if not isinstance(sentences, list) or not sentences:
        raise BadRequest(400, "'sentences' must be a non-empty list of strings")
    for i, s in enumerate(sentences):
        if not isinstance(s, str):
            raise BadRequest(400, f"'sentences' must be a non-empty list of strings; item {i} is {_short(s)}")
    layout = None
    if "paragraphs" in data:  # each item a document, as nmt translate --paragraphs reads a file
        if not isinstance(data["paragraphs"], bool):
            raise BadRequest(400, f"'paragraphs' must be true or false, got {_short(data['paragraphs'])}")
        if data["paragraphs"]:
            if any(key in data for key in ("nbest", "scores")) or data.get("format", "text") != "text":
                raise BadRequest(400, "'paragraphs' gives one translation a paragraph of plain text: leave out "
                                 "'nbest', 'scores' and 'format'")
            layout, sentences = split_documents(sentences)
    check_sentences(sentences, cfg)
    options = {"beam_size": cfg.beam}
    for key, (keyword, kind) in OPTIONS.items():
        if key in data:
            options[keyword] = _number(data[key], key, kind, SEARCH_RANGES[keyword])
    if options.get("nbest", 1) > options["beam_size"]:
        raise BadRequest(400, f"'nbest' ({options['nbest']}) cannot exceed 'beam' ({options['beam_size']})")
    if "tgt_lang" in data:  # a multilingual model's target language (checked against the model by the caller)
        if not isinstance(data["tgt_lang"], str):
            raise BadRequest(400, f"'tgt_lang' must be a language code string, got {_short(data['tgt_lang'])}")
        options["tgt_lang"] = data["tgt_lang"]
    if "src_lang" in data:  # an imported M2M100/NLLB model's source language, or "auto" (checked by the caller)
        if not isinstance(data["src_lang"], str):
            raise BadRequest(400, f"'src_lang' must be a language code string or auto, got {_short(data['src_lang'])}")
        options["src_lang"] = data["src_lang"]
    if "scores" in data:  # each translation with its mean log-probability and confidence (a Translation's)
        if not isinstance(data["scores"], bool):
            raise BadRequest(400, f"'scores' must be true or false, got {_short(data['scores'])}")
    options["confidence"] = data.get("scores", False)
    if not isinstance(data.get("guard", cfg.guard), bool):
        raise BadRequest(400, f"'guard' must be true or false, got {_short(data['guard'])}")
    if data.get("guard", cfg.guard):  # loops and the wrong language searched for again (nmt.guard)
        options["guard"] = True
    if "glossary" in data:
        options["glossary"] = parse_glossary(data["glossary"])
    if "format" in data:  # "html", "xml": each sentence is markup, its tags kept (nmt.markup)
        if data["format"] not in markup.FORMATS:
            raise BadRequest(400, f"'format' must be one of {', '.join(map(repr, markup.FORMATS))}, got "
                             f"{_short(data['format'])}")
        if data["format"] != "text":
            options["format"] = data["format"]
    timeout = _number(data.get("timeout", cfg.timeout), "timeout", float, Range(f"(0, {cfg.timeout}]"))
    return [s.replace("\n", " ") for s in sentences], options, timeout, layout


def parse_glossary(value) -> Glossary:
    """A request's 'glossary', [[source term, target term], ...]: 413 past MAX_GLOSSARY_PAIRS pairs or
    MAX_TERM_CHARS characters a term, 400 for anything else wrong, naming the item."""
    if not isinstance(value, list):
        raise BadRequest(400, f"'glossary' must be a list of [source term, target term] pairs, got {_short(value)}")
    if len(value) > MAX_GLOSSARY_PAIRS:
        raise BadRequest(413, f"'glossary' has {len(value)} pairs; the limit is {MAX_GLOSSARY_PAIRS} per request")
    for i, pair in enumerate(value):
        for term in pair if isinstance(pair, list) else ():
            if isinstance(term, str) and len(term) > MAX_TERM_CHARS:
                raise BadRequest(413, f"'glossary' item {i} has a term of {len(term)} characters; the limit is "
                                 f"{MAX_TERM_CHARS}")
            # matched and tokenised after NFKC, which makes up to 18 characters of one: bounded as matched
            if isinstance(term, str) and (n := len(unicodedata.normalize("NFKC", term))) > MAX_TERM_CHARS:
                raise BadRequest(413, f"'glossary' item {i} has a term of {n} characters after NFKC normalisation "
                                 f"({len(term)} before); the limit is {MAX_TERM_CHARS}")
    try:
        return Glossary.from_pairs(value, name="'glossary'")
    except NmtError as e:
        raise BadRequest(400, str(e)) from None


def _number(value, key: str, kind: type, allowed: Range):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(400, f"{key!r} must be {'an integer' if kind is int else 'a number'}, got {_short(value)}")
    if value not in allowed:
        raise BadRequest(400, f"{key!r} must be in {allowed}, got {_short(value)}")
    return kind(value)


def _short(value) -> str:
    """A client's value in an error message, cut short (it may be megabytes long)."""
    if isinstance(value, int) and abs(value) >= 10 ** 30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_normalised(sentences: list[str], max_chars: int) -> None:
    """BadRequest 413 at the first sentence over `max_chars` characters after NFKC, as the tokenizer reads it. Each
    sentence has at most `max_chars` characters already, so one call of the normaliser (which holds the GIL) makes
    at most 18 x max_chars of them; stopping at the first refusal bounds the whole request's work likewise."""
    for i, s in enumerate(sentences):
        n = len(unicodedata.normalize("NFKC", s))
        if n > max_chars:
            raise BadRequest(413, f"sentence {i} has {n} characters after NFKC normalisation ({len(s)} before); the "
                             f"limit is {max_chars} per sentence")


def decoding_costs(translator, tokens: list[int], options: dict, terms: list[int] | None = None) -> list[int]:
    """Per sentence: beam x the most output tokens search may generate for it (as Translator.translate and
    nmt.decoding.length_limits bound them: min(a + b * source length, max_new_tokens), truncated sources), times
    1 + the glossary terms it holds (`terms`): the constrained search weighs each term's next token for every
    beam at every step; with a guard, times 1 + its beam factor (every sentence may be searched for again with
    the wider beam), + 2 where the model has a pivot language for the target (two more searches at the call's beam)."""
    limit = translator.model.cfg.max_positions
    again = 1
    if options.get("guard"):
        pivots = translator.pivot_languages(options.get("tgt_lang")) if translator.target_languages else []
        again += Guard().beam_factor + (2 if pivots else 0)
    search = SearchConfig(**{k: v for k, v in {**translator.search_defaults, **options}.items()
                             if k in SEARCH_RANGES and k != "max_new_tokens"})
    most = min(options.get("max_new_tokens", limit), limit - 1)
    return [search.beam_size * max(1, min(int(search.max_len_a + search.max_len_b * min(n, limit)), most)) * (1 + c)
            * again for n, c in zip(tokens, terms or [0] * len(tokens))]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length, or while reading a chunked one)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and len(declared) < 20 and int(declared) > limit:
        raise BadRequest(413, f"the body has {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BadRequest(413, f"the body is over the limit of {limit} bytes")
    return bytes(body)


async def _client_left(receive) -> None:
    """Returns when the client closes its connection (the body is read: uvicorn's next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _failed(what: str, error: BaseException) -> JSONResponse:
    """A 500: a fixed message and an id for the client, the error's text and traceback in the server's log under
    that id (an exception's text can tell a client about the machine: an allocator's sizes, paths)."""
    ref = uuid.uuid4().hex[:12]
    log.error("nmt serve: %s (error id %s): %s: %s", what, ref, type(error).__name__, error, exc_info=error)
    return _error(500, f"{what} (error id {ref}; the server's log has the details)")


def _error(status: int, message: str, close: bool = False) -> JSONResponse:
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    if close:  # the rest of the request is not read: the connection cannot carry another one
        headers["Connection"] = "close"
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class Api:
    """The routes' handlers over one Batcher that calls `translator.translations`."""

    def __init__(self, translator, cfg: ServeConfig, info: dict | None = None):
        self.translator, self.cfg = translator, cfg
        self.info = {k: v for k, v in (info or {}).items() if k in PUBLIC_INFO}
        self.translates: dict[str, list[str]] = (info or {}).get("translates") or {}  # source -> targets, if known
        self.batcher = Batcher(translator.translations, cfg.batch_tokens, cfg.max_queue, cfg.max_wait_ms / 1000,
                               cfg.batching, max_cost=cfg.batch_cost, max_queued_cost=cfg.max_queued_cost,
                               cancellable=True)
        # one thread prepares requests (NFKC, tokenising) one at a time: the event loop shares the GIL with it and the
        # model's thread only, and hostile requests queue for it instead of taking every core
        self.prepare = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nmt-prepare")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.deadline: float | None = None  # loop time when a shutdown gives up on the requests in flight
        self.abandoned_call = False  # a shutdown left a model call running in its thread

    async def translate(self, request: Request) -> JSONResponse:
        """POST /translate: nmt's JSON API, or LibreTranslate's (a form, or a JSON object with "q")."""
        body = await self.body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            data, form = await self.fields(request, body)
            if form or ("q" in data and "sentences" not in data):
                return await libretranslate.translate(self, request, data, request.scope.get(KEY_CHECKED, True))
            if not request.scope.get(KEY_CHECKED, True):
                return _error(401, RequireKey.MESSAGE)
            sentences, options, timeout, layout = parse_request(data, self.cfg)
            try:
                self.translator.source_tag(options.get("tgt_lang"))  # a language the model has, or none it needs
                self.translator.source_starts([], options.get("src_lang"))  # one it can be told, or none
            except NmtError as e:
                raise BadRequest(400, str(e).replace("(--tgt-lang, tgt_lang=)", "('tgt_lang')")
                                 .replace("--src-lang (src_lang)", "'src_lang'")) from None
        except BadRequest as e:
            return _error(e.status, str(e))
        if layout is not None and not sentences:  # documents of blank lines only
            return JSONResponse({"translations": join_documents(layout, []), "batch": {}})
        done = await self.run(request, sentences, options, timeout)
        if isinstance(done, JSONResponse):
            return done
        outputs, job = done
        if layout is not None:
            return JSONResponse({"translations": join_documents(layout, [o.text for o in outputs]), "batch": job.batch})
        shown = options.get("nbest", 1), options["confidence"], bool(options.get("guard"))
        return JSONResponse({"translations": [_jsonable(o, *shown) for o in outputs], "batch": job.batch})

    @staticmethod
    async def fields(request: Request, body: bytes) -> tuple[dict, bool]:
        """The body's fields and whether they came as a form (LibreTranslate's); a JSON object sent with a form's
        type is read as JSON (curl -d sends every body so). BadRequest 400 for a body that is neither."""
        form = libretranslate.is_form(request) and not body.lstrip().startswith(b"{")
        return (await libretranslate.form_fields(request, body) if form else json_object(body)), form

    async def body(self, request: Request) -> bytes | JSONResponse:
        """The request's body, or the error answer: 408 past --request-timeout, 413 past --max-body-bytes."""
        try:
            return await asyncio.wait_for(read_body(request, self.cfg.max_body_bytes), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            return _error(408, f"the body did not arrive within {self.cfg.request_timeout:g} s", close=True)
        except BadRequest as e:
            return _error(e.status, str(e), close=True)
        except ClientDisconnect:  # it left halfway through its body: nobody reads an answer
            self.batcher.stats.disconnected += 1
            return _error(400, "the client closed the connection before its body was complete")

    async def run(self, request: Request, sentences: list[str], options: dict,
                  timeout: float) -> tuple[list, Job] | JSONResponse:
        """Sentences checked, prepared, priced and translated with the others in the queue, within `timeout` seconds:
        (the outputs, the job), or the error answer (413 over --max-cost, 429 queue full, 503 stopping, 504 timed
        out, 500 the model failed)."""
        try:
            # a lower bound of the cost (every sentence one token long): a request over it costs no tokenising
            self._check_cost(decoding_costs(self.translator, [1] * len(sentences), options), options, "at least ")
            # preparing counts in the request's timeout, waiting for the preparing thread too (the loop goes on)
            deadline = self.loop.time() + timeout
            job = await asyncio.wait_for(self.loop.run_in_executor(self.prepare, self._job, sentences, options),
                                         timeout)
            self._check_cost(job.costs, options)
            future = self.batcher.submit(job)
        except asyncio.TimeoutError:
            self.batcher.stats.timed_out += 1
            return _error(504, f"no translation within the request's timeout of {timeout:g} s (still preparing it)")
        except BadRequest as e:
            return _error(e.status, str(e))
        except QueueFull as e:
            return _error(429, str(e))
        except Stopping as e:
            return _error(503, str(e))
        left = asyncio.ensure_future(_client_left(request.receive))
        try:
            done, _ = await asyncio.wait({future, left}, timeout=max(0.0, deadline - self.loop.time()),
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn gave up on this request: so does the batcher
            self.batcher.cancel(job, "disconnected")
            raise
        finally:
            left.cancel()
        if not future.done():
            self.batcher.cancel(job, "disconnected" if left in done else "timed_out")
            # a client that left reads no answer; uvicorn drops it
            return _error(504, f"no translation within the request's timeout of {timeout:g} s")
        try:
            outputs = future.result()
        except Stopping as e:
            return _error(503, str(e))
        except Exception as e:  # noqa: BLE001 - the model failed on this request
            return _failed("translation failed", e)
        return outputs, job

    def _job(self, sentences: list[str], options: dict) -> Job:
        """The request normalised, tokenised and costed (a worker thread; BadRequest 413 past --max-chars)."""
        check_normalised(sentences, self.cfg.max_chars)
        if "glossary" in options:  # a term the model cannot write, or a backend without constraints: the client's
            try:
                if not self.translator.engine.supports(GLOSSARY) and self.translator.pytorch is None:
                    raise NmtError("this server decodes with CTranslate2, which takes no glossary: start it with the "
                                   "PyTorch model too (nmt serve MODEL_DIR --ct2 DIR), which translates with one")
                self.translator.term_ids([target for _, target in options["glossary"].pairs])
            except NmtError as e:
                raise BadRequest(400, str(e)) from None
        texts = inputs = sentences
        if "format" in options:  # malformed xml is the client's; the cost is that of the text the model reads
            try:
                self.translator.check_format(options["format"], options.get("nbest", 1))
                inputs = [self.translator.parse_markup(s, options["format"], i)  # parsed once: the model's call
                          for i, s in enumerate(sentences)]                         # takes them so
                texts = [m.text for m in inputs]
            except markup.MarkupError as e:  # numbered from 0, as the server numbers sentences
                raise BadRequest(400, f"sentence {e.index}: {e.reason}") from None
            except NmtError as e:
                raise BadRequest(400, str(e).replace("nbest (--nbest)", "'nbest'")) from None
        tokens = [len(ids) for ids in self.translator.tokenizer.encode_src(texts, leading_tags=False)]
        terms = [len(options["glossary"].targets_in(t)) for t in texts] if "glossary" in options else None
        return Job(inputs, {"batch_tokens": self.cfg.batch_tokens, **options}, tokens,
                   decoding_costs(self.translator, tokens, options, terms))

    def _check_cost(self, costs: list[int], options: dict, bound: str = "") -> None:
        """BadRequest 413 when the sentences' decoding costs pass --max-cost."""
        if sum(costs) > self.cfg.max_cost:
            self.batcher.stats.rejected_cost += 1
            raise BadRequest(413, f"the request's decoding cost is {bound}{sum(costs)} (sentences x beam x length "
                             f"limit x (1 + glossary terms held): {len(costs)} sentences, beam {options['beam_size']}"
                             f"); the limit is {self.cfg.max_cost}: send fewer or shorter sentences, a smaller beam or "
                             "max_new_tokens, fewer glossary terms")

    async def languages(self, request: Request) -> JSONResponse:
        return await libretranslate.languages(self, request)

    async def detect(self, request: Request) -> JSONResponse:
        """POST /detect, LibreTranslate's: a form or a JSON object with q."""
        body = await self.body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            data, _ = await self.fields(request, body)
        except BadRequest as e:
            return _error(e.status, str(e))
        return await libretranslate.detect(self, request, data, request.scope.get(KEY_CHECKED, True))

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "queued": sum(job.live for job in self.batcher.pending),
                             "in_flight": self.batcher.in_flight})

    async def show_info(self, request: Request) -> JSONResponse:
        return JSONResponse({"model": self.info, "backend": self.translator.backend, "server": self.cfg.public(),
                             "target_languages": self.translator.target_languages,  # [] for a model of one pair
                             "options": {key: str(SEARCH_RANGES[keyword]) for key, (keyword, _) in OPTIONS.items()}})

    async def page(self, request: Request) -> Response:
        return Response(PAGE, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def stats(self, request: Request) -> JSONResponse:
        return JSONResponse({**self.batcher.stats.as_dict(), "queued": sum(job.live for job in self.batcher.pending),
                             "in_flight": self.batcher.in_flight, "queued_cost": self.batcher.queued_cost})

    def begin_shutdown(self) -> None:
        """Take no new requests; give the ones in flight --shutdown-timeout seconds, then 503 (event loop thread)."""
        if self.deadline is None:
            self.batcher.stop_admitting()
            self.deadline = self.loop.time() + self.cfg.shutdown_timeout
            self.loop.call_later(self.cfg.shutdown_timeout, self.batcher.abandon)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.loop = asyncio.get_running_loop()
        self.batcher.start()
        yield
        self.begin_shutdown()  # uvicorn has waited for the open requests, up to its own bound
        self.prepare.shutdown(wait=False, cancel_futures=True)
        if not await self.batcher.close(max(0.0, self.deadline - self.loop.time())):
            self.abandoned_call = True
            print("nmt serve: the model call in progress is abandoned", file=sys.stderr, flush=True)
        if self.batcher.abandoned:
            print(f"nmt serve: gave up on {self.batcher.abandoned} request(s) after --shutdown-timeout "
                  f"{self.cfg.shutdown_timeout:g} s", file=sys.stderr, flush=True)

    @staticmethod
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405: JSON like the rest
        return JSONResponse({"error": f"{exc.detail}: {request.method} {request.url.path}"}, status_code=exc.status_code)

    @staticmethod
    async def server_error(request: Request, exc: Exception) -> JSONResponse:  # a defect: JSON all the same
        return _failed("internal error", exc)


KEY_CHECKED = "nmt.key_checked"  # in a request's scope: False where RequireKey found no right Bearer key


class RequireKey:
    """ASGI middleware: every request but GET /health, GET /languages (as LibreTranslate's) and the page (GET /,
    which holds no data and asks for the key) must carry `Authorization: Bearer KEY` (401 JSON otherwise). POST
    /translate and /detect without it go on marked (`KEY_CHECKED` False): LibreTranslate's clients send the key in
    the body as `api_key`, which their handlers check (nmt's own JSON still gets 401)."""

    MESSAGE = "missing or wrong API key: send 'Authorization: Bearer KEY'"
    BODY_KEY_ROUTES = ("/translate", "/detect")

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in ("/health", "/", "/languages"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                if scope["path"] in self.BODY_KEY_ROUTES and scope["method"] == "POST":
                    scope[KEY_CHECKED] = False
                else:
                    response = JSONResponse({"error": self.MESSAGE}, status_code=401,
                                            headers={"WWW-Authenticate": "Bearer"})
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class SameOrigin:
    """ASGI middleware against pages of other sites. On a loopback bind the Host header must name this machine
    (localhost, 127.0.0.1, [::1]): a site whose name an attacker points at 127.0.0.1 (DNS rebinding) is not served.
    A request with an Origin header (a browser sends one with every cross-site POST) must come from this server's
    own origin, the page's: another site's page cannot post to /translate, key or none. 403 JSON otherwise;
    clients that are no browser (curl, scripts) send no Origin."""

    LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")

    def __init__(self, app, loopback: bool):
        self.app, self.loopback = app, loopback

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            host = headers.get(b"host", b"").decode("latin-1").strip().lower()
            origin = headers.get(b"origin", b"").decode("latin-1").strip().lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if self.loopback and host and name not in self.LOOPBACK_NAMES:
                refused = f"Host {host!r} is not this server: it listens on loopback only (use http://127.0.0.1:PORT)"
            elif origin and origin.split("://", 1)[-1] != host:
                refused = f"requests from the page of {origin!r} are not served: only this server's own page may send them"
            else:
                refused = None
            if refused is not None:
                await JSONResponse({"error": refused}, status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(translator, cfg: ServeConfig, info: dict | None = None) -> Starlette:
    """The ASGI app: POST /translate (nmt's JSON, or LibreTranslate's: `nmt.tools.libretranslate`), GET / (the page),
    /health, /info, /stats, LibreTranslate's /languages and POST /detect; `app.state.api` is its Api."""
    if cfg.beam not in SEARCH_RANGES["beam_size"]:
        raise NmtError(f"flag '--beam': {cfg.beam} is outside the allowed range {SEARCH_RANGES['beam_size']}")
    api = Api(translator, cfg, info)
    app = Starlette(routes=[Route("/translate", api.translate, methods=["POST"]), Route("/", api.page),
                            Route("/health", api.health), Route("/languages", api.languages),
                            Route("/detect", api.detect, methods=["POST"]),
                            Route("/info", api.show_info), Route("/stats", api.stats)], lifespan=api.lifespan,
                    middleware=[Middleware(SameOrigin, loopback=is_loopback(cfg.host)),
                                *([Middleware(RequireKey, key=cfg.api_key)] if cfg.api_key else [])],
                    exception_handlers={HTTPException: api.http_error, Exception: api.server_error})
    app.state.api = api
    return app


def _jsonable(found: Translation, nbest: int, scores: bool, guarded: bool):
    """A translation as the request asked for it: a string; with scores {"text", "mean_logprob", "confidence"} (and
    with a guard "doubt": why it stays doubtful, "" when it is not); n-best a list of {"text", "score"} (with
    scores, and "mean_logprob", "confidence")."""
    def confidence(t: Translation) -> dict:
        return {"mean_logprob": t.mean_logprob, "confidence": t.confidence} if scores else {}
    if nbest > 1:
        return [{"text": t.text, "score": t.score, **confidence(t)} for t in found.nbest]
    if not scores:
        return found.text
    return {"text": found.text, **confidence(found), **({"doubt": found.doubt} if guarded else {})}


class _Server(uvicorn.Server):
    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            api = self.config.app.state.api
            print(f"nmt serve: stopping; {api.batcher.in_flight} request(s) in flight get up to "
                  f"{api.cfg.shutdown_timeout:g} s to finish", file=sys.stderr, flush=True)
            if api.loop is not None:
                api.loop.call_soon_threadsafe(api.begin_shutdown)
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise NmtError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or --host") from None
    sock.listen(2048)
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(translator, cfg: ServeConfig, info: dict | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C; both stop admitting, give the requests in flight --shutdown-timeout seconds,
    then return."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    app = build_app(translator, cfg, info)
    if not cfg.api_key and not is_loopback(cfg.host):
        print(f"nmt serve: warning: --host {cfg.host} is reachable beyond this machine and no API key is set: anyone "
              f"who reaches it can use it; set ${API_KEY_ENV} (or --api-key)", file=sys.stderr, flush=True)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    server = _Server(uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on",
        http=uvicorn_protocol_with_header_deadline(cfg.request_timeout), limit_concurrency=cfg.max_connections,
        timeout_keep_alive=cfg.keep_alive,
        timeout_graceful_shutdown=cfg.shutdown_timeout + 1))  # a backstop: Api.begin_shutdown answers them first
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    print(f"nmt serve: listening on http://{address} (POST /translate /detect, GET / /health /info /stats "
          "/languages)", flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down; a quiet handler makes that a normal return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    print("nmt serve: stopped", file=sys.stderr, flush=True)
    if app.state.api.abandoned_call:
        # the model thread is inside torch: interpreter shutdown under it aborts the process; end it here instead
        sys.stdout.flush()
        os._exit(0)
