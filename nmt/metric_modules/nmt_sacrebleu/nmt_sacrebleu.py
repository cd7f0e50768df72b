"""Local `evaluate` metric: corpus BLEU and chrF from sacreBLEU, with their signatures.

Loaded by file path (``evaluate.load(path)``), so it needs no network and no Hub download.
"""

import datasets
import evaluate
from sacrebleu.metrics import BLEU, CHRF

_DESCRIPTION = (
    "Corpus BLEU and chrF computed by sacreBLEU on detokenized, cased text, with one "
    "reference per hypothesis, returned together with the sacreBLEU signature strings."
)

_CITATION = (
    "@inproceedings{post-2018-call, title={A Call for Clarity in Reporting BLEU Scores}, "
    "author={Post, Matt}, booktitle={Proceedings of the Third Conference on Machine "
    "Translation: Research Papers}, year={2018}, pages={186--191}}"
)

_KWARGS_DESCRIPTION = (
    "Args:\n"
    "    predictions (list of str): detokenized system outputs, one per segment.\n"
    "    references (list of str): detokenized references, one per segment.\n"
    "    tokenize (str): sacreBLEU tokenizer for BLEU, default '13a'.\n"
    "    lowercase (bool): lowercase before scoring, default False (cased).\n"
    "Returns:\n"
    "    bleu, chrf (float, 0-100), bleu_signature, chrf_signature (str), precisions\n"
    "    (list of 4 floats), bp, sys_len, ref_len, counts, totals, chrf_name.\n"
)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class NmtSacrebleu(evaluate.Metric):
    """sacreBLEU corpus BLEU and chrF for one reference per hypothesis."""

    def _info(self) -> evaluate.MetricInfo:
        """Describes the metric and its input features.

        Returns:
            The metric's info.
        """
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string"),
                    "references": datasets.Value("string"),
                }
            ),
            codebase_urls=["https://github.com/mjpost/sacreBLEU"],
            reference_urls=["https://aclanthology.org/W18-6319"],
        )

    def _compute(
        self,
        predictions: list[str],
        references: list[str],
        tokenize: str = "13a",
        lowercase: bool = False,
    ) -> dict:
        """Scores the corpus.

        Args:
            predictions: Detokenized hypotheses, one per segment.
            references: Detokenized references, one per segment.
            tokenize: sacreBLEU tokenizer used by BLEU.
            lowercase: Whether to lowercase before scoring.

        Returns:
            BLEU and chrF scores, their signatures and the BLEU details.
        """
        hypotheses = list(predictions)
        reference_streams = [list(references)]
        bleu_metric = BLEU(tokenize=tokenize, lowercase=lowercase)
        chrf_metric = CHRF(lowercase=lowercase)
        bleu = bleu_metric.corpus_score(hypotheses, reference_streams)
        chrf = chrf_metric.corpus_score(hypotheses, reference_streams)
        return {
            "bleu": float(bleu.score),
            "chrf": float(chrf.score),
            "bleu_signature": bleu_metric.get_signature().format(),
            "chrf_signature": chrf_metric.get_signature().format(),
            "chrf_name": chrf.name,
            "precisions": [float(p) for p in bleu.precisions],
            "bp": float(bleu.bp),
            "sys_len": int(bleu.sys_len),
            "ref_len": int(bleu.ref_len),
            "counts": [int(c) for c in bleu.counts],
            "totals": [int(t) for t in bleu.totals],
        }
