"""`nmt serve` as a client meets it: the real server on a free loopback port, real HTTP requests, concurrently."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import ROOT, Server, asgi_requests, nmt_translate, serving

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def model_dir(served_model) -> Path:
    return served_model


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
    shown = json.dumps(info)  # no paths and no command lines of the machine that trained or serves it
    assert not {"model_dir", "argv", "command", "data"} & set(info["model"]) and str(model_dir.parent) not in shown
    assert info["server"]["max_cost"] > 0 and "api_key" not in info["server"]
    assert code == 0 and "nmt serve: stopped" in err, err


def test_a_document_translates_alike_from_the_cli_python_and_both_http_apis(model_dir):
    """Issue 45, part 4: documents everywhere. Paragraphs split into sentences and written back one line each, blank
    lines kept: nmt translate --paragraphs, Translator.translate_documents, nmt's API with "paragraphs": true and
    LibreTranslate's q give the same text; the limits apply to the sentences, and n-best or scores are refused."""
    from nmt.tools.request_batcher import ServeConfig
    from nmt.tools.serve import build_app
    from nmt.translate import Translator

    documents = ["the dog sleeps . The cat eats a fish .\nthe dog runs .\n\n\nA cat sleeps .", "\n", "the cat ."]
    translator = Translator.from_pretrained(model_dir)
    python = translator.translate_documents(documents, beam_size=2)
    cli = "\n".join(nmt_translate(model_dir, documents[0].split("\n"), "--beam", "2", "--paragraphs"))
    answers = asgi_requests(build_app(translator, ServeConfig(beam=2, max_sentences=4)),
                            ("POST", "/translate", {"sentences": documents, "paragraphs": True}),
                            ("POST", "/translate", {"q": documents, "source": "en", "target": "xx"}),
                            ("POST", "/translate", {"sentences": [documents[0]] * 2, "paragraphs": True}),
                            ("POST", "/translate", {"sentences": documents, "paragraphs": True, "nbest": 2}))
    assert python[0] == cli and python[0].count("\n") == 3 and python[1] == "" and len(python[0].split("\n")[0]) > 0
    assert answers[0] == (200, {"translations": python, "batch": answers[0][1]["batch"]})
    assert answers[1] == (200, {"translatedText": python})
    assert answers[2][0] == 413 and "6 sentences in one request; the limit is 4" in answers[2][1]["error"]
    assert answers[3][0] == 400 and "'paragraphs' gives one translation a paragraph" in answers[3][1]["error"]


def test_serve_ct2_answers_both_apis_as_nmt_translate_ct2_does(model_dir, tmp_path):
    """Issue 45, part 6 (first piece): nmt serve --ct2 DIR decodes with CTranslate2 behind the same routes: nmt's
    API (with scores, documents and markup) and LibreTranslate's, as nmt translate --ct2 does; a glossary, which
    needs nmt's constrained search, is a 400 that says so, or with MODEL_DIR beside --ct2 translated by that model
    for the sentences that hold a term."""
    pytest.importorskip("ctranslate2")
    from nmt.cli import main

    assert main(["export", str(model_dir), "--to", "ctranslate2", str(tmp_path / "ct2")]) == 0
    lines = ["the dog sleeps .", "the cat eats a fish ."]
    glossary = tmp_path / "g.tsv"
    glossary.write_text("dog\tHundx\n", encoding="utf-8")
    with serving(None, "--ct2", str(tmp_path / "ct2"), "--beam", "2") as server:
        plain = server.call("POST", "/translate", {"sentences": lines})
        scored = server.call("POST", "/translate", {"sentences": lines, "scores": True})
        lt = server.call("POST", "/translate", {"q": lines, "source": "en", "target": "xx"})
        refused = server.call("POST", "/translate", {"sentences": lines, "glossary": [["dog", "x"]]})
        marked = server.call("POST", "/translate", {"sentences": ["the <b>dog</b> sleeps ."], "format": "html"})
    expected = nmt_translate(model_dir, lines, "--ct2", str(tmp_path / "ct2"), "--beam", "2")
    assert marked == (200, {"translations": nmt_translate(model_dir, ["the <b>dog</b> sleeps ."], "--format", "html",
                                                          "--beam", "2"), "batch": marked[1]["batch"]})
    assert plain[0] == 200 and plain[1]["translations"] == expected
    assert [t["text"] for t in scored[1]["translations"]] == expected and all(
        0 < t["confidence"] <= 1 for t in scored[1]["translations"])
    assert lt == (200, {"translatedText": expected})
    assert refused[0] == 400 and "CTranslate2, which takes no glossary" in refused[1]["error"]
    with serving(model_dir, "--ct2", str(tmp_path / "ct2"), "--beam", "2") as server:  # the model beside the export
        status, body = server.call("POST", "/translate", {"sentences": lines, "glossary": [["dog", "Hundx"]]})
    assert status == 200 and body["translations"] == [nmt_translate(model_dir, lines[:1], "--beam", "2", "--glossary",
                                                                    str(glossary))[0], expected[1]]


def test_pages_of_other_sites_and_rebound_host_names_are_refused(model_dir):
    """The second audit (issue 47, row 15): without a key the server took cross-site simple POSTs and any Host (a
    site rebinding its name to 127.0.0.1 could read /info, /stats and translations). On loopback the Host must be
    this machine's name; a request with an Origin must come from the server's own page."""
    from nmt.tools.request_batcher import ServeConfig
    from nmt.tools.serve import build_app
    from nmt.translate import Translator

    translator = Translator.from_pretrained(model_dir)
    body = {"sentences": ["the dog sleeps ."]}
    refused = ({"host": "rebound.example:8080"}, {"origin": "http://evil.example"}, {"origin": "null"},
               {"origin": "http://127.0.0.1:9999"}, {"host": "localhost:8080", "origin": "http://127.0.0.1:8080"})
    answers = asgi_requests(build_app(translator, ServeConfig()),
                            ("POST", "/translate", body),  # curl, a script: no Origin
                            ("POST", "/translate", body, {"origin": "http://127.0.0.1:8080"}),  # the server's page
                            ("GET", "/info", None, {"host": "localhost:8080"}),
                            *(("POST", "/translate", body, headers) for headers in refused),
                            ("GET", "/stats", None, {"host": "rebound.example"}))
    assert [status for status, _ in answers] == [200, 200, 200] + [403] * (len(refused) + 1), answers
    public = asgi_requests(build_app(translator, ServeConfig(host="0.0.0.0")),
                           ("GET", "/info", None, {"host": "mt.example.org"}))
    assert public[0][0] == 200  # a public bind answers to its names


def test_a_glossarys_terms_are_priced_into_the_decoding_cost(model_dir):
    """The second audit (issue 47, row 2): the constrained search weighs each term for every beam at every step, and
    --max-cost ignored glossaries. A sentence costs beam x length limit x (1 + the terms it holds)."""
    from nmt.tools.request_batcher import ServeConfig
    from nmt.tools.serve import build_app
    from nmt.translate import Translator

    translator = Translator.from_pretrained(model_dir)
    sentence = "the dog sleeps and the cat eats ."
    words = sentence.split()[:6]
    glossary = [[w, "x"] for w in words]  # six terms the sentence holds
    limit = 2 * 4 * 64  # two sentences at beam 4 and a 64-token limit: what the plain request costs at most
    answers = asgi_requests(build_app(translator, ServeConfig(max_cost=limit)),
                            ("POST", "/translate", {"sentences": [sentence] * 2, "beam": 4, "max_new_tokens": 64}),
                            ("POST", "/translate", {"sentences": [sentence] * 2, "beam": 4, "max_new_tokens": 64,
                                                    "glossary": glossary}),
                            ("POST", "/translate", {"sentences": ["nothing here ."] * 2, "beam": 4,
                                                    "max_new_tokens": 64, "glossary": glossary}))
    assert [status for status, _ in answers] == [200, 413, 200], answers
    assert "(1 + glossary terms held)" in answers[1][1]["error"]


def test_a_failed_translation_answers_500_with_an_id_and_keeps_the_details_in_the_log(model_dir, caplog):
    """The second audit (issue 47, row 16): a 500 echoed the exception's text (an allocator's sizes). It says what
    failed and an error id; the text and the traceback go to the server's log under that id."""
    from nmt.tools.request_batcher import ServeConfig
    from nmt.tools.serve import build_app
    from nmt.translate import Translator

    translator = Translator.from_pretrained(model_dir)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 7900000000 bytes.")

    translator.translations = out_of_memory  # the batcher calls it in its model thread
    with caplog.at_level("ERROR", logger="nmt"):
        [(status, answer)] = asgi_requests(build_app(translator, ServeConfig()),
                                           ("POST", "/translate", {"sentences": ["the dog sleeps ."]}))
    ref = re.fullmatch(r"translation failed \(error id ([0-9a-f]{12}); the server's log has the details\)",
                       answer["error"])
    assert status == 500 and ref, answer
    assert "7900000000" not in json.dumps(answer)
    logged = [r for r in caplog.records if ref[1] in r.getMessage()]
    assert logged and "7900000000" in logged[0].getMessage() and logged[0].exc_info is not None


def test_malformed_and_hostile_requests_get_4xx_json_never_500(model_dir):
    with serving(model_dir, "--max-body-bytes", "6000", "--max-sentences", "8", "--max-cost", "20000") as server:
        cases = [
            (b"{not json", 400, "not valid JSON"),
            (b"", 400, "not valid JSON"),
            (b"[]", 400, "must be a JSON object"),
            (b'{"sentences": ["\xff\xfe"]}', 400, "not UTF-8"),
            (b'{"sentences": ["\\ud800 lone"]}', 400, "sentence 0 is not valid Unicode (a lone surrogate"),
            (b'{"sentences": ' + b"[" * 1400 + b"]" * 1400 + b"}", 400, "nests JSON too deeply"),
            (b'{"sentences": ["a"], "beam": ' + b"9" * 5000 + b"}", 400, "number too long to read"),
            (b'{"sentences": ["a"], "beam": ' + b"9" * 4000 + b"}", 400,
             "'beam' must be in [1, 1000], got an integer of 4000 digits"),
            (b'{"sentences": ["a"], "alpha": -' + b"9" * 400 + b"}", 400, "'alpha' must be in [0, 10], got an integer"),
            (b'{"sentences": ["a"], "alpha": NaN}', 400, "'alpha' must be in [0, 10], got nan"),
            (b'{"sentences": ["a"], "alpha": 1e999}', 400, "'alpha' must be in [0, 10], got inf"),
            ({"text": ["Hello."]}, 400, "unknown field 'text'"),
            ({"sentences": "Hello."}, 400, "'sentences' must be a non-empty list of strings"),
            ({"sentences": []}, 400, "'sentences' must be a non-empty list of strings"),
            ({"sentences": ["a", 3]}, 400, "item 1 is 3"),
            ({"sentences": ["a"], "beam": 0}, 400, "'beam' must be in [1, 1000], got 0"),
            ({"sentences": ["a"], "beam": "4"}, 400, "'beam' must be an integer, got '4'"),
            ({"sentences": ["a"], "beam": True}, 400, "'beam' must be an integer, got True"),
            ({"sentences": ["a"], "beam": 2.5}, 400, "'beam' must be an integer"),
            ({"sentences": ["a"], "timeout": 1e9}, 400, "'timeout' must be in (0, 60.0]"),
            ({"sentences": ["a"], "beam": 2, "nbest": 3}, 400, "'nbest' (3) cannot exceed 'beam' (2)"),
            ({"sentences": ["a"], "scores": "yes"}, 400, "'scores' must be true or false, got 'yes'"),
            ({"sentences": ["a"] * 9}, 413, "9 sentences in one request; the limit is 8"),
            ({"sentences": ["word " * 1300]}, 413, "the limit is 6000"),
            ({"sentences": [""] * 8, "beam": 1000}, 413, "decoding cost is"),  # few source tokens, a costly search
        ]
        for body, status, needle in cases:
            got, answer = server.call("POST", "/translate", body)
            assert got == status and needle in answer["error"], (body[:80], got, answer)
        declared = read_all(raw(server.port, b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: " + b"9" * 12
                                + b"\r\n\r\n{"))  # refused by what it declares, before it is read
        assert declared.startswith(b"HTTP/1.1 413") and b"\"the body has 999999999999 bytes" in declared, declared
        assert server.call("GET", "/translate") == (405, {"error": "Method Not Allowed: GET /translate"})
        assert server.call("GET", "/nope")[0] == 404
        status, answer = server.call("POST", "/translate", {"sentences": ["I am young."], "beam": 2, "nbest": 2})
        assert status == 200 and [len(answer["translations"]), len(answer["translations"][0])] == [1, 2]
        assert set(answer["translations"][0][0]) == {"text", "score"}
        assert server.call("GET", "/stats")[1]["rejected_cost"] == 1
        assert server.call("GET", "/health")[0] == 200  # the server goes on after bad requests
        code, err = server.stop()
    assert code == 0 and "Traceback" not in err and "Exception" not in err, err


def test_an_api_key_guards_every_route_but_health_and_the_page(model_dir):
    with serving(model_dir, env={"NMT_API_KEY": "s3cret"}) as server:
        body = {"sentences": ["I am young."], "beam": 1}
        assert server.call("GET", "/health")[0] == 200
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("GET", "/")  # the page asks for the key itself; it holds nothing of the model
        page = conn.getresponse()
        assert page.status == 200 and page.getheader("Content-Type").startswith("text/html")
        assert "script-src 'sha256-" in page.getheader("Content-Security-Policy") and b"Bearer" in page.read()
        conn.close()
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path, data in (("GET", "/info", None), ("GET", "/stats", None), ("POST", "/translate", body),
                                       ("GET", "/nope", None)):
                status, answer = server.call(method, path, data, headers=headers)
                assert status == 401 and "API key" in answer["error"], (headers, path, status, answer)
        good = {"Authorization": "Bearer s3cret"}
        assert server.call("POST", "/translate", body, headers=good)[0] == 200
        assert server.call("GET", "/info", headers=good)[0] == 200


def test_a_non_loopback_address_without_a_key_is_warned_about(model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NMT_API_KEY": ""}  # 192.0.2.1 (TEST-NET-1): never this machine's
    proc = subprocess.run([sys.executable, "-m", "nmt.cli", "serve", str(model_dir), "--host", "192.0.2.1", "--port",
                           "0"], capture_output=True, text=True, env=env, timeout=120)
    assert "warning: --host 192.0.2.1 is reachable beyond this machine and no API key is set" in proc.stderr
    assert proc.returncode == 2 and "cannot listen on 192.0.2.1:0" in proc.stderr, proc.stderr


def raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(data)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_slow_clients_are_cut_off_and_connections_are_limited(model_dir):
    with serving(model_dir, "--request-timeout", "1", "--max-connections", "4", "--keep-alive", "1") as server:
        start = time.monotonic()
        slow_body = raw(server.port, b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"sen")
        answer = read_all(slow_body)
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer, answer
        assert time.monotonic() - start < 10
        start = time.monotonic()
        slow_headers = raw(server.port, b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        with contextlib.suppress(OSError):  # a byte every 0.2 s: never a whole request
            while time.monotonic() - start < 10:
                slow_headers.sendall(b"X")
                time.sleep(0.2)
        assert 0.9 < time.monotonic() - start < 5 and read_all(slow_headers) == b""  # closed without an answer
        idle = [raw(server.port, b"") for _ in range(4)]  # the limit, in connections that send nothing
        time.sleep(0.2)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 503
        assert all(read_all(s) == b"" for s in idle)  # closed by the server within --request-timeout
        assert server.call("GET", "/health")[0] == 200


def test_work_of_clients_that_left_or_timed_out_is_dropped(model_dir):
    with serving(model_dir, "--max-wait-ms", "1500", "--batch-tokens", "8") as server:
        raw(server.port, b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 24\r\n\r\n{").close()  # mid-body
        gone = raw(server.port, b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 24\r\n\r\n"
                                b'{"sentences": ["a b c"]}')
        wait_for(server, "queued", 1)
        gone.close()  # while it waits for company
        wait_for(server, "in_flight", 0)
        time.sleep(1.6)
        stats = server.call("GET", "/stats")[1]
        assert (stats["disconnected"], stats["dropped"], stats["sentences_decoded"]) == (2, 1, 0), stats
        # a request of many model calls (--batch-tokens 8: two sentences a call) whose client gives up after 0.5 s
        status, answer = server.call("POST", "/translate", {"sentences": ["a b c"] * 200, "beam": 8, "timeout": 0.5})
        assert status == 504, answer
        wait_for(server, "in_flight", 0)
        time.sleep(0.5)
        stats = server.call("GET", "/stats")[1]
        assert stats["timed_out"] == 1 and stats["dropped"] == 2 and 0 < stats["sentences_decoded"] < 200, stats
        code, err = server.stop()
    assert code == 0 and "Traceback" not in err, err


def test_a_model_call_whose_clients_all_gave_up_stops_mid_search(model_dir):
    """The second audit (issue 47, row 2): a call held the model thread to its end although no client waited for
    it any more. One call of 256 sentences at beam 16, its client gone after 0.3 s: the search stops at its next
    step, and the next request is answered."""
    big = ["--batch-tokens", "1000000", "--batch-cost", "100000000", "--max-cost", "100000000", "--max-queued-cost",
           "100000000"]
    with serving(model_dir, *big) as server:
        sentences = [" ".join(["the dog sees the cat"] * 8) + f" {i} ." for i in range(256)]
        status, answer = server.call("POST", "/translate", {"sentences": sentences, "beam": 16, "timeout": 0.3})
        assert status == 504, answer
        deadline = time.monotonic() + 60
        while (stats := server.call("GET", "/stats")[1])["stopped_calls"] != 1:
            assert time.monotonic() < deadline and stats["in_flight"] == 0, stats
            time.sleep(0.02)
        assert (stats["model_calls"], stats["failed"], stats["timed_out"]) == (1, 0, 1), stats
        assert server.call("POST", "/translate", {"sentences": ["the cat ."]})[0] == 200
        code, err = server.stop()
    assert code == 0 and "Traceback" not in err and "failed" not in err, err


def wait_for(server: Server, key: str, value: int, timeout: float = 30) -> None:
    """Poll GET /health until its `key` is `value`."""
    deadline = time.monotonic() + timeout
    while server.call("GET", "/health")[1][key] != value:
        assert time.monotonic() < deadline, f"{key} never reached {value}"
        time.sleep(0.01)


def test_sigterm_gives_the_requests_in_flight_a_bounded_time(model_dir):
    with serving(model_dir, "--shutdown-timeout", "1", "--max-cost", "100000000", "--max-queued-cost", "100000000",
                 "--timeout", "300") as server:
        answers: list = []
        long = {"sentences": [" ".join("abcdefghij") * 10] * 64, "beam": 64}  # many seconds, over many model calls
        sender = threading.Thread(target=lambda: answers.append(server.call("POST", "/translate", long)))
        sender.start()
        wait_for(server, "queued", 0)
        wait_for(server, "in_flight", 1)
        start = time.monotonic()
        code, err = server.stop()
        stopped = time.monotonic() - start
        sender.join()
    assert code == 0 and stopped < 6, (stopped, err)
    assert answers[0][0] == 503 and "gave up on this request" in answers[0][1]["error"], answers
    assert "gave up on 1 request(s) after --shutdown-timeout 1 s" in err and "nmt serve: stopped" in err, err


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
    assert code == 0 and "stopping; 1 request(s) in flight get up to 10 s to finish" in err, err
    assert "nmt serve: stopped" in err and "gave up" not in err, err


def test_health_is_answered_while_a_hostile_request_is_in_flight(model_dir):
    """Requests that cost the server work before it refuses them (NFKC makes 18 characters of each U+FDFA; 256
    long sentences to tokenise before their cost is known) get 413 JSON naming the limit, while GET /health, asked
    again and again as each is in flight, answers at once: their work is bounded and off the event loop."""
    fdfa = "\ufdfa"
    hostile = [({"sentences": [fdfa * 349_000]}, "349000 characters; the limit is 4096 per sentence"),  # 1 MiB
               ({"sentences": [fdfa * 1300] * 256}, "23400 characters after NFKC normalisation (1300 before); the "
                "limit is 4096 per sentence"),
               ({"sentences": ["word " * 800] * 256, "beam": 16}, "the request's decoding cost is")]
    with serving(model_dir) as server:
        for body, needle in hostile:
            data = json.dumps(body, ensure_ascii=False).encode()
            assert len(data) <= 1 << 20  # under --max-body-bytes: the body is read and parsed
            answer: list = []
            sender = threading.Thread(target=lambda out, d: out.append(server.call("POST", "/translate", d)),
                                      args=(answer, data))
            sender.start()
            waits = []
            while sender.is_alive() or len(waits) < 3:
                start = time.perf_counter()
                assert server.call("GET", "/health", timeout=30)[0] == 200
                waits.append(time.perf_counter() - start)
            sender.join()
            assert max(waits) < 0.5, (needle, waits)
            status, error = answer[0]
            assert status == 413 and needle in error["error"], (status, error)


def test_scores_give_each_translation_its_mean_logprob_and_confidence(model_dir, corpus_dir):
    """"scores": true answers {"text", "mean_logprob", "confidence"} per sentence, as nmt translate --scores writes
    them; n-best entries add them to {"text", "score"}."""
    lines = (corpus_dir / "test.en").read_text(encoding="utf-8").splitlines()[:4]
    with serving(model_dir) as server:
        status, answer = server.call("POST", "/translate", {"sentences": lines, "beam": 2, "scores": True})
        nbest = server.call("POST", "/translate", {"sentences": lines[:1], "beam": 2, "nbest": 2, "scores": True})[1]
        plain = server.call("POST", "/translate", {"sentences": lines[:1], "beam": 2, "scores": False})[1]
    rows = [line.split("\t") for line in nmt_translate(model_dir, lines, "--beam", "2", "--scores")]
    assert status == 200 and [t["text"] for t in answer["translations"]] == [r[0] for r in rows]
    assert [x for t in answer["translations"] for x in (t["mean_logprob"], t["confidence"])] == pytest.approx(
        [float(x) for r in rows for x in r[1:]], abs=1e-4)
    assert [set(t) for t in nbest["translations"][0]] == [{"text", "score", "mean_logprob", "confidence"}] * 2
    assert nbest["translations"][0][0]["mean_logprob"] == pytest.approx(answer["translations"][0]["mean_logprob"])
    assert plain["translations"] == [rows[0][0]]


@pytest.mark.slow
def test_a_glossary_puts_its_terms_in_the_translations_as_nmt_translate_does_and_is_bounded(model_dir, corpus_dir,
                                                                                            tmp_path):
    """"glossary": [[source term, target term], ...] translates as nmt translate --glossary does (the target term in
    the translation of a sentence holding the source term); more than 256 pairs or a term over 256 characters is
    413, a malformed or contradictory glossary 400, each naming what is wrong."""
    lines = (corpus_dir / "test.en").read_text(encoding="utf-8").splitlines()[:3]
    targets = (corpus_dir / "test.xx").read_text(encoding="utf-8").splitlines()[:3]
    pairs = [[lines[0].split()[1], targets[0].split()[0]], [lines[1].split()[-1].strip("?.!"), targets[1].split()[1]]]
    (tmp_path / "terms.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs), encoding="utf-8")
    hostile = [({"glossary": [["a", "b"]] * 257}, 413, "257 pairs; the limit is 256"),
               ({"glossary": [["a" * 257, "b"]]}, 413, "item 0 has a term of 257 characters"),
               ({"glossary": [["a", "b"], ["x", "\ufdfa" * 20]]}, 413, "item 1 has a term of 360 characters after NFKC"),
               ({"glossary": [["a"]]}, 400, "item 0: a term pair must be [source term, target term]"),
               ({"glossary": "a\tb"}, 400, "must be a list of [source term, target term] pairs"),
               ({"glossary": [["a", "b"], ["a", "c"]]}, 400, "item 1: source term 'a' is given twice"),
               ({"glossary": [["a", " "]]}, 400, "item 0: the target term is empty")]
    with serving(model_dir) as server:
        status, answer = server.call("POST", "/translate", {"sentences": lines, "beam": 2, "glossary": pairs})
        refused = [server.call("POST", "/translate", {"sentences": lines[:1], **body}) for body, _, _ in hostile]
    assert status == 200, answer
    assert answer["translations"] == nmt_translate(model_dir, lines, "--beam", "2", "--glossary",
                                                   str(tmp_path / "terms.tsv"))
    for (source, target), out in zip(pairs, answer["translations"]):
        assert re.search(rf"(?<!\w){re.escape(target)}(?!\w)", out), (source, target, out)
    for (status, body), (_, code, message) in zip(refused, hostile):
        assert status == code and message in body["error"], body


def test_a_marked_request_is_parsed_once_and_prepared_within_its_timeout(model_dir, monkeypatch):
    """The second audit (issue 47, row 4): each sentence was parsed twice (to price it, then in the model's call),
    and preparing it ran outside the request's timeout (a client waited 64 s past its 60). One parse per sentence;
    a request still being prepared when its timeout passes is answered 504 then."""
    import nmt.markup
    from nmt.tools.request_batcher import ServeConfig
    from nmt.tools.serve import build_app
    from nmt.translate import Translator

    parse, parsed = nmt.markup.parse, []

    def counted(sentence, *args, **kwargs):
        parsed.append(sentence)
        if "slowly" in sentence:
            time.sleep(1.5)
        return parse(sentence, *args, **kwargs)

    monkeypatch.setattr(nmt.markup, "parse", counted)
    translator = Translator.from_pretrained(model_dir)
    sentences = ["the <b>big dog</b> sees a cat .", "I &amp; you run .", "the cat sleeps ."]
    answers = asgi_requests(build_app(translator, ServeConfig()),
                            ("POST", "/translate", {"sentences": sentences, "beam": 2, "format": "html"}),
                            ("POST", "/translate", {"sentences": ["<i>slowly</i> ."], "format": "html",
                                                    "timeout": 0.5}))
    assert answers[0][0] == 200 and sorted(parsed) == sorted([*sentences[:2], "<i>slowly</i> ."]), (answers, parsed)
    assert answers[0][1]["translations"] == translator.translate(sentences, beam_size=2, format="html")
    assert answers[1][0] == 504 and "still preparing it" in answers[1][1]["error"], answers[1]


def test_format_html_keeps_the_tags_as_nmt_translate_does_and_bad_markup_is_400(model_dir):
    """"format": "html" (or "xml") answers what nmt translate --format writes; malformed xml, an unknown format
    and n-best with markup are 400 naming what is wrong."""
    sentences = ['the <b>big dog</b> sees a <i class="x">cat</i> .', "I &amp; you<br> run .", "the cat sleeps ."]
    with serving(model_dir) as server:
        status, answer = server.call("POST", "/translate", {"sentences": sentences, "beam": 2, "format": "html"})
        refused = [server.call("POST", "/translate", {"sentences": ["a", "a <b>c</i>"], "format": "xml"}),
                   server.call("POST", "/translate", {"sentences": ["a"], "format": "markdown"}),
                   server.call("POST", "/translate", {"sentences": ["a"], "format": "html", "beam": 2, "nbest": 2})]
    assert status == 200, answer
    assert answer["translations"] == nmt_translate(model_dir, sentences, "--beam", "2", "--format", "html")
    assert "<b>" in answer["translations"][0] and '<i class="x">' in answer["translations"][0]
    assert [s for s, _ in refused] == [400] * 3
    assert refused[0][1]["error"].startswith("sentence 1: not well-formed XML (mismatched tag at column 9)")
    assert refused[1][1]["error"] == "'format' must be one of 'text', 'html', 'xml', got 'markdown'"
    assert "format html gives one translation per sentence: leave out 'nbest'" in refused[2][1]["error"]
