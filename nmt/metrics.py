"""Corpus BLEU and chrF (sacreBLEU, through `evaluate`) with their signature strings.

The metric is a local `evaluate` module shipped in the package, so scoring never needs the network.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from nmt.errors import NmtError

#: The local `evaluate` metric script (package data), loaded by path so nothing is downloaded.
METRIC_SCRIPT = Path(__file__).resolve().parent / "metric_modules" / "nmt_sacrebleu" / "nmt_sacrebleu.py"


@functools.cache
def load_metric() -> Any:
    """Loads the package's sacreBLEU metric through `evaluate`, from its local path.

    Loading by path works offline and with ``HF_HUB_OFFLINE`` / ``HF_EVALUATE_OFFLINE`` set or
    unset. `evaluate` copies the script into its modules cache (``HF_MODULES_CACHE``, under
    ``HF_HOME``); predictions are kept in memory, so no Arrow cache files are written.

    Returns:
        The loaded ``evaluate.EvaluationModule``.

    Raises:
        NmtError: If the metric script is missing from the installed package.
    """
    if not METRIC_SCRIPT.is_file():
        raise NmtError(f"metric script {METRIC_SCRIPT} is missing; reinstall the nmt package")
    import evaluate  # deferred: importing evaluate (and datasets) is slow

    return evaluate.load(str(METRIC_SCRIPT), keep_in_memory=True)


def corpus_scores(hypotheses: list[str], references: list[str]) -> dict:
    """Scores detokenized, cased hypotheses against one reference each.

    BLEU uses sacreBLEU's defaults (tokenize 13a, exp smoothing); chrF is chrF2 (nc 6, nw 0).

    Args:
        hypotheses: System outputs, one string per segment.
        references: References, one string per segment, in the same order.

    Returns:
        ``{"bleu": float, "chrf": float, "bleu_signature": str, "chrf_signature": str,
        "chrf_name": str, "precisions": list[float], "bp": float, "sys_len": int,
        "ref_len": int, "counts": list[int], "totals": list[int]}``.

    Raises:
        NmtError: If the lists differ in length, are empty, or hold a non-string.
    """
    hypotheses = list(hypotheses)
    references = list(references)
    if len(hypotheses) != len(references):
        raise NmtError(
            f"cannot score {len(hypotheses)} hypotheses against {len(references)} references; "
            "the counts must be equal (one reference per hypothesis)"
        )
    if not hypotheses:
        raise NmtError("nothing to score: 0 hypotheses and 0 references")
    for name, texts in (("hypothesis", hypotheses), ("reference", references)):
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise NmtError(f"{name} {index} is {type(text).__name__}, not a string")
    return load_metric().compute(predictions=hypotheses, references=references)


def scores_by_pair(hypotheses: list[str], references: list[str], blocks: list[tuple[str, int]]) -> dict:
    """BLEU and chrF of a set that holds several language pairs one after the other (`blocks`: (pair, rows) in
    order): {"bleu_en-de": .., "chrf_en-de": .., ...} for each pair with rows, and "bleu"/"chrf" their means (each
    pair counts once, however many rows it has). A set of one pair: that pair's scores as "bleu"/"chrf"."""
    blocks = [(pair, n) for pair, n in blocks if n]
    if len(blocks) < 2:
        found = corpus_scores(hypotheses, references)
        return {"bleu": found["bleu"], "chrf": found["chrf"], "bleu_signature": found["bleu_signature"]}
    out, start = {}, 0
    for pair, n in blocks:
        found = corpus_scores(hypotheses[start: start + n], references[start: start + n])
        out[f"bleu_{pair}"], out[f"chrf_{pair}"] = found["bleu"], found["chrf"]
        start += n
    means = {m: sum(out[f"{m}_{pair}"] for pair, _ in blocks) / len(blocks) for m in ("bleu", "chrf")}
    return {**means, **out, "bleu_signature": found["bleu_signature"]}
