"""`train(cfg)`: a run from start to finish, calling the jobs of the other modules in order.

State lives in Accelerate (`save_state` of the objective, optimizer, scheduler and RNG) plus our JSON
`TrainState`. The same code runs on 1 process, N processes or N nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import torch
from accelerate.utils import set_seed

from nmt import checkpoint as ckpt
from nmt.compat import accelerate_state_exists, reset_accelerate_state
from nmt.config import TrainConfig
from nmt.data import prepare
from nmt.launch import main_process_first
from nmt.model_dir import SUMMARY_FILE
from nmt.objective import pad_id_of
from nmt.training.artifacts import publish_final, start_run
from nmt.training.evaluation import try_average, tune_alpha
from nmt.training.finetune import pretrained
from nmt.training.loop import Loop, StopSignals
from nmt.training.planning import planned, save_plan
from nmt.training.resume import claim_output_dir, resume
from nmt.training.setup import (
    build_model,
    check_trackers,
    make_accelerator,
    make_loader,
    prepare_objective,
    resumed_sizes,
    run_sizes,
)
from nmt.training.state import Run, TrainResult
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
        if fresh and accelerate_state_exists() and PartialState().num_processes == 1:
            reset_accelerate_state()


def _train(cfg: TrainConfig, model: torch.nn.Module | None) -> TrainResult:
    check_run(cfg)  # every range and path key, before any work
    check_trackers(cfg.log_with)
    accelerator = make_accelerator(cfg)
    found = claim_output_dir(accelerator, cfg)  # the checkpoints to resume from (none: a fresh run)
    set_seed(cfg.seed)
    cfg, tokenizer = pretrained(resumed_sizes(cfg))  # init_from: the model directory's sizes and tokenizer
    # the others wait outside any collective (no timeout) while the main process prepares
    corpus = prepare(cfg.data, cfg.tokenizer, functools.partial(main_process_first, local=not cfg.data.shared_cache),
                     tokenizer=tokenizer)
    cfg, plan = planned(accelerator, cfg, corpus)
    cfg = run_sizes(accelerator, cfg, corpus)
    model = build_model(cfg, corpus.tokenizer, model)
    loader, sampler = make_loader(accelerator, cfg, corpus, pad_id_of(model))
    # epoch 0's steps: under BPE-dropout epochs differ by a few steps, and a resumed run must count the same total
    total = cfg.max_steps or cfg.max_epochs * sampler.steps_per_epoch(0)
    cfg, total = decay_horizon(cfg, total)
    objective, optim = prepare_objective(accelerator, cfg, model)
    run = Run(accelerator, cfg, corpus, objective)
    if found:
        run.state = resume(run, sampler, found)
    start_run(run)
    if plan is not None and run.is_main:
        save_plan(plan, run.out)
    with StopSignals() as signals:
        stopped_by = Loop(run, optim, loader, sampler, total)(signals)
    if stopped_by in ("SIGTERM", "SIGINT"):
        accelerator.end_training()
        return TrainResult(None, run.state.step, stopped_by=stopped_by,
                           checkpoint=ckpt.list_checkpoints(cfg.output_dir)[-1])
    return finish(run)


def decay_horizon(cfg: TrainConfig, total: int) -> tuple[TrainConfig, int]:
    """A linear schedule ends training where its lr reaches 0: at optim.decay_steps, or at the run's own end."""
    if cfg.optim.schedule != "linear":
        return cfg, total
    if cfg.optim.decay_steps is None:
        return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_steps=total)), total
    return cfg, min(total, cfg.optim.decay_steps)


def finish(run: Run) -> TrainResult:
    """The final model directory: the checkpoint average if asked for and no worse, else best/."""
    if run.cfg.average_last > 1:
        try_average(run)
    final = publish_final(run)
    tuned = tune_alpha(run, final) if run.cfg.tune_alpha else {}
    run.accelerator.end_training()
    summary = json.loads((final / SUMMARY_FILE).read_text())
    return TrainResult(final, run.state.step, {**summary["metrics"], **tuned})

