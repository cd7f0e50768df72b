"""The server's dynamic batching without HTTP: which requests share a model call, limits, failures."""

from __future__ import annotations

import asyncio

import pytest

from nmt.errors import NmtError
from nmt.request_batcher import Batcher, Job, QueueFull, ServeConfig


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
    jobs = [Job(["a"], {"beam_size": 1}, 2), Job(["b"], {"beam_size": 2}, 2), Job(["c", "cc"], {"beam_size": 1}, 2),
            Job(["d"], {"beam_size": 1}, 2)]
    results, calls = run_jobs(jobs, max_tokens=5, max_wait=0.05)
    assert results == [["A"], ["B"], ["C", "CC"], ["D"]]  # each request gets its own outputs back, in order
    assert calls == [(["a", "c", "cc"], {"beam_size": 1}), (["b"], {"beam_size": 2}), (["d"], {"beam_size": 1})]
    assert [job.batch["requests"] for job in jobs] == [2, 1, 2, 1]


def test_without_batching_every_request_runs_alone():
    results, calls = run_jobs([Job([t], {}, 1) for t in "abc"], batching=False)
    assert results == [["A"], ["B"], ["C"]] and [texts for texts, _ in calls] == [["a"], ["b"], ["c"]]


def test_a_failing_request_does_not_fail_the_others_of_its_batch():
    results, calls = run_jobs([Job(["a"], {}, 1), Job(["POISON"], {}, 1), Job(["c"], {}, 1)], max_wait=0.05)
    assert results[0] == ["A"] and isinstance(results[1], RuntimeError) and results[2] == ["C"]
    assert calls[0][0] == ["a", "POISON", "c"]  # tried together, then one by one


def test_a_full_queue_refuses():
    async def main():
        batcher = Batcher(lambda texts: texts, max_queue=2, max_wait=1.0)
        batcher.start()
        batcher.submit(Job(["a"], {}, 1))
        batcher.submit(Job(["b"], {}, 1))
        with pytest.raises(QueueFull, match="2 requests waiting"):
            batcher.submit(Job(["c"], {}, 1))
        assert batcher.stats.rejected_full == 1
        await batcher.close()

    asyncio.run(main())


@pytest.mark.parametrize("field, value", [("port", 70000), ("max_queue", 0), ("timeout", 0), ("max_wait_ms", -1)])
def test_server_limits_are_checked(field, value):
    with pytest.raises(NmtError, match=f"flag '--{field}': {value} is outside the allowed range"):
        ServeConfig(**{field: value})
