"""`train(cfg)`: a run from start to finish, calling the jobs of the other modules in order.

State lives in Accelerate (`save_state` of the objective, optimizer, scheduler and RNG) plus our JSON
`TrainState`. The same code runs on 1 process, N processes or N nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed

from nmt import checkpoint as ckpt
from nmt.compat import accelerate_state_exists, reset_accelerate_state
from nmt.config import TrainConfig
from nmt.data import prepare
from nmt.launch import main_process_first
from nmt.model_dir import CONFIG_FILE, SUMMARY_FILE
from nmt.plan import Plan
from nmt.textfiles import atomic_file
from nmt.training.evaluation import try_average, tune_alpha
from nmt.training.finetune import pretrained
from nmt.training.loop import Loop, StopSignals
from nmt.training.planning import planned, tokenizer_for_data
from nmt.training.setup import (
    build_model,
    check_trackers,
    make_accelerator,
    make_loader,
    prepare_objective,
)
from nmt.training.state import (
    Run,
    TrainResult,
    claim_output_dir,
    load_plan,
    publish_final,
    release_output_dir,
    resume,
    resumed_tokenizer,
    save_plan,
    start_run,
)
from nmt.validate import check_run


def train(cfg: TrainConfig, model: torch.nn.Module | None = None) -> TrainResult:
    """Train a model as `cfg` says; `model` (optional) is your own nn.Module following the contract
    `forward(src_ids, tgt_in_ids) -> logits (B, T, V)`. Returns where the final model was saved.

    In a single process (a notebook, a script) Accelerate's process-wide state is cleared again at the
    end, so train() can be called again with other settings, or followed by notebook_launcher.
    """
    from accelerate.state import PartialState

    fresh = not accelerate_state_exists()
    try:
        return _train(cfg, model)
    finally:
        release_output_dir(cfg.output_dir)
        if fresh and accelerate_state_exists() and PartialState().num_processes == 1:
            reset_accelerate_state()


def _train(cfg: TrainConfig, model: torch.nn.Module | None) -> TrainResult:
    started = time.monotonic()  # the time budget counts from here: data preparation and planning spend it too
    check_run(cfg)  # every range and path key, before any work
    check_trackers(cfg.log_with)
    accelerator = make_accelerator(cfg)
    found = claim_output_dir(accelerator, cfg)  # the checkpoints to resume from (none: a fresh run)
    set_seed(cfg.seed)
    previous = load_plan(Path(cfg.output_dir)) if found else None  # a resumed run keeps its plan
    given, tokenizer, inherited = pretrained(cfg)  # init_from: the model directory's architecture and tokenizer
    tokenizer = resumed_tokenizer(found) or tokenizer  # a resume encodes with the run's own tokenizer, never a new one
    for_data = tokenizer_for_data(given, previous)
    # the others wait outside any collective (no timeout) while the main process prepares
    corpus = prepare(for_data.data, for_data.tokenizer,
                     functools.partial(main_process_first, local=not cfg.data.shared_cache), tokenizer=tokenizer,
                     max_positions=given.model.max_positions)
    cfg, plan = resolved(accelerator, given, corpus, inherited, previous, started)
    model = build_model(cfg, corpus.tokenizer, model)
    loader, sampler = make_loader(accelerator, cfg, corpus, model)
    objective, optim = prepare_objective(accelerator, cfg, model)
    run = Run(accelerator, cfg, corpus, objective, plan=plan, started=started)
    if found:
        run.state = resume(run, sampler, found)
        run.started = started - run.state.elapsed_s  # the budget spent before the resume counts
    start_run(run)
    if run.is_main:
        save_plan(plan, run.out)
    with StopSignals() as signals:
        stopped_by = Loop(run, optim, loader, sampler)(signals)
    if stopped_by in ("SIGTERM", "SIGINT"):
        accelerator.end_training()
        return TrainResult(None, run.state.step, stopped_by=stopped_by,
                           checkpoint=ckpt.list_checkpoints(cfg.output_dir)[-1])
    return finish(run)


def resolved(accelerator, cfg: TrainConfig, corpus, inherited: dict[str, str], previous: Plan | None,
             started: float) -> tuple[TrainConfig, Plan]:
    """`cfg` resolved once for the run (`nmt.plan.resolve`): planned and timed on the main process, shared with
    the others (which apply the same choices), and printed."""
    box = [None]
    if accelerator.is_main_process:
        left = None if cfg.max_minutes is None else cfg.max_minutes - (time.monotonic() - started) / 60
        _, plan = planned(cfg, corpus, processes=accelerator.num_processes, device=str(accelerator.device),
                          precision=str(accelerator.mixed_precision), inherited=inherited, previous=previous,
                          minutes_left=left)
        box = [plan.to_dict()]
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(box)
    cfg, plan = planned(cfg, corpus, processes=accelerator.num_processes, inherited=inherited,
                        previous=Plan.from_dict(box[0]), timed=False)
    if accelerator.is_main_process:
        print("nmt: " + "\n".join(plan.lines()), flush=True)
    return cfg, plan


def finish(run: Run) -> TrainResult:
    """The final model directory (the checkpoint average if asked for and no worse, else best/), scored on the
    test set, and what the user has."""
    if run.cfg.average_last > 1:
        try_average(run)
    final = publish_final(run)
    tuned = tune_alpha(run, final) if run.cfg.tune_alpha else {}
    minutes = run.elapsed() / 60  # the budget's part: the test translation below is not training
    test = score_test(run, final)
    run.accelerator.end_training()
    summary = json.loads((final / SUMMARY_FILE).read_text())
    result = TrainResult(final, run.state.step, {**summary["metrics"], **tuned, "step": summary["step"]},
                         minutes=minutes, max_minutes=run.cfg.max_minutes, stop_reason=run.stop_reason,
                         epochs=run.epochs, test=test, commands=commands(run.cfg, final))
    if run.is_main:  # what the end of the run printed, for scripts
        with atomic_file(run.out / "summary.json") as f:
            f.write(json.dumps({**dataclasses.asdict(result), "model_dir": str(final)}, indent=2, default=str))
    return result


def score_test(run: Run, model_dir: Path) -> dict:
    """BLEU and chrF of the final model on the test split, beam 4 as `nmt evaluate` decodes (empty: no test set).
    The main process translates; the others wait. A test split of several language pairs is scored per pair
    (`nmt evaluate --tgt-lang` on each), bleu and chrf then being their means."""
    test = run.corpus.splits.get("test")
    scores = {}
    if run.is_main and test is not None and len(test) and (model_dir / CONFIG_FILE).is_file():  # nmt's model: searchable
        from nmt.metrics import corpus_scores
        from nmt.translate import Translator

        translator = Translator.from_pretrained(model_dir, device=run.accelerator.device)
        blocks = run.corpus.stats.get("eval_pairs", {}).get("test")
        if not blocks:
            hyps = translator.translate(list(test["src"]), beam_size=4)
            scores = {**{k: v for k, v in corpus_scores(hyps, list(test["tgt"])).items() if k in ("bleu", "chrf")},
                      "pairs": len(hyps)}
        else:
            scores = _score_pairs(translator, test, blocks)
        
    run.accelerator.wait_for_everyone()
    return scores


def _score_pairs(translator, test, blocks: list[list]) -> dict:
    """Test BLEU/chrF per language pair of a multilingual run (its sources start with their tags, which the
    translator adds itself from tgt_lang), and their means."""
    from nmt.metrics import corpus_scores

    scores, start, sources, refs = {}, 0, list(test["src"]), list(test["tgt"])
    for pair, n in blocks:
        if n:
            tag = sources[start][: sources[start].index(">") + 1]  # "<2de>..." -> <2de>, de
            hyps = translator.translate([s[len(tag):] for s in sources[start: start + n]], beam_size=4,
                                        tgt_lang=tag[2:-1])
            found = corpus_scores(hyps, refs[start: start + n])
            scores[f"bleu_{pair}"], scores[f"chrf_{pair}"] = found["bleu"], found["chrf"]
        start += n
    pairs = [pair for pair, n in blocks if n]
    return {"bleu": sum(scores[f"bleu_{p}"] for p in pairs) / len(pairs),
            "chrf": sum(scores[f"chrf_{p}"] for p in pairs) / len(pairs), **scores, "pairs": start}


def commands(cfg: TrainConfig, model_dir: Path) -> list[str]:
    """How to use the model: the commands to translate with it and to evaluate it on the test files."""
    src, ref = "TEST.SRC", "TEST.REF"
    test = cfg.data.test
    if isinstance(test, str) and Path(f"{test}.{cfg.data.src_lang}").is_file():
        src, ref = f"{test}.{cfg.data.src_lang}", f"{test}.{cfg.data.tgt_lang}"
    return [f"translate: nmt translate {model_dir} --input FILE --output FILE",
            f"evaluate:  nmt evaluate {model_dir} --src {src} --ref {ref}"]
