"""Load on `nmt serve` over loopback: requests/s and p50/p99 latency for N concurrent clients, with the server's
dynamic batching on and off, in one run.

Each mode starts its own `nmt serve MODEL_DIR --port 0` on 127.0.0.1, sends a few warm-up requests, then lets
`--clients` threads send `--requests` requests each (`--sentences` sentences per request, drawn in a fixed order
from `--input` or the synthetic corpus), one after the other per client, and stops the server with SIGTERM.

    python benchmarks/serve_load.py runs/default/model --clients 16 --requests 20
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only


def start_server(model_dir: str, flags: list[str]) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "nmt.cli", "serve", model_dir, "--host", HOST, "--port", "0", *flags],
                            stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if f"listening on http://{HOST}:" not in line:
        proc.kill()
        sys.exit(f"nmt serve did not start: {line!r}")
    return proc, int(line.split(f"{HOST}:")[1].split()[0])


def post(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(HOST, port, timeout=600)
    try:
        conn.request("POST" if body else "GET", "/translate" if body else "/stats", body=json.dumps(body) if body else None,
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def client(port: int, requests: list[list[str]], beam: int, latencies: list[float], errors: list[int]) -> None:
    for sentences in requests:
        start = time.perf_counter()
        status, _ = post(port, {"sentences": sentences, "beam": beam})
        latencies.append(time.perf_counter() - start)
        if status != 200:
            errors.append(status)


def load(port: int, work: list[list[list[str]]], beam: int) -> dict:
    """All clients at once; the figures of one mode."""
    latencies: list[float] = []
    errors: list[int] = []
    threads = [threading.Thread(target=client, args=(port, reqs, beam, latencies, errors)) for reqs in work]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    quantile = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    sentences = sum(len(r) for reqs in work for r in reqs)
    return {"requests/s": len(latencies) / wall, "sentences/s": sentences / wall, "p50 ms": 1000 * quantile(0.5),
            "p99 ms": 1000 * quantile(0.99), "mean ms": 1000 * statistics.fmean(latencies), "errors": len(errors)}


def run_mode(args, batching: bool, work: list[list[list[str]]]) -> dict:
    flags = ["--max-queue", str(max(64, args.clients * 2)), "--max-wait-ms", str(args.max_wait_ms),
             "--threads", str(args.threads)] + ([] if batching else ["--no-batching"])
    proc, port = start_server(args.model_dir, flags)
    try:
        for reqs in work[: min(2, len(work))]:  # warm-up: first calls allocate and compile
            post(port, {"sentences": reqs[0], "beam": args.beam})
        figures = load(port, work, args.beam)
        _, stats = post(port, {})
        figures["requests/batch"] = stats["requests"] / max(stats["batches"], 1)
        figures["max requests/batch"] = stats["max_requests_per_batch"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return figures


def sentences_from(path: str | None) -> list[str]:
    if path:
        return [s for s in Path(path).read_text(encoding="utf-8").splitlines() if s.strip()]
    from nmt.synthetic import generate_pairs

    return [src for src, _ in generate_pairs(2000, seed=11)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a model directory (output_dir/model of a run)")
    p.add_argument("--input", help="source sentences, one per line (default: the synthetic corpus)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients")
    p.add_argument("--requests", type=int, default=20, help="requests per client, sent one after the other")
    p.add_argument("--sentences", type=int, default=1, help="sentences per request")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--max-wait-ms", type=float, default=2.0, help="the server's --max-wait-ms when batching")
    p.add_argument("--threads", type=int, default=0, help="the server's torch threads (0: torch's default)")
    args = p.parse_args()
    pool = sentences_from(args.input)
    n = args.sentences
    work = [[[pool[(c * args.requests * n + r * n + i) % len(pool)] for i in range(n)] for r in range(args.requests)]
            for c in range(args.clients)]
    print(f"nmt serve over loopback: {args.clients} clients x {args.requests} requests of {n} sentence(s), "
          f"beam {args.beam}, model {args.model_dir}")
    rows = {"batching on": run_mode(args, True, work), "batching off": run_mode(args, False, work)}
    keys = list(next(iter(rows.values())))
    print(f"{'':14}" + "".join(f"{k:>20}" for k in keys))
    for name, figures in rows.items():
        print(f"{name:14}" + "".join(f"{figures[k]:>20.1f}" if isinstance(figures[k], float) else f"{figures[k]:>20}"
                                     for k in keys))
    on, off = rows["batching on"], rows["batching off"]
    print(f"batching on / off: {on['requests/s'] / off['requests/s']:.2f}x requests/s, "
          f"p99 {on['p99 ms'] / off['p99 ms']:.2f}x")


if __name__ == "__main__":
    main()
