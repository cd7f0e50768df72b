"""Validation during training: loss and BLEU/chrF on the validation set, keeping the best model,
checkpoint averaging and tuning the length penalty. Decodes through `nmt.decoding`."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate.logging import get_logger

from nmt import checkpoint as ckpt
from nmt.batching import Collator, eval_batches
from nmt.checkpoint import SEARCH_FILE
from nmt.compat import is_fsdp
from nmt.decoding import SearchConfig, search_encoded
from nmt.loading import open_model
from nmt.metrics import scores_by_pair
from nmt.model import Seq2SeqLoss, Seq2SeqTransformer
from nmt.tables import column
from nmt.training import fsdp
from nmt.training.state import Run, log_metrics, plain_weights, save_model_dir

log = get_logger(__name__)


def never() -> bool:
    return False


@torch.no_grad()
def validate(run: Run, decode: bool = True, stop: Callable[[], bool] = never) -> dict | None:
    """Validation loss/perplexity and BLEU/chrF (if `decode`) over exactly the validation set, on all processes;
    None (on every process alike) when `stop` (a stop signal arrived) answered True meanwhile: it stops between
    batches, not after all of them."""
    run.objective.eval()
    plain = plain_copy(run) if is_fsdp(run.accelerator) else None
    metrics = valid_loss(run, plain, stop)
    if metrics is None or not decode:
        return metrics
    bleu = valid_bleu(run, plain, stop)
    return None if bleu is None else {**metrics, **bleu}


def bleu_due(cfg, step: int) -> bool:
    """Whether a validation at `step` also decodes (BLEU/chrF): always, except under a time budget while the
    learning rate of a model trained from scratch still warms up. Those early validations score the loss only: an
    untrained model's greedy hypotheses run to the length limit, the slowest decodes of the run and the least
    informative. A fine-tuned model (init_from) translates from the start, which every validation is compared with."""
    return cfg.max_minutes is None or bool(cfg.init_from) or step > (cfg.optim.warmup_steps or 0)


def valid_loss(run: Run, plain: torch.nn.Module | None = None, stop: Callable[[], bool] = never) -> dict | None:
    """Summed nll of the validation set through the objective, this process's share (which may be empty: a
    validation set of fewer batches than processes). The objective runs unwrapped, in the run's mixed precision:
    DDP's forward broadcasts buffers, a collective that a process with no batch would never join; under FSDP2,
    whose every layer gathers its weights in a collective, this process's `plain` copy runs instead."""
    accelerator, valid = run.accelerator, run.corpus.splits["valid"]
    objective, autocast = run.bare_objective, contextlib.nullcontext  # it keeps accelerate's autocast in forward
    if plain is not None:
        objective, autocast = Seq2SeqLoss(plain, run.cfg.optim.label_smoothing), accelerator.autocast
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # nll, tokens, stopped
    columns = valid.select_columns(["src_ids", "tgt_ids"])
    collate = Collator.for_model(run.model)
    for batch in eval_batches(column(valid, "cost"), run.cfg.max_tokens, rank, world):
        if stop():
            sums[2] = 1
            break
        b = {k: v.to(device) for k, v in collate.columns(columns[batch.tolist()]).items()}
        with autocast():
            _, nll, n = objective(b["src_ids"], b["tgt_in_ids"], b["labels"])
        sums[:2] += torch.stack([nll, n]).double()
    sums = accelerator.reduce(sums, "sum")
    if sums[2] > 0:
        return None
    nll = float(sums[0] / sums[1])
    return {"valid_nll": nll, "valid_ppl": math.exp(min(nll, 50))}


def valid_bleu(run: Run, plain: torch.nn.Module | None = None, stop: Callable[[], bool] = never) -> dict:
    """Decode this process's share of the validation sources (with its `plain` copy under FSDP2), gather all,
    score once."""
    base, accelerator = run.model if plain is None else plain, run.accelerator
    if not (hasattr(base, "encode") and hasattr(base, "decode")):
        return {}  # a user's model without encode/decode: loss only
    share = accelerator.process_index, accelerator.num_processes
    return score_valid(run, base, SearchConfig(beam_size=run.cfg.eval_beam), share, stop)


def score_valid(run: Run, base, search: SearchConfig, share: tuple[int, int],
                stop: Callable[[], bool] = never) -> dict | None:
    """BLEU/chrF of `base` (an unwrapped model, or None on processes that decode nothing) searching with
    `search` on the validation set, under the run's mixed precision: this process decodes share (rank, world), the
    main one scores.
    None on every process when `stop` cut the decoding short on any. A validation set of several
    language pairs is scored per pair (bleu_en-de, chrf_en-de, ...); bleu and chrf are then their means."""
    valid = run.corpus.splits["valid"]
    rows = valid_rows(run)
    picked = valid.select([i for _, idx in rows for i in idx])
    src_ids, n = picked["src_ids"], len(picked)
    rank, world = share
    with run.accelerator.autocast():  # in the precision the run trains in (bf16: faster, as the model is used)
        found = {} if base is None else search_encoded(base, src_ids, search, run.cfg.max_tokens, rank=rank,
                                                       world_size=world, device=run.accelerator.device,
                                                       stop=stop)
    mine = [(i, hyps[0].tokens) for i, hyps in found.items()] + ([(-1, None)] if stop() else [])
    gathered = dict(run.accelerator.gather_for_metrics(mine, use_gather_object=True))  # index -> tokens, each once
    if -1 in gathered:
        return None
    hyps, refs = run.corpus.tokenizer.decode_tgt([gathered[i] for i in range(n)]), picked["tgt"]
    return scores_by_pair(hyps, refs, [(pair, len(idx)) for pair, idx in rows])


def valid_rows(run: Run) -> list[tuple[str, list[int]]]:
    """The validation rows scored, by language pair: the first eval_max_sentences of the set, or of each language
    pair's part of it when it holds several (`nmt.data.CorpusStats.eval_pairs`); one entry ("", rows) otherwise."""
    valid, cap = run.corpus.splits["valid"], run.cfg.eval_max_sentences
    blocks = run.corpus.stats.eval_pairs.get("valid", [])
    if len({pair for pair, n in blocks if n}) < 2:
        return [("", list(range(min(len(valid), cap or len(valid)))))]
    out: dict[str, list[int]] = {}
    start = 0
    for pair, n in blocks:  # two parts of one pair are scored as one
        out.setdefault(pair, []).extend(range(start, start + n))
        start += n
    return [(pair, idx[:cap]) for pair, idx in out.items() if idx]


def plain_copy(run: Run) -> torch.nn.Module:
    """An unsharded copy of an FSDP2 model on every process, for validation: its forward runs no collective, so
    each process decodes its own share of the validation set, however many batches that share holds."""
    from torch.distributed.fsdp import FSDPModule

    weights = plain_weights(run.accelerator, run.objective, everywhere=True)  # every process takes part
    base = run.model
    cls = next(c for c in type(base).__mro__ if not issubclass(c, FSDPModule))  # fully_shard subclassed it
    copy = cls(base.cfg).to(run.accelerator.device)
    ckpt.load_into(copy, weights)
    return copy.eval()


def _shown(metrics: dict) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in metrics.items() if isinstance(v, float))


def score_line(metrics: dict) -> str:
    """The score validation keeps the best by, as words: "BLEU 21.30", or the loss of a model without search."""
    return f"BLEU {metrics['bleu']:.2f}" if "bleu" in metrics else f"validation loss (nll) {metrics['valid_nll']:.3f}"


def evaluate_and_keep_best(run: Run, decode: bool = True, stop: Callable[[], bool] = never) -> bool:
    """Validate (BLEU/chrF too if `decode`); a better score than before replaces best/. Logged, and one line on
    the terminal. False (on every process) when `stop` (a stop signal) cut the validation short: nothing is scored
    or kept."""
    state = run.state
    metrics = validate(run, decode, stop)
    if metrics is None:
        return False
    score, nll = metrics.get("bleu", -metrics["valid_nll"]), metrics["valid_nll"]
    improved = score > state.best_score or (score == state.best_score and nll < state.best_nll)  # a BLEU tie: the loss
    state.evals_since_best = 0 if improved else state.evals_since_best + 1
    if improved:
        state.best_score, state.best_nll, state.best_step = score, nll, state.step
        save_model_dir(run, run.out / "best", metrics)
    log_metrics(run, {k: v for k, v in metrics.items() if not isinstance(v, str)})
    if run.is_main:
        print(f"\nvalid @ step {state.step}: {_shown(metrics)}{' (best)' if improved else ''}", file=sys.stderr,
              flush=True)
    return True


def validate_start(run: Run, stop: Callable[[], bool] = never) -> bool:
    """Fine-tuning (init_from): the starting model validated before the first step, the same way every later
    validation is, and kept as the first best/ (so the final model is never worse on validation than the start);
    its scores go to `state.start`, which a resume keeps instead of validating again. False (on every process) when
    `stop` (a stop signal) cut it short."""
    state = run.state
    metrics = validate(run, decode=True, stop=stop)
    if metrics is None:
        return False
    state.start = {k: v for k, v in metrics.items() if isinstance(v, float)}
    state.best_score, state.best_nll = metrics.get("bleu", -metrics["valid_nll"]), metrics["valid_nll"]
    state.best_step, state.evals_since_best = 0, 0
    save_model_dir(run, run.out / "best", metrics)
    log_metrics(run, state.start)
    if run.is_main:
        pairs = sum(len(idx) for _, idx in valid_rows(run)) if "bleu" in metrics else len(run.corpus.splits["valid"])
        rest = _shown({k: v for k, v in metrics.items() if k != "bleu"})
        print(f"nmt: start: {score_line(metrics)} on the validation set ({pairs:,} pairs; {rest})", file=sys.stderr,
              flush=True)
    return True


def try_average(run: Run) -> None:
    """Average the last `average_last` checkpoints; it replaces best/ when it validates at least as well."""
    from nmt.checkpoint import average_weights, load_into

    found = ckpt.list_checkpoints(run.out)[-run.cfg.average_last:]
    if len(found) < 2:
        return
    weights = average_weights(found)  # every process loads the same files, so all agree
    if is_fsdp(run.accelerator):
        fsdp.load_full_weights(run.bare_objective, weights)
    else:
        load_into(run.model, weights)
    metrics = validate(run)
    if metrics is None:
        return
    score = metrics.get("bleu", -metrics["valid_nll"])
    names = ", ".join(d.name for d in found)
    if run.is_main:
        print(f"average of {names}: {_shown(metrics)} (best single: {run.state.best_score:.2f})", file=sys.stderr,
              flush=True)
    if score >= run.state.best_score:
        run.state.best_score, run.state.best_nll = score, metrics["valid_nll"]
        save_model_dir(run, run.out / "best", {**metrics, "averaged": names})


@torch.no_grad()
def tune_alpha(run: Run, model_dir: Path) -> dict:
    """Decode the validation set with the model kept in `model_dir`, with beam eval_beam, once for each length
    penalty of cfg.tune_alpha and the default; the best BLEU's alpha (`best_alpha`) is written to
    `model_dir/search.json`, where Translator takes its default alpha from, and logged to metrics.jsonl."""
    accelerator, cfg = run.accelerator, run.cfg
    if not isinstance(run.model, Seq2SeqTransformer):
        log.warning("tune_alpha: only nmt's own model can be reloaded for tuning; skipped", main_process_only=True)
        return {}
    kept = open_model(model_dir, accelerator.device).model.eval()  # every process: its share
    default, share = SearchConfig().alpha, (accelerator.process_index, accelerator.num_processes)
    bleu = {alpha: score_valid(run, kept, SearchConfig(beam_size=cfg.eval_beam, alpha=alpha), share)["bleu"]
            for alpha in sorted({*cfg.tune_alpha, default})}
    alpha = best_alpha(bleu, default)
    if run.is_main:
        _write_search_file(run, model_dir, alpha, bleu)
    log_metrics(run, {"tuned_alpha": alpha, "tuned_alpha_bleu": bleu[alpha], "default_alpha_bleu": bleu[default]})
    accelerator.wait_for_everyone()
    return {"alpha": alpha}


def _write_search_file(run: Run, model_dir: Path, alpha: float, bleu: dict[float, float]) -> None:
    beam, n = run.cfg.eval_beam, sum(len(idx) for _, idx in valid_rows(run))
    found = {"alpha": alpha, "beam_size": beam, "tuned_on": f"{n} validation pairs",
             "bleu": {str(a): b for a, b in bleu.items()}}
    tmp = model_dir / f".{SEARCH_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(found, indent=2))
    os.replace(tmp, model_dir / SEARCH_FILE)
    print(f"length penalty tuned on validation (beam {beam}): alpha {alpha} "
          f"(BLEU {bleu[alpha]:.2f}; " + ", ".join(f"{a}: {b:.2f}" for a, b in bleu.items()) + ")",
          file=sys.stderr, flush=True)


def best_alpha(bleu: dict[float, float], default: float) -> float:
    """The alpha of the highest BLEU; among equals the default, else the one nearest to it (then the smaller)."""
    top = max(bleu.values())
    return min((a for a, b in bleu.items() if b == top), key=lambda a: (abs(a - default), a))
