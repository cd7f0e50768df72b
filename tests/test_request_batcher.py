"""The server's dynamic batching without HTTP: which requests share a model call, limits, failures."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from nmt.errors import NmtError
from nmt.tools.request_batcher import Batcher, Job, QueueFull, ServeConfig, Stopping


def job(texts: list[str], options: dict | None = None, tokens: int = 1, cost: int = 1) -> Job:
    """A request of `texts`, each sentence `tokens` source tokens and `cost` decoding cost."""
    return Job(texts, options or {}, [tokens] * len(texts), [cost] * len(texts))


def run_jobs(jobs: list[Job], **batcher_kwargs) -> tuple[list, list]:
    """Submit all jobs at once; (each job's outputs or exception, the model calls as (texts, options))."""
    calls = []

    def translate(texts, **options):
        calls.append((list(texts), options))
        if any("POISON" in t for t in texts):
            raise RuntimeError("simulated failure")
        return [t.upper() for t in texts]

    async def main():
        batcher = Batcher(translate, **batcher_kwargs)
        batcher.start()
        futures = [batcher.submit(job) for job in jobs]
        results = await asyncio.gather(*futures, return_exceptions=True)
        await batcher.close()
        return results

    return asyncio.run(main()), calls


def test_requests_with_the_same_options_share_a_call_within_the_token_budget():
    jobs = [job(["a"], {"beam_size": 1}, 2), job(["b"], {"beam_size": 2}, 2), job(["c", "cc"], {"beam_size": 1}, 1),
            job(["d"], {"beam_size": 1}, 2)]
    results, calls = run_jobs(jobs, max_tokens=5, max_wait=0.05)
    assert results == [["A"], ["B"], ["C", "CC"], ["D"]]  # each request gets its own outputs back, in order
    # one call per batch, its sentences sorted by length
    assert calls == [(["c", "cc", "a"], {"beam_size": 1}), (["b"], {"beam_size": 2}), (["d"], {"beam_size": 1})]
    assert [job.batch["requests"] for job in jobs] == [2, 1, 2, 1]


def test_without_batching_every_request_runs_alone():
    results, calls = run_jobs([job([t]) for t in "abc"], batching=False)
    assert results == [["A"], ["B"], ["C"]] and [texts for texts, _ in calls] == [["a"], ["b"], ["c"]]


def test_a_failing_request_does_not_fail_the_others_of_its_batch():
    results, calls = run_jobs([job(["a"]), job(["POISON"]), job(["c"])], max_wait=0.05)
    assert results[0] == ["A"] and isinstance(results[1], RuntimeError) and results[2] == ["C"]
    assert calls[0][0] == ["a", "POISON", "c"]  # tried together, then one by one


def test_a_full_queue_refuses_by_count_and_by_decoding_cost():
    async def main():
        batcher = Batcher(lambda texts: texts, max_queue=2, max_wait=1.0)
        batcher.start()
        batcher.submit(job(["a"]))
        batcher.submit(job(["b"]))
        with pytest.raises(QueueFull, match="2 requests waiting"):
            batcher.submit(job(["c"]))
        assert batcher.stats.rejected_full == 1
        await batcher.close()
        batcher = Batcher(lambda texts: texts, max_queue=10, max_wait=1.0, max_cost=100, max_queued_cost=100)
        batcher.start()
        batcher.submit(job(["a", "b"], cost=30))
        with pytest.raises(QueueFull, match="hold decoding cost 60 and this one 50, over the limit of 100"):
            batcher.submit(job(["c"], cost=50))
        batcher.submit(job(["c"], cost=40))  # fits
        await batcher.close()

    asyncio.run(main())


def test_requests_given_up_are_not_run_and_a_running_one_stops_at_the_next_call():
    calls = []

    async def main():
        def translate(texts, **options):
            calls.append(list(texts))
            time.sleep(0.05)
            return texts

        batcher = Batcher(translate, max_tokens=2, max_wait=0.2)
        batcher.start()
        queued, kept = job(["a", "b"]), job(["c"])
        big = job([f"s{i:02d}" for i in range(40)], {"beam_size": 2})  # alone: 20 calls of 2 sentences
        for j in (queued, kept, big):
            batcher.submit(j)
        batcher.cancel(queued, "disconnected")  # its client left while it waited
        assert await kept.future == ["c"]
        while batcher.stats.model_calls < 3:
            await asyncio.sleep(0.01)
        batcher.cancel(big, "timed_out")
        await batcher.close()
        return batcher.stats

    stats = asyncio.run(main())
    assert calls[0] == ["c"] and ["a", "b"] not in calls  # the queued request of a gone client never ran
    assert 3 <= len(calls) <= 5 and stats.sentences_decoded == 1 + 2 * (len(calls) - 1), calls  # big stopped early
    assert (stats.dropped, stats.disconnected, stats.timed_out, stats.requests) == (2, 1, 1, 1)


def test_closing_with_a_deadline_gives_up_on_a_model_call_that_does_not_end():
    release = threading.Event()

    async def main():
        batcher = Batcher(lambda texts, **options: release.wait(30) and texts, max_wait=0)
        batcher.start()
        running, queued = job(["a"], {"beam_size": 1}), job(["b"], {"beam_size": 2})
        batcher.submit(running)
        batcher.submit(queued)
        while not batcher.current:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        finished = await batcher.close(0.3)
        waited = time.monotonic() - start
        with pytest.raises(Stopping):
            batcher.submit(job(["c"]))
        return finished, waited, [isinstance(j.future.exception(), Stopping) for j in (running, queued)], batcher

    finished, waited, stopped, batcher = asyncio.run(main())
    release.set()
    assert not finished and 0.3 <= waited < 2 and stopped == [True, True] and batcher.abandoned == 2


@pytest.mark.parametrize("field, value", [("port", 70000), ("max_queue", 0), ("timeout", 0), ("max_wait_ms", -1)])
def test_server_limits_are_checked(field, value):
    with pytest.raises(NmtError, match=f"flag '--{field}': {value} is outside the allowed range"):
        ServeConfig(**{field: value})
