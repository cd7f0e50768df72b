"""Dynamic batching of concurrent translation requests for `nmt serve`, and its limits (asyncio; no web framework).

Requests wait in a bounded queue. One worker thread runs the model; whenever it is free, it takes the
oldest request and every queued request with the same decoding options that fits in the token budget,
and translates them as one call of `Translator.translate`, so concurrent clients share batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from functools import partial

from nmt.ranges import RANGE, Range, check_fields

log = logging.getLogger(__name__)


def _flag(default, help_: str, allowed: str | None = None):
    """A ServeConfig field that `nmt serve` offers as --NAME with this help, numbers within `allowed`."""
    return field(default=default, metadata={"help": help_, **({RANGE: Range(allowed)} if allowed else {})})


@dataclass
class ServeConfig:
    """The server's limits; `nmt serve --help` shows each as a flag."""

    host: str = _flag("127.0.0.1", "the address to listen on (127.0.0.1: this machine only)")
    port: int = _flag(8080, "0: any free port (the one chosen is printed)", "[0, 65535]")
    batch_tokens: int = _flag(4096, "source tokens per model call, shared by concurrent requests", "[1, 1e9]")
    max_queue: int = _flag(64, "requests waiting for the model; one more gets HTTP 429", "[1, 1e6]")
    max_wait_ms: float = _flag(2.0, "how long a free worker waits for more requests before it starts a batch",
                               "[0, 6e4]")
    batching: bool = True  # --no-batching: every request runs alone (a baseline for benchmarks/serve_load.py)
    max_body_bytes: int = _flag(1 << 20, "a larger request body gets HTTP 413", "[1, 1e10]")
    max_sentences: int = _flag(256, "a request with more sentences gets HTTP 413", "[1, 1e6]")
    timeout: float = _flag(60.0, "seconds a request may wait for its translations (HTTP 504 after), and the most "
                           "a request may ask for", "(0, 86400]")
    beam: int = _flag(4, "the beam size of requests that do not give one", "[1, 1000]")
    threads: int = _flag(0, "torch threads of the model (0: torch's default)", "[0, 4096]")

    @classmethod
    def add_flags(cls, parser) -> None:
        """--no-batching and a --NAME flag per documented field, on an argparse parser (`nmt serve`)."""
        from nmt.validate import Number

        parser.add_argument("--no-batching", dest="batching", action="store_false",
                            help="run every request alone (a baseline; by default concurrent requests share batches)")
        for f in fields(cls):
            if "help" in f.metadata:
                kind = Number(type(f.default), str(f.metadata[RANGE])) if RANGE in f.metadata else None
                parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default,
                                    help=f"{f.metadata['help']} (default: {f.default})")

    def __post_init__(self):
        check_fields(self, "--", noun="flag")


class QueueFull(Exception):
    """The queue holds `max_queue` requests already (HTTP 429)."""


class Stopping(Exception):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass
class Job:
    """One request: its sentences, decoding options (Translator.translate keywords) and source tokens."""

    texts: list[str]
    options: dict
    tokens: int
    future: asyncio.Future = field(default=None)
    batch: dict = field(default_factory=dict)  # filled when it ran: {"requests": n, "sentences": m}

    @property
    def key(self) -> tuple:
        return tuple(sorted(self.options.items()))


@dataclass
class BatcherStats:
    """What the server reports on GET /stats."""

    requests: int = 0  # requests answered by the model
    batches: int = 0
    requests_per_batch: Counter = field(default_factory=Counter)  # batch size in requests -> how many batches
    sentences_per_batch: Counter = field(default_factory=Counter)
    rejected_full: int = 0  # 429
    timed_out: int = 0  # 504
    failed: int = 0  # requests whose batch raised

    def as_dict(self) -> dict:
        return {"requests": self.requests, "batches": self.batches,
                "requests_per_batch": {str(k): v for k, v in sorted(self.requests_per_batch.items())},
                "sentences_per_batch": {str(k): v for k, v in sorted(self.sentences_per_batch.items())},
                "max_requests_per_batch": max(self.requests_per_batch, default=0),
                "rejected_queue_full": self.rejected_full, "timed_out": self.timed_out, "failed": self.failed}


class Batcher:
    """Queues requests and runs them on `translate(texts, **options)` in batches of at most `max_tokens`
    source tokens (a request larger than that runs alone). With `batching=False` each request runs alone
    (the baseline of benchmarks/serve_load.py). `max_wait` seconds: how long a free worker waits for more
    requests to arrive before it starts a batch."""

    def __init__(self, translate, max_tokens: int = 4096, max_queue: int = 64, max_wait: float = 0.002,
                 batching: bool = True):
        self.translate, self.max_tokens, self.max_queue = translate, max_tokens, max_queue
        self.max_wait, self.batching = max_wait, batching
        self.pending: deque[Job] = deque()
        self.stats = BatcherStats()
        self.running = 0  # requests inside the model now
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nmt-model")

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet answered (queued or running)."""
        return len(self.pending) + self.running

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        """Take no new requests; finish the queued and running ones; stop the worker."""
        self._closing = True
        if self._task is not None:
            self._wake.set()
            await self._task
        self._pool.shutdown(wait=True)

    def submit(self, job: Job) -> asyncio.Future:
        """Queue a request; its future gives the list of outputs (raises QueueFull or Stopping)."""
        if self._closing:
            raise Stopping("the server is shutting down")
        if len(self.pending) >= self.max_queue:  # requests that timed out while queued free their places
            self.pending = deque(job for job in self.pending if not job.future.done())
        if len(self.pending) >= self.max_queue:
            self.stats.rejected_full += 1
            raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry later")
        job.future = asyncio.get_running_loop().create_future()
        self.pending.append(job)
        self._wake.set()
        return job.future

    async def _loop(self) -> None:
        while self.pending or not self._closing:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.batching and self.max_wait > 0 and sum(job.tokens for job in self.pending) < self.max_tokens:
                await asyncio.sleep(self.max_wait)  # let requests sent at the same moment join this batch
            batch = self._take()
            if batch:
                await self._run(batch)

    def _take(self) -> list[Job]:
        """The oldest live request and, when batching, the queued ones with its options that fit the budget."""
        while self.pending and self.pending[0].future.done():  # timed out while waiting
            self.pending.popleft()
        if not self.pending:
            return []
        first = self.pending.popleft()
        batch, tokens = [first], first.tokens
        if self.batching:
            for job in list(self.pending):
                if job.key == first.key and not job.future.done() and tokens + job.tokens <= self.max_tokens:
                    batch.append(job)
                    tokens += job.tokens
                    self.pending.remove(job)
        return batch

    async def _run(self, batch: list[Job]) -> None:
        texts = [t for job in batch for t in job.texts]
        self.running = len(batch)
        try:
            outputs = await asyncio.get_running_loop().run_in_executor(
                self._pool, partial(self.translate, texts, **batch[0].options))
        except Exception as e:  # noqa: BLE001 - reported to the request that caused it, the server goes on
            self.running = 0
            if len(batch) > 1:  # one request's sentences must not fail the others: each runs alone
                log.warning("a batch of %d requests failed (%s); running them one by one", len(batch), e)
                for job in batch:
                    await self._run([job])
                return
            log.warning("a request of %d sentences failed: %s", len(texts), e)
            self.stats.failed += 1
            if not batch[0].future.done():
                batch[0].future.set_exception(e)
            return
        self.running = 0
        self._record(batch, len(texts))
        start = 0
        for job in batch:
            job.batch = {"requests": len(batch), "sentences": len(texts)}
            if not job.future.done():
                job.future.set_result(outputs[start: start + len(job.texts)])
            start += len(job.texts)

    def _record(self, batch: list[Job], sentences: int) -> None:
        self.stats.requests += len(batch)
        self.stats.batches += 1
        self.stats.requests_per_batch[len(batch)] += 1
        self.stats.sentences_per_batch[sentences] += 1
