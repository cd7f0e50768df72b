"""`nmt serve`: an HTTP JSON API over a model directory (Starlette app, served by uvicorn).

POST /translate {"sentences": [...], "beam": 4, ...} -> {"translations": [...], "batch": {...}}
GET /health, GET /info (the model, as `nmt info --json`, and the server's limits), GET /stats (batch sizes).
Concurrent requests are batched by `nmt.request_batcher.Batcher`; the one home of starlette and uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
from dataclasses import asdict

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from nmt.errors import NmtError
from nmt.request_batcher import Batcher, Job, QueueFull, ServeConfig, Stopping

log = logging.getLogger(__name__)


# Request options: JSON key -> (Translator.translate keyword, type, smallest, largest).
OPTIONS = {"beam": ("beam_size", int, 1, 64), "alpha": ("alpha", float, 0.0, 10.0), "nbest": ("nbest", int, 1, 64),
           "max_new_tokens": ("max_new_tokens", int, 1, 4096)}


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(body: bytes, cfg: ServeConfig) -> tuple[list[str], dict, float]:
    """A request body -> (sentences, Translator.translate keywords, timeout in seconds); BadRequest names the field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(400, f"the body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequest(400, 'the body must be a JSON object like {"sentences": ["Hello."]}')
    unknown = sorted(set(data) - {"sentences", "timeout", *OPTIONS})
    if unknown:
        raise BadRequest(400, f"unknown field {unknown[0]!r}; known: sentences, timeout, {', '.join(OPTIONS)}")
    sentences = data.get("sentences")
    if not isinstance(sentences, list) or not sentences or not all(isinstance(s, str) for s in sentences):
        raise BadRequest(400, "'sentences' must be a non-empty list of strings")
    if len(sentences) > cfg.max_sentences:
        raise BadRequest(413, f"{len(sentences)} sentences in one request; the limit is {cfg.max_sentences}")
    options = {"beam_size": cfg.beam}
    for key, (keyword, kind, lo, hi) in OPTIONS.items():
        if key in data:
            options[keyword] = _number(data[key], key, kind, lo, hi)
    if options.get("nbest", 1) > options["beam_size"]:
        raise BadRequest(400, f"'nbest' ({options['nbest']}) cannot exceed 'beam' ({options['beam_size']})")
    timeout = _number(data.get("timeout", cfg.timeout), "timeout", float, 0.001, cfg.timeout)
    return [s.replace("\n", " ") for s in sentences], options, timeout


def _number(value, key: str, kind: type, lo: float, hi: float):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(400, f"{key!r} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not lo <= value <= hi:
        raise BadRequest(400, f"{key!r} must be between {lo} and {hi}, got {value}")
    return kind(value)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length, or while reading a chunked one)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, f"the body has {declared} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BadRequest(413, f"the body is over the limit of {limit} bytes")
    return bytes(body)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers={"Retry-After": "1"} if status == 429 else None)


class Api:
    """The routes' handlers over one Batcher that calls `translator.translate`."""

    def __init__(self, translator, cfg: ServeConfig, info: dict | None = None):
        self.translator, self.cfg, self.info = translator, cfg, info or {}
        self.batcher = Batcher(translator.translate, cfg.batch_tokens, cfg.max_queue, cfg.max_wait_ms / 1000,
                               cfg.batching)

    async def translate(self, request: Request) -> JSONResponse:
        try:
            sentences, options, timeout = parse_request(await read_body(request, self.cfg.max_body_bytes), self.cfg)
            tokens = sum(len(ids) for ids in self.translator.tokenizer.encode_src(sentences))
            job = Job(sentences, {"batch_tokens": self.cfg.batch_tokens, **options}, tokens)
            future = self.batcher.submit(job)
        except BadRequest as e:
            return _error(e.status, str(e))
        except QueueFull as e:
            return _error(429, str(e))
        except Stopping as e:
            return _error(503, str(e))
        try:
            outputs = await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            future.cancel()  # the batcher skips it if it has not started
            self.batcher.stats.timed_out += 1
            return _error(504, f"no translation within the request's timeout of {timeout:g} s")
        except Exception as e:  # noqa: BLE001 - the model failed on this request: the client learns why
            return _error(500, f"translation failed: {e}")
        return JSONResponse({"translations": [_jsonable(o) for o in outputs], "batch": job.batch})

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "queued": len(self.batcher.pending), "in_flight": self.batcher.in_flight})

    async def show_info(self, request: Request) -> JSONResponse:
        return JSONResponse({"model": self.info, "backend": self.translator.backend, "server": asdict(self.cfg),
                             "options": list(OPTIONS)})

    async def stats(self, request: Request) -> JSONResponse:
        return JSONResponse({**self.batcher.stats.as_dict(), "queued": len(self.batcher.pending),
                             "in_flight": self.batcher.in_flight})

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.batcher.start()
        yield
        await self.batcher.close()  # uvicorn has let the open requests finish; the queue is empty by now

    @staticmethod
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405: JSON like the rest
        return JSONResponse({"error": f"{exc.detail}: {request.method} {request.url.path}"}, status_code=exc.status_code)


def build_app(translator, cfg: ServeConfig, info: dict | None = None) -> Starlette:
    """The ASGI app: POST /translate, GET /health /info /stats; `app.state.batcher` is its Batcher."""
    api = Api(translator, cfg, info)
    app = Starlette(routes=[Route("/translate", api.translate, methods=["POST"]), Route("/health", api.health),
                            Route("/info", api.show_info), Route("/stats", api.stats)], lifespan=api.lifespan,
                    exception_handlers={HTTPException: api.http_error})
    app.state.batcher = api.batcher
    return app


def _jsonable(output):
    return output if isinstance(output, str) else [{"text": t, "score": s} for t, s in output]


class _Server(uvicorn.Server):
    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            batcher = self.config.app.state.batcher
            print(f"nmt serve: stopping; {batcher.in_flight} request(s) in flight finish first", file=sys.stderr,
                  flush=True)
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


def serve(translator, cfg: ServeConfig, info: dict | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C; both let the requests in flight finish, then return."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    app = build_app(translator, cfg, info)
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=cfg.timeout
                                    + 5, lifespan="on"))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    print(f"nmt serve: listening on http://{address} (POST /translate, GET /health /info /stats)", flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down; a quiet handler makes that a normal return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    print("nmt serve: stopped", file=sys.stderr, flush=True)
