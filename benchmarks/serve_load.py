"""Load on `nmt serve` over loopback: requests/s and p50/p99 latency for N concurrent clients, with the server's
dynamic batching on and off, and with batching on beside hostile clients, in one run.

Each mode starts its own `nmt serve MODEL_DIR --port 0` on 127.0.0.1, sends a few warm-up requests, then lets
`--clients` threads send `--requests` requests each (`--sentences` sentences per request, drawn in a fixed order
from `--input` or the synthetic corpus), one after the other per client, and stops the server with SIGTERM.
The third mode runs the same clients while `--hostile` more threads, for as long as the normal clients run,
send bodies a byte at a time, headers a byte at a time, costly requests they leave at once, oversized ones
(by bytes and by decoding cost), a 1 MiB sentence of U+FDFA (which NFKC makes 18 characters), 256 sentences that
NFKC expands past --max-chars and 256 long sentences to tokenise before their cost is refused; it prints the
normal clients' p50/p99 latency there over the quiet server's. In every mode one more client asks GET /health
every HEALTH_EVERY seconds while the normal clients run: its max and p99 latency show whether anything blocks
the server's event loop (target: under 100 ms).

With `--ct2 DIR` (an export: `nmt export MODEL_DIR --to ctranslate2 DIR --quantization int8`) the same clients
and requests also go to `nmt serve --ct2 DIR` and, in this process, straight to CTranslate2 on one translator (the
export's compute type, the server's threads, the same beam and length limit), tokenised and detokenised with the
model's tokenizer: "raw CT2, per request" has each client call `translate_batch` on its own request, as a
deployer's own server around raw CTranslate2 without batching would; "raw CT2, batched" translates every request's
sentences in one thread in batches of as many sentences as the server's batches held on average (the same
batches, no HTTP, no queue), and `nmt serve --ct2` over it is the server's cost (floor: 0.9x).

    python benchmarks/serve_load.py runs/default/model --clients 16 --requests 20 --hostile 16
    python benchmarks/serve_load.py runs/default/model --ct2 runs/ct2-int8 --hostile 0
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"  # loopback only


def start_server(model: list[str], flags: list[str]) -> tuple[subprocess.Popen, int]:
    """`nmt serve` of `model` (a model directory, or --ct2 DIR) on a free loopback port."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "nmt.cli", "serve", *model, "--host", HOST, "--port", "0", *flags],
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


def all_at_once(one_client, work: list[list[list[str]]]) -> float:
    """One thread per client, each running `one_client` on its requests, all started together; the seconds until
    the last ends."""
    threads = [threading.Thread(target=one_client, args=(reqs,)) for reqs in work]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def figures(latencies: list[float], wall: float, work: list[list[list[str]]], errors: int = 0) -> dict:
    """requests/s and sentences/s of `work` done in `wall` seconds, and the p50/p99/mean of `latencies`."""
    latencies = sorted(latencies)
    quantile = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    sentences = sum(len(r) for reqs in work for r in reqs)
    return {"requests/s": sum(map(len, work)) / wall, "sentences/s": sentences / wall, "p50 ms": 1000 * quantile(0.5),
            "p99 ms": 1000 * quantile(0.99), "mean ms": 1000 * statistics.fmean(latencies), "errors": errors}


def load(port: int, work: list[list[list[str]]], beam: int) -> dict:
    """All clients at once; the figures of one mode."""
    latencies: list[float] = []
    errors: list[int] = []
    wall = all_at_once(lambda reqs: client(port, reqs, beam, latencies, errors), work)
    return figures(latencies, wall, work, len(errors))


HOSTILE_KINDS = ("slow body", "slow headers", "leaves mid-body", "costly request, leaves at once", "oversized body",
                 "over the cost limit", "1 MiB of U+FDFA", "256 sentences over --max-chars after NFKC",
                 "256 long sentences over the cost limit")
HEALTH_EVERY = 0.01  # seconds between the health client's requests
REQUEST_TIMEOUT = 2.0  # the server's --request-timeout in the hostile mode: slow clients are cut off after it
HOSTILE_PAUSE = 0.05  # seconds a hostile client waits between attempts: each makes at most 20 a second


def _post_head(length: int) -> bytes:
    return b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % length


def hostile(port: int, kind: str, stop, outcomes: dict, pool: list[str]) -> None:
    """One hostile client: does its `kind` of harm again and again until `stop`; counts what the server answered."""
    costly = json.dumps({"sentences": pool[:32], "beam": 8}).encode()
    over_cost = json.dumps({"sentences": [""] * 256, "beam": 1000}).encode()
    expanding = {"1 MiB of U+FDFA": {"sentences": ["\ufdfa" * 349_000]},
                 "256 sentences over --max-chars after NFKC": {"sentences": ["\ufdfa" * 1300] * 256},
                 "256 long sentences over the cost limit": {"sentences": ["word " * 800] * 256, "beam": 16}}
    bodies = {kind: json.dumps(body, ensure_ascii=False).encode() for kind, body in expanding.items()}
    while not stop.is_set():
        outcome = "left"
        try:
            with socket.create_connection((HOST, port), timeout=3 * REQUEST_TIMEOUT + 5) as sock:
                if kind in ("slow body", "slow headers"):
                    head = b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    sock.sendall(head + b"Content-Length: 1000\r\n\r\n{" if kind == "slow body" else head)
                    outcome = "open at the end"
                    while not stop.is_set():  # a byte every 0.2 s until the server cuts it off
                        try:
                            sock.sendall(b"X")
                        except OSError:
                            outcome = "cut off"
                            break
                        time.sleep(0.2)
                elif kind == "leaves mid-body":
                    sock.sendall(_post_head(len(costly)) + costly[: len(costly) // 2])
                elif kind == "costly request, leaves at once":
                    sock.sendall(_post_head(len(costly)) + costly)
                else:
                    body = b"x" * 65536 if kind == "oversized body" else bodies.get(kind, over_cost)
                    sock.sendall(_post_head(100_000_000 if kind == "oversized body" else len(body)) + body)
                    answer = sock.recv(64)
                    outcome = answer[9:12].decode() if answer.startswith(b"HTTP/1.1 ") else "closed"
        except OSError:  # reset or broken pipe: the server cut it off
            outcome = "closed"
        outcomes[(kind, outcome)] = outcomes.get((kind, outcome), 0) + 1
        time.sleep(HOSTILE_PAUSE)


def hostile_swarm(port: int, n: int, stop, results, pool: list[str]) -> None:
    """`n` hostile clients as threads of their own process (the measured clients' process stays quiet)."""
    outcomes: dict = {}
    threads = [threading.Thread(target=hostile, args=(port, HOSTILE_KINDS[i % len(HOSTILE_KINDS)], stop, outcomes,
                                                      pool)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(outcomes)


def health_client(port: int, stop: threading.Event, latencies: list[float]) -> None:
    """GET /health every HEALTH_EVERY seconds until `stop`: how long the event loop keeps a client waiting."""
    while not stop.is_set():
        conn = http.client.HTTPConnection(HOST, port, timeout=600)
        start = time.perf_counter()
        try:
            conn.request("GET", "/health")
            conn.getresponse().read()
            latencies.append(time.perf_counter() - start)
        finally:
            conn.close()
        time.sleep(HEALTH_EVERY)


def run_mode(args, batching: bool, work: list[list[list[str]]], hostiles: int = 0, pool: list[str] = (),
             model: list[str] | None = None) -> dict:
    flags = ["--max-queue", str(max(64, args.clients * 2)), "--max-wait-ms", str(args.max_wait_ms),
             "--threads", str(args.threads), "--request-timeout", str(REQUEST_TIMEOUT)]
    proc, port = start_server(model or [args.model_dir], flags + ([] if batching else ["--no-batching"]))
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    swarm = context.Process(target=hostile_swarm, args=(port, hostiles, stop, results, list(pool))) if hostiles else None
    outcomes: dict = {}
    try:
        for reqs in work[: min(2, len(work))]:  # warm-up: first calls allocate and compile
            post(port, {"sentences": reqs[0], "beam": args.beam})
        if swarm:
            swarm.start()
            time.sleep(REQUEST_TIMEOUT + 1)  # the swarm is doing harm (slow clients cut off once) before measuring
        health: list[float] = []
        health_stop = threading.Event()
        prober = threading.Thread(target=health_client, args=(port, health_stop, health))
        prober.start()
        try:
            figures = load(port, work, args.beam)
        finally:
            health_stop.set()
            prober.join()
        stop.set()
        health.sort()
        figures["health"] = {"max ms": 1000 * health[-1], "p99 ms": 1000 * health[min(len(health) - 1,
                                                                                      int(0.99 * len(health)))],
                             "n": len(health)}
        if swarm:
            outcomes = results.get(timeout=60)
            swarm.join(timeout=60)
        _, stats = post(port, {})
        figures["requests/batch"] = stats["requests"] / max(stats["batches"], 1)
        figures["max requests/batch"] = stats["max_requests_per_batch"]
        figures["hostile"] = outcomes
        figures["dropped"] = stats.get("dropped", 0)
        warmup = sum(len(reqs[0]) for reqs in work[: min(2, len(work))])
        figures["decoded for others"] = stats.get("sentences_decoded", 0) - warmup - sum(len(r) for reqs in work
                                                                                          for r in reqs)
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return figures


def raw_ct2(args, work: list[list[list[str]]], batch: int = 0) -> dict:
    """CTranslate2 in this process, no server: tokenise, translate_batch, detokenise. batch 0: the clients each call
    it on their own requests; else one thread translates every request's sentences `batch` at a time."""
    import ctranslate2

    from nmt.decoding import SearchConfig
    from nmt.tokenizer import PairTokenizer

    tok = PairTokenizer.load(args.ct2)
    search = SearchConfig(beam_size=args.beam)
    translator = ctranslate2.Translator(args.ct2, device="cpu", compute_type="default", inter_threads=1,
                                        intra_threads=args.threads)

    def translate(sentences: list[str]) -> list[str]:
        ids = tok.encode_src(sentences)
        limit = int(search.max_len_a + search.max_len_b * max(map(len, ids)))  # nmt's limit counts the </s>
        results = translator.translate_batch([[tok.src.id_to_token(i) for i in s] for s in ids],
                                             beam_size=search.beam_size, length_penalty=search.alpha,
                                             max_decoding_length=min(limit, search.max_new_tokens) - 1)
        return tok.decode_tgt([[tok.tgt.token_to_id(t) for t in r.hypotheses[0]] for r in results])

    translate(work[0][0])  # warm-up
    latencies: list[float] = []
    def timed(requests: list[list[str]]) -> None:
        for sentences in requests:
            start = time.perf_counter()
            translate(sentences)
            latencies.append(time.perf_counter() - start)

    if batch:  # one thread, the same sentences `batch` at a time (latencies: per batch)
        flat = [s for reqs in work for r in reqs for s in r]
        start = time.perf_counter()
        timed([flat[i:i + batch] for i in range(0, len(flat), batch)])
        return figures(latencies, time.perf_counter() - start, work)
    return figures(latencies, all_at_once(timed, work), work)


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
    p.add_argument("--hostile", type=int, default=10, choices=range(0, 65), metavar="[0-64]",
                   help="hostile clients beside the normal ones in the third mode (0: no third mode)")
    p.add_argument("--ct2", metavar="DIR", help="also nmt serve --ct2 DIR and raw CTranslate2 on this export of the "
                   "model (nmt export MODEL_DIR --to ctranslate2 DIR --quantization int8)")
    args = p.parse_args()
    pool = sentences_from(args.input)
    n = args.sentences
    work = [[[pool[(c * args.requests * n + r * n + i) % len(pool)] for i in range(n)] for r in range(args.requests)]
            for c in range(args.clients)]
    print(f"nmt serve over loopback: {args.clients} clients x {args.requests} requests of {n} sentence(s), "
          f"beam {args.beam}, model {args.model_dir}")
    rows = {"batching on": run_mode(args, True, work), "batching off": run_mode(args, False, work)}
    if args.hostile:
        rows["hostile"] = run_mode(args, True, work, args.hostile, pool)
    engines = {}
    if args.ct2:
        served = run_mode(args, True, work, model=["--ct2", args.ct2])
        per_batch = max(1, round(served["requests/batch"] * n))  # the server's mean batch, in sentences
        engines = {"nmt serve --ct2": served, "raw CT2, per request": raw_ct2(args, work),
                   "raw CT2, batched": raw_ct2(args, work, per_batch)}
    keys = [k for k in next(iter(rows.values())) if k not in ("hostile", "dropped", "decoded for others", "health")]
    print(f"{'':20}" + "".join(f"{k:>20}" for k in keys))
    for name, figures in {**rows, **engines}.items():
        print(f"{name:20}" + "".join(f"{figures.get(k, '-'):>20.1f}" if isinstance(figures.get(k), float)
                                     else f"{figures.get(k, '-'):>20}" for k in keys))
    if engines:
        raw, alone = engines["raw CT2, batched"], engines["raw CT2, per request"]
        print(f"nmt serve --ct2 / raw CTranslate2 on batches of {per_batch} sentences (the server's mean): "
              f"{served['sentences/s'] / raw['sentences/s']:.2f}x sentences/s (floor 0.9x); / raw CTranslate2 "
              f"called per request: {served['sentences/s'] / alone['sentences/s']:.2f}x sentences/s, p50 "
              f"{served['p50 ms'] / alone['p50 ms']:.2f}x, p99 {served['p99 ms'] / alone['p99 ms']:.2f}x; "
              f"nmt serve --ct2 / nmt serve (PyTorch, batching on): "
              f"{served['sentences/s'] / rows['batching on']['sentences/s']:.2f}x sentences/s")
    for name, figures in rows.items():
        h = figures["health"]
        print(f"GET /health beside the clients, {name}: max {h['max ms']:.1f} ms, p99 {h['p99 ms']:.1f} ms over "
              f"{h['n']} requests (target: under 100 ms)")
    on, off = rows["batching on"], rows["batching off"]
    print(f"batching on / off: {on['requests/s'] / off['requests/s']:.2f}x requests/s, "
          f"p99 {on['p99 ms'] / off['p99 ms']:.2f}x")
    if args.hostile:
        bad = rows["hostile"]
        print(f"{args.hostile} hostile clients in their own process, each pausing {HOSTILE_PAUSE:g} s between "
              f"attempts ({', '.join(HOSTILE_KINDS)}); what they got: "
              + ", ".join(f"{kind}: {outcome} x{n}" for (kind, outcome), n in sorted(bad["hostile"].items()))
              + f"; requests the server dropped: {bad['dropped']}; sentences it decoded for them: "
              f"{bad['decoded for others']}")
        print(f"normal clients, quiet -> with hostile clients: p50 {on['p50 ms']:.1f} -> {bad['p50 ms']:.1f} ms "
              f"({bad['p50 ms'] / on['p50 ms']:.2f}x), p99 {on['p99 ms']:.1f} -> {bad['p99 ms']:.1f} ms "
              f"({bad['p99 ms'] / on['p99 ms']:.2f}x; target: under 2x)")

if __name__ == "__main__":
    main()
