"""Dynamic batching of concurrent translation requests for `nmt serve`, and its limits (asyncio; no web framework).

Requests wait in a bounded queue (bounded in requests and in decoding cost). One worker runs the model, a call at
a time; whenever it is free, it takes the oldest request and every queued request with the same decoding options
that fits one call's budget, and translates them together, so concurrent clients share batches. Requests whose
clients gave up are left out before each call.

A module apart from `serve` (starlette, uvicorn, torch): `ServeConfig` makes `nmt serve`'s flags, which `nmt --help`
builds without loading torch and without the serve extra installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from functools import partial

from nmt.config import RANGE, Range, check_fields
from nmt.errors import NmtError

log = logging.getLogger(__name__)


def _flag(default, help_: str, allowed: str | None = None):
    """A ServeConfig field that `nmt serve` offers as --NAME with this help, numbers within `allowed`: an interval,
    or "module:Class.field" to take that dataclass field's interval (the one home of the number)."""
    meta = {} if allowed is None else {RANGE: Range(allowed)} if allowed[:1] in "[(" else {RANGE_OF: allowed}
    return field(default=default, metadata={"help": help_, **meta})


RANGE_OF = "range_of"  # metadata: "module:Class.field" whose interval a field shares, looked up when a value is parsed
API_KEY_ENV = "NMT_API_KEY"  # where `nmt serve` reads the API key when --api-key is not given


@dataclass
class ServeConfig:
    """The server's limits; `nmt serve --help` shows each as a flag."""

    host: str = _flag("127.0.0.1", "the address to listen on (127.0.0.1: this machine only)")
    port: int = _flag(8080, "0: any free port (the one chosen is printed)", "[0, 65535]")
    batch_tokens: int = _flag(4096, "source tokens per model call, shared by concurrent requests", "[1, 1e9]")
    batch_cost: int = _flag(1 << 15, "decoding cost per model call (see --max-cost); between calls the server drops "
                            "the requests whose clients left", "[1, 1e12]")
    max_queue: int = _flag(64, "requests waiting for the model; one more gets HTTP 429", "[1, 1e6]")
    max_wait_ms: float = _flag(2.0, "how long a free worker waits for more requests before it starts a batch",
                               "[0, 6e4]")
    batching: bool = True  # --no-batching: every request runs alone (a baseline for benchmarks/serve_load.py)
    max_body_bytes: int = _flag(1 << 20, "a larger request body gets HTTP 413", "[1, 1e10]")
    max_sentences: int = _flag(256, "a request with more sentences gets HTTP 413", "[1, 1e6]")
    max_chars: int = _flag(4096, "characters a sentence may have, before and after NFKC normalisation (as the "
                           "tokenizer reads it); a longer one gets HTTP 413", "[1, 1e7]")
    max_cost: int = _flag(1 << 17, "decoding cost a request may ask for: the sum over its sentences of beam x length "
                          "limit (the output tokens each may get); more gets HTTP 413", "[1, 1e12]")
    max_queued_cost: int = _flag(1 << 20, "decoding cost waiting for the model; a request that would pass it gets "
                                 "HTTP 429", "[1, 1e12]")
    timeout: float = _flag(60.0, "seconds a request may wait for its translations (HTTP 504 after), and the most "
                           "a request may ask for", "(0, 86400]")
    request_timeout: float = _flag(10.0, "seconds a client has to send a request's headers and body; a slower one "
                                   "gets HTTP 408 or a closed connection", "(0, 3600]")
    keep_alive: float = _flag(5.0, "seconds an idle connection stays open for its next request", "(0, 3600]")
    max_connections: int = _flag(256, "open connections and requests at once; past them HTTP 503", "[1, 1e6]")
    shutdown_timeout: float = _flag(10.0, "on SIGTERM or Ctrl-C: seconds the requests in flight get to finish; the "
                                    "rest get HTTP 503 and the server exits", "[0, 86400]")
    beam: int = _flag(4, "the beam size of requests that do not give one", "nmt.decoding:SearchConfig.beam_size")
    guard: bool = False  # --guard: requests that do not say "guard": false are checked (nmt.guard)
    threads: int = _flag(0, "torch threads of the model (0: torch's default)", "[0, 4096]")
    api_key: str | None = field(default=None, repr=False)  # --api-key or $NMT_API_KEY; never shown by GET /info

    @classmethod
    def add_flags(cls, parser) -> None:
        """--no-batching, --api-key and a --NAME flag per documented field, on an argparse parser (`nmt serve`)."""
        from nmt.validate import Number

        parser.add_argument("--no-batching", dest="batching", action="store_false",
                            help="run every request alone (a baseline; by default concurrent requests share batches)")
        parser.add_argument("--api-key", default=None,
                            help=f"requests other than GET /health must send 'Authorization: Bearer KEY' (HTTP 401 "
                            f"otherwise); default: ${API_KEY_ENV}, which other users cannot read in `ps`")
        parser.add_argument("--guard", action="store_true",
                            help="check every translation for loops and another language than the target and search "
                            "again for those flagged (nmt.guard), unless a request says \"guard\": false")
        for f in fields(cls):
            if "help" in f.metadata:
                allowed = f.metadata.get(RANGE) or f.metadata.get(RANGE_OF)
                kind = Number(type(f.default), str(allowed)) if allowed else None
                parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default,
                                    help=f"{f.metadata['help']} (default: {f.default})")

    def __post_init__(self):
        check_fields(self, "--", noun="flag")
        if self.max_queued_cost < self.max_cost:
            raise NmtError(f"flag '--max-queued-cost' ({self.max_queued_cost}) must be at least --max-cost "
                           f"({self.max_cost}): a request the server admits must fit in its queue")
        if self.api_key is not None and not self.api_key.strip():
            raise NmtError(f"flag '--api-key' (or ${API_KEY_ENV}) is empty; give a key or leave it unset")

    def public(self) -> dict:
        """The limits as GET /info shows them: no key."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "api_key"}


class QueueFull(Exception):
    """The queue holds `max_queue` requests, or as much decoding cost as it may (HTTP 429)."""


class BadRequest(Exception):
    """A request the server refuses: its HTTP status (400, 413, ...) and a message that names what is wrong."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def check_sentences(sentences: list[str], cfg: ServeConfig) -> None:
    """BadRequest 413 past --max-sentences, or at a sentence over --max-chars characters; 400 at one that is no
    valid Unicode (a lone surrogate, which JSON can carry)."""
    if len(sentences) > cfg.max_sentences:
        raise BadRequest(413, f"{len(sentences)} sentences in one request; the limit is {cfg.max_sentences}")
    for i, s in enumerate(sentences):
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(400, f"sentence {i} is not valid Unicode (a lone surrogate at character {e.start})") \
                from None
        if len(s) > cfg.max_chars:  # the bound holds before NFKC too: its work grows with what it reads and writes
            raise BadRequest(413, f"sentence {i} has {len(s)} characters; the limit is {cfg.max_chars} per sentence")


class Stopping(Exception):
    """The server is shutting down and takes no new requests, or gave up on this one (HTTP 503)."""


@dataclass
class Job:
    """One request: its sentences, decoding options (Translator.translations keywords) and, per sentence, its
    source tokens and its decoding cost (beam x length limit)."""

    texts: list  # the sentences as `translate` takes them: strings, or `markup.Marked` the server parsed
    options: dict
    tokens: list[int]
    costs: list[int]
    future: asyncio.Future = field(default=None)
    batch: dict = field(default_factory=dict)  # filled when it ran: {"requests": n, "sentences": m}

    @property
    def key(self) -> tuple:
        return tuple(sorted(self.options.items()))

    @property
    def cost(self) -> int:
        return sum(self.costs)

    @property
    def live(self) -> bool:
        """Someone still waits for it: not answered, failed, timed out or given up by its client."""
        return not self.future.done()


@dataclass
class BatcherStats:
    """What the server reports on GET /stats."""

    requests: int = 0  # requests answered by the model
    batches: int = 0
    model_calls: int = 0  # translate calls; a batch over the per-call budget takes several
    sentences_decoded: int = 0
    requests_per_batch: Counter = field(default_factory=Counter)  # batch size in requests -> how many batches
    sentences_per_batch: Counter = field(default_factory=Counter)
    rejected_full: int = 0  # 429
    rejected_cost: int = 0  # 413: one request over --max-cost
    timed_out: int = 0  # 504
    disconnected: int = 0  # clients that left before their answer
    dropped: int = 0  # requests given up before or while they ran (timed out, client gone, shutdown): not decoded
    failed: int = 0  # requests whose batch raised
    stopped: int = 0  # model calls stopped mid-search: every request in them had been given up

    def as_dict(self) -> dict:
        return {"requests": self.requests, "batches": self.batches, "model_calls": self.model_calls,
                "sentences_decoded": self.sentences_decoded,
                "requests_per_batch": {str(k): v for k, v in sorted(self.requests_per_batch.items())},
                "sentences_per_batch": {str(k): v for k, v in sorted(self.sentences_per_batch.items())},
                "max_requests_per_batch": max(self.requests_per_batch, default=0),
                "rejected_queue_full": self.rejected_full, "rejected_cost": self.rejected_cost,
                "timed_out": self.timed_out, "disconnected": self.disconnected, "dropped": self.dropped,
                "failed": self.failed, "stopped_calls": self.stopped}


class Batcher:
    """Queues requests and runs them on `translate(texts, **options)`, concurrent requests with the same options
    together. A batch is as many queued requests as fit one model call: at most `max_tokens` source tokens and
    `max_cost` decoding cost (a larger request runs alone, over several calls). Before each call the sentences
    of requests nobody waits for any more are left out, so a client that timed out or left stops costing work
    at the next call. With `batching=False` each request runs alone (the baseline of benchmarks/serve_load.py).
    `max_wait` seconds: how long a free worker waits for more requests to arrive before it starts a batch.
    The model runs in a daemon thread, so a shutdown that gives up on a call in progress need not wait for it.
    With `cancellable`, `translate` also takes `cancelled=` (a function it asks as it goes, `Translator.translations`'s):
    a call whose requests have all been given up stops there, its model thread free for the next."""

    def __init__(self, translate, max_tokens: int = 4096, max_queue: int = 64, max_wait: float = 0.002,
                 batching: bool = True, max_cost: int = 1 << 15, max_queued_cost: int = 1 << 20,
                 cancellable: bool = False):
        self.translate, self.max_tokens, self.max_queue = translate, max_tokens, max_queue
        self.cancellable = cancellable
        self.max_wait, self.batching = max_wait, batching
        self.max_cost, self.max_queued_cost = max_cost, max_queued_cost
        self.pending: deque[Job] = deque()
        self.stats = BatcherStats()
        self.current: list[Job] = []  # the batch inside the model now
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closing = False
        self.abandoned = 0  # requests given up by abandon()

    @property
    def running(self) -> int:
        """Requests of the batch inside the model that someone still waits for."""
        return sum(job.live for job in self.current)

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet answered (queued or running)."""
        return sum(job.live for job in self.pending) + self.running

    @property
    def queued_cost(self) -> int:
        return sum(job.cost for job in self.pending if job.live)

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop_admitting(self) -> None:
        """New requests get Stopping; the queued and running ones go on."""
        self._closing = True
        if self._wake is not None:
            self._wake.set()

    def abandon(self) -> None:
        """Give up on every request in flight (each gets Stopping); the call in progress, if any, is the last."""
        self.stop_admitting()
        for job in [*self.pending, *self.current]:
            if job.live:
                self.stats.dropped += 1
                self.abandoned += 1
                job.future.set_exception(Stopping("the server is shutting down; it gave up on this request"))
        self.pending.clear()

    async def close(self, wait: float | None = None) -> bool:
        """Take no new requests, finish the queued and running ones and stop the worker; after `wait` seconds
        give up on them (they get Stopping) and return False without waiting for the model call in progress."""
        self.stop_admitting()
        if self._task is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), wait)
            return True
        except asyncio.TimeoutError:
            self.abandon()
            self._task.cancel()
            return False

    def submit(self, job: Job) -> asyncio.Future:
        """Queue a request; its future gives the list of outputs (raises QueueFull or Stopping)."""
        if self._closing:
            raise Stopping("the server is shutting down")
        self.pending = deque(job for job in self.pending if job.live)  # requests given up free their places
        if len(self.pending) >= self.max_queue:
            self.stats.rejected_full += 1
            raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry later")
        queued = self.queued_cost
        if queued + job.cost > self.max_queued_cost:
            self.stats.rejected_full += 1
            raise QueueFull(f"the queue is full: the requests waiting hold decoding cost {queued} and this one "
                            f"{job.cost}, over the limit of {self.max_queued_cost}; retry later")
        job.future = asyncio.get_running_loop().create_future()
        self.pending.append(job)
        self._wake.set()
        return job.future

    def cancel(self, job: Job, reason: str) -> None:
        """The client of `job` gave up (reason: "timed_out" or "disconnected"): it is not run, or not run further."""
        if job.future is not None and job.live:
            job.future.cancel()
            self.stats.dropped += 1
        setattr(self.stats, reason, getattr(self.stats, reason) + 1)

    async def _loop(self) -> None:
        while self.pending or not self._closing:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            live = [job for job in self.pending if job.live]
            if (self.batching and self.max_wait > 0 and not self._closing
                    and sum(sum(job.tokens) for job in live) < self.max_tokens
                    and sum(job.cost for job in live) < self.max_cost):
                await asyncio.sleep(self.max_wait)  # let requests sent at the same moment join this batch
            batch = self._take()
            if batch:
                self.current = batch
                try:
                    await self._run(batch)
                finally:
                    self.current = []

    def _take(self) -> list[Job]:
        """The oldest live request and, when batching, the queued ones with its options that fit one call."""
        while self.pending and not self.pending[0].live:
            self.pending.popleft()
        if not self.pending:
            return []
        first = self.pending.popleft()
        batch, tokens, cost = [first], sum(first.tokens), first.cost
        if self.batching:
            for job in list(self.pending):
                if (job.key == first.key and job.live and tokens + sum(job.tokens) <= self.max_tokens
                        and cost + job.cost <= self.max_cost):
                    batch.append(job)
                    tokens += sum(job.tokens)
                    cost += job.cost
                    self.pending.remove(job)
        return batch

    def _calls(self, batch: list[Job]) -> list[list[tuple[Job, int]]]:
        """The batch's sentences as (job, index), sorted by length (less padding), cut into model calls."""
        items = sorted(((job, i) for job in batch for i in range(len(job.texts))), key=lambda item: item[0].tokens[item[1]])
        calls, call, tokens, cost = [], [], 0, 0
        for job, i in items:
            if call and (tokens + job.tokens[i] > self.max_tokens or cost + job.costs[i] > self.max_cost):
                calls.append(call)
                call, tokens, cost = [], 0, 0
            call.append((job, i))
            tokens += job.tokens[i]
            cost += job.costs[i]
        return [*calls, call] if call else calls

    async def _run(self, batch: list[Job]) -> None:
        outputs = {id(job): [None] * len(job.texts) for job in batch}
        left = {id(job): len(job.texts) for job in batch}
        sentences = sum(len(job.texts) for job in batch)
        self.stats.batches += 1
        self.stats.requests_per_batch[len(batch)] += 1
        self.stats.sentences_per_batch[sentences] += 1
        for job in batch:
            job.batch = {"requests": len(batch), "sentences": sentences}
        for call in self._calls(batch):
            call = [(job, i) for job, i in call if job.live]  # nobody waits for the others any more
            if not call:
                continue
            try:
                found = await self._call(call)
            except Exception as e:  # noqa: BLE001 - reported to the request that caused it, the server goes on
                jobs = list({id(job): job for job, _ in call}.values())
                if not any(job.live for job in jobs):  # stopped (or failed) with nobody waiting: nothing to report
                    self.stats.stopped += 1
                    continue
                if len(jobs) == 1:
                    log.warning("a request of %d sentences failed: %s", len(jobs[0].texts), e)
                    self._fail(jobs[0], e)
                    continue
                # one request's sentences must not fail the others: each runs alone
                log.warning("a call for %d requests failed (%s); running them one by one", len(jobs), e)
                found = []
                for job in jobs:
                    mine = [(j, i) for j, i in call if j is job]
                    try:
                        found += zip(mine, await self._call(mine))
                    except Exception as e:  # noqa: BLE001
                        log.warning("a request of %d sentences failed: %s", len(job.texts), e)
                        self._fail(job, e)
                call, found = [item for item, _ in found], [out for _, out in found]
            for (job, i), out in zip(call, found):
                outputs[id(job)][i] = out
                left[id(job)] -= 1
                if not left[id(job)] and job.live:  # answered as soon as its last sentence is done
                    self.stats.requests += 1
                    job.future.set_result(outputs[id(job)])

    async def _call(self, call: list[tuple[Job, int]]) -> list:
        """One translate call in a daemon thread, the event loop free meanwhile."""
        texts = [job.texts[i] for job, i in call]
        self.stats.model_calls += 1
        self.stats.sentences_decoded += len(texts)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        jobs = list({id(job): job for job, _ in call}.values())
        cancelled = {"cancelled": lambda: not any(job.live for job in jobs)} if self.cancellable else {}
        work = partial(self.translate, texts, **call[0][0].options, **cancelled)

        def settle(ok: bool, value) -> None:
            if not done.done():
                (done.set_result if ok else done.set_exception)(value)

        def run() -> None:
            try:
                result = (True, work())
            except Exception as e:  # noqa: BLE001 - handed to the event loop, which decides
                result = (False, e)
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server gave up on this call
                loop.call_soon_threadsafe(settle, *result)

        threading.Thread(target=run, name="nmt-model", daemon=True).start()
        return await done

    def _fail(self, job: Job, error: Exception) -> None:
        self.stats.failed += 1
        if job.live:
            job.future.set_exception(error)
