"""`nmt serve` as a client meets it: the real server on a free loopback port, real HTTP requests, concurrently."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def model_dir(corpus_dir, tmp_path_factory) -> Path:
    from nmt import train
    from nmt.compat import reset_accelerate_state
    from tests.conftest import tiny_config

    result = train(tiny_config(corpus_dir, tmp_path_factory.mktemp("serve"), max_steps=12))
    reset_accelerate_state()
    return result.model_dir


class Server:
    """`nmt serve MODEL_DIR --port 0 FLAGS` in a subprocess; `port` is the one it printed."""

    def __init__(self, model_dir: Path, *flags: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "nmt.cli", "serve", str(model_dir), "--port", "0", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # blocks until it listens (or dies)
        assert "listening on http://127.0.0.1:" in line, (line, self.proc.stderr.read())
        self.port = int(line.split("127.0.0.1:")[1].split()[0])

    def call(self, method: str, path: str, body: dict | bytes | None = None, timeout: float = 120) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def stop(self) -> tuple[int, str]:
        """SIGTERM; (exit code, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err


@contextlib.contextmanager
def serving(model_dir: Path, *flags: str):
    server = Server(model_dir, *flags)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


def nmt_translate(model_dir: Path, lines: list[str], *flags: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "nmt.cli", "translate", str(model_dir), *flags], input="\n".join(lines)
                          + "\n", capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_concurrent_requests_are_batched_and_answer_as_nmt_translate(model_dir, corpus_dir):
    lines = (corpus_dir / "test.en").read_text(encoding="utf-8").splitlines()[:24]
    requests = [lines[i: i + 2] for i in range(0, len(lines), 2)]  # 12 clients, 2 sentences each
    with serving(model_dir, "--max-wait-ms", "300") as server:
        assert server.call("GET", "/health") == (200, {"status": "ok", "queued": 0, "in_flight": 0})
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda s: server.call("POST", "/translate", {"sentences": s, "beam": 2}), requests))
        status, stats = server.call("GET", "/stats")
        status_info, info = server.call("GET", "/info")
        code, err = server.stop()
    assert [a[0] for a in answers] == [200] * len(requests), answers
    served = [t for _, body in answers for t in body["translations"]]
    assert served == nmt_translate(model_dir, lines, "--beam", "2")
    assert stats["requests"] == len(requests) and stats["max_requests_per_batch"] > 1, stats  # batching happened
    assert stats["batches"] < len(requests)
    assert max(body["batch"]["requests"] for _, body in answers) == stats["max_requests_per_batch"]
    assert status_info == 200 and info["model"]["architecture"]["d_model"] == 32 and "beam" in info["options"]
    assert code == 0 and "nmt serve: stopped" in err, err


def test_bad_requests_get_4xx_with_a_message(model_dir):
    with serving(model_dir, "--max-body-bytes", "2000", "--max-sentences", "8") as server:
        cases = [
            (b"{not json", 400, "not valid JSON"),
            ({"text": ["Hello."]}, 400, "unknown field 'text'"),
            ({"sentences": "Hello."}, 400, "'sentences' must be a non-empty list of strings"),
            ({"sentences": []}, 400, "'sentences' must be a non-empty list of strings"),
            ({"sentences": ["a"], "beam": 0}, 400, "'beam' must be between 1 and 64"),
            ({"sentences": ["a"], "beam": "4"}, 400, "'beam' must be an integer"),
            ({"sentences": ["a"], "beam": 2, "nbest": 3}, 400, "'nbest' (3) cannot exceed 'beam' (2)"),
            ({"sentences": ["a"] * 9}, 413, "9 sentences in one request; the limit is 8"),
            ({"sentences": ["word " * 500]}, 413, "the limit is 2000"),
        ]
        for body, status, needle in cases:
            got, answer = server.call("POST", "/translate", body)
            assert got == status and needle in answer["error"], (body, got, answer)
        assert server.call("GET", "/translate") == (405, {"error": "Method Not Allowed: GET /translate"})
        assert server.call("GET", "/nope")[0] == 404
        status, answer = server.call("POST", "/translate", {"sentences": ["I am young."], "beam": 2, "nbest": 2})
        assert status == 200 and [len(answer["translations"]), len(answer["translations"][0])] == [1, 2]
        assert set(answer["translations"][0][0]) == {"text", "score"}
        assert server.call("GET", "/health")[0] == 200  # the server goes on after bad requests


def wait_for(server: Server, key: str, value: int, timeout: float = 30) -> None:
    """Poll GET /health until its `key` is `value`."""
    deadline = time.monotonic() + timeout
    while server.call("GET", "/health")[1][key] != value:
        assert time.monotonic() < deadline, f"{key} never reached {value}"
        time.sleep(0.01)


def test_full_queue_429_timeout_504_and_sigterm_lets_requests_in_flight_finish(model_dir):
    # a free worker waits 1.5 s for company before it runs a batch: requests stay queued long enough to look at
    with serving(model_dir, "--max-queue", "1", "--max-wait-ms", "1500") as server:
        first: list = []
        sender = threading.Thread(target=lambda: first.append(server.call("POST", "/translate", {"sentences": ["a b"]})))
        sender.start()
        wait_for(server, "queued", 1)
        status, answer = server.call("POST", "/translate", {"sentences": ["c d"]})
        assert status == 429 and "queue is full" in answer["error"]
        sender.join()
        assert first[0][0] == 200 and len(first[0][1]["translations"]) == 1
        status, answer = server.call("POST", "/translate", {"sentences": ["e f"], "timeout": 0.2})
        assert status == 504 and "timeout of 0.2 s" in answer["error"]
        wait_for(server, "in_flight", 0)  # the timed-out request left the queue unanswered
        last: list = []
        sender = threading.Thread(target=lambda: last.append(server.call("POST", "/translate", {"sentences": ["g h"]})))
        sender.start()
        wait_for(server, "in_flight", 1)
        code, err = server.stop()  # SIGTERM while the request waits in the queue
        sender.join()
    assert last[0][0] == 200 and len(last[0][1]["translations"]) == 1, last
    assert code == 0 and "stopping; 1 request(s) in flight finish first" in err and "nmt serve: stopped" in err, err
