"""Tests for nmt.metrics: sacreBLEU parity, input checks, and loading with no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sacrebleu

from nmt.errors import NmtError
from nmt.metrics import corpus_scores, load_metric

REPO_ROOT = Path(__file__).resolve().parents[1]

EXAMPLES = [
    (
        ["The cat sat on the mat.", "Hello world", "It is raining today in Paris."],
        ["The cat sat on a mat.", "Hello, world!", "Today it rains in Paris."],
    ),
    (
        ["Das ist ein kleiner Test.", "Wir gehen morgen nach Hause.", ""],
        ["Das ist ein kleiner Test.", "Morgen gehen wir nach Hause.", "Ein leerer Satz."],
    ),
    (
        ["Ça marche très bien, merci !", "ONE two THREE"],
        ["Ça fonctionne très bien, merci !", "one two three"],
    ),
]

# Run in a subprocess before the test script: every way of opening a connection raises, and
# each attempt is counted so the script can show that loading the local metric made none.
NO_NETWORK_PRELUDE = """
import socket

ATTEMPTS = []


def _blocked(*args, **kwargs):
    ATTEMPTS.append(args[:2])
    raise OSError("network disabled by the test")


socket.socket.connect = _blocked
socket.socket.connect_ex = _blocked
socket.create_connection = _blocked
socket.getaddrinfo = _blocked
"""

OFFLINE_SCRIPT = """
import json
import sys

from nmt.metrics import corpus_scores

hyps, refs = json.loads(sys.argv[1])
scores = corpus_scores(hyps, refs)
local_attempts = len(ATTEMPTS)

import evaluate

try:
    evaluate.load("sacrebleu")
    hub_error = None
except Exception as error:
    hub_error = type(error).__name__ + ": " + str(error)[:200]
hub_attempts = len(ATTEMPTS) - local_attempts
report = {"scores": scores, "local_attempts": local_attempts, "hub_attempts": hub_attempts, "hub_error": hub_error}
print(json.dumps(report))
"""


@pytest.fixture(scope="module", autouse=True)
def _private_evaluate_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Points evaluate's module and metric caches at a temp dir, not the user's home."""
    import evaluate.config

    cache = tmp_path_factory.mktemp("hf_home")
    load_metric.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evaluate.config, "HF_MODULES_CACHE", cache / "modules")
        patch.setattr(evaluate.config, "HF_METRICS_CACHE", cache / "metrics")
        yield
    load_metric.cache_clear()


@pytest.mark.parametrize(("hyps", "refs"), EXAMPLES)
def test_scores_equal_sacrebleu(hyps: list[str], refs: list[str]) -> None:
    scores = corpus_scores(hyps, refs)
    bleu = sacrebleu.corpus_bleu(hyps, [refs])
    chrf = sacrebleu.corpus_chrf(hyps, [refs])
    assert scores["bleu"] == pytest.approx(bleu.score, abs=1e-9)
    assert scores["chrf"] == pytest.approx(chrf.score, abs=1e-9)
    assert scores["precisions"] == pytest.approx(bleu.precisions, abs=1e-9)
    assert scores["bp"] == pytest.approx(bleu.bp, abs=1e-12)
    assert (scores["sys_len"], scores["ref_len"]) == (bleu.sys_len, bleu.ref_len)
    assert scores["counts"] == list(bleu.counts)
    assert scores["totals"] == list(bleu.totals)


def test_signatures() -> None:
    scores = corpus_scores(*EXAMPLES[0])
    bleu_sig = scores["bleu_signature"]
    chrf_sig = scores["chrf_signature"]
    for part in ("nrefs:1", "case:mixed", "tok:13a", "smooth:exp", f"version:{sacrebleu.__version__}"):
        assert part in bleu_sig
    for part in ("nrefs:1", "case:mixed", "nc:6", "nw:0", f"version:{sacrebleu.__version__}"):
        assert part in chrf_sig
    assert scores["chrf_name"] == "chrF2"


def test_case_matters() -> None:
    hyps, refs = ["the cat sat on the mat"], ["The Cat Sat On The Mat"]
    assert corpus_scores(hyps, refs)["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert corpus_scores(hyps, refs)["bleu"] < 100.0


def test_perfect_match_is_100() -> None:
    texts = ["A perfect translation, word for word.", "Another sentence that matches exactly."]
    scores = corpus_scores(texts, list(texts))
    assert scores["bleu"] == pytest.approx(100.0)
    assert scores["chrf"] == pytest.approx(100.0)
    assert scores["bp"] == 1.0


def test_length_mismatch_names_counts() -> None:
    with pytest.raises(NmtError, match=r"3 hypotheses.*2 references"):
        corpus_scores(["a", "b", "c"], ["a", "b"])


def test_empty_raises() -> None:
    with pytest.raises(NmtError, match="nothing to score"):
        corpus_scores([], [])


def test_non_string_raises() -> None:
    with pytest.raises(NmtError, match="reference 1"):
        corpus_scores(["a", "b"], ["a", None])  # type: ignore[list-item]


def test_load_metric_is_cached() -> None:
    assert load_metric() is load_metric()


@pytest.mark.parametrize("offline_env", [True, False], ids=["offline-vars-set", "offline-vars-unset"])
def test_loads_with_no_network(tmp_path: Path, offline_env: bool) -> None:
    """Scoring works with sockets disabled; `evaluate.load("sacrebleu")` (the Hub) does not."""
    hyps, refs = EXAMPLES[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env["HF_HOME"] = str(tmp_path / "hf_home")  # empty cache: no copy of the Hub script to fall back on
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg_cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    if offline_env:
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_EVALUATE_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", NO_NETWORK_PRELUDE + OFFLINE_SCRIPT, json.dumps([hyps, refs])],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["local_attempts"] == 0
    assert report["scores"]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert report["scores"]["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert "tok:13a" in report["scores"]["bleu_signature"]
    # Why the local module exists: the Hub metric cannot be loaded under the same conditions.
    assert report["hub_error"] is not None
    if not offline_env:
        assert report["hub_attempts"] > 0  # it tried the network, and only the block stopped it
