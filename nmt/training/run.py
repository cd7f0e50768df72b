"""`train(cfg)`: a run from start to finish, and the jobs it calls, in the order it calls them.

`train` checks the config, makes the Accelerator, claims the output_dir (`nmt.training.state`), sets the run up
(`set_up`, one `Setup` value fixed for the run: what a model directory fixes (`init_from`: fine-tuning and continued
training), the data prepared, the config resolved once by `nmt.training.timing.planned` with the one timing probe,
printed and shared by every process), builds the model, its data loader, objective and optimizer, resumes from a
checkpoint, runs the `Loop` (`nmt.training.loop`), which returns how it ended, and finishes: the final model
directory, scored on the test set. `nmt check` calls the same functions (`inherited` here, `planned` and
`time_steps` in `nmt.training.timing`), so the check shows the plan that training follows.

A checkpoint holds the objective's weights, the optimizer's, schedule's and random states (safetensors and JSON:
`nmt.checkpoint.write_state`, never a pickle, so not Accelerate's `save_state`) and our JSON `TrainState`. The
same code runs on 1 process, N processes or N nodes.

Fine-tuning from a model directory (`init_from`): its architecture, tokenizer and weights are used as they are
(the tokenizer is never retrained: a new corpus is encoded with it), while the optimizer, schedule and step
count start fresh. The plan is a fine-tuning one (`nmt.plan`), and the loop validates the starting model before
its first step and keeps it as the first best, so the model written is never worse on validation than the start.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import inspect
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import accelerate.utils
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import PartialState
from accelerate.utils import InitProcessGroupKwargs, LoggerType, broadcast_object_list, gather_object, set_seed
from torch.utils.data import DataLoader

from nmt import checkpoint as ckpt
from nmt import plan as planlib
from nmt.adapters import apply_finetune
from nmt.batching import Collator, TokenBatchSampler, bpe_dropout
from nmt.checkpoint import CONFIG_FILE, SUMMARY_FILE, load_model_config, read_summary
from nmt.compat import (
    accelerate_state_exists,
    bound_onednn_primitive_caches,
    is_fsdp,
    reset_accelerate_state,
    set_process_group_timeout,
)
from nmt.config import SIZE_FIELDS, TrainConfig, from_dict, to_dict
from nmt.data import Corpus, prepare
from nmt.decoding import compile_decoder
from nmt.encoding import source_lengths
from nmt.errors import NmtError
from nmt.kernels import use_attention_path, use_cpu_kernels
from nmt.launch import main_process_first
from nmt.loading import open_model
from nmt.metrics import corpus_scores, scores_by_pair
from nmt.model import Seq2SeqTransformer
from nmt.plan import Plan, open_keys
from nmt.tables import column
from nmt.textfiles import atomic_file
from nmt.tokenizer import PairTokenizer
from nmt.training.evaluation import try_average, tune_alpha
from nmt.training.loop import (
    Loop,
    Outcome,
    StopSignals,
    default_device,
    make_objective,
    make_optim,
    run_precision,
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
from nmt.training.timing import Planned, planned
from nmt.translate import Translator
from nmt.validate import check_run

GLOO_SETTLE_S = 0.2  # close: the pause before the process group is destroyed


def train(cfg: TrainConfig, model: torch.nn.Module | None = None) -> TrainResult:
    """Train a model as `cfg` says; `model` (optional) is your own nn.Module following the contract
    `forward(src_ids, tgt_in_ids) -> logits (B, T, V)`. Returns where the final model was saved.

    In a single process (a notebook, a script) Accelerate's process-wide state is cleared again at the
    end, so train() can be called again with other settings, or followed by notebook_launcher.
    """
    fresh = not accelerate_state_exists()
    try:
        return _train(cfg, model)
    finally:
        # A run that raised leaves its objects to its traceback and reference cycles; DDP's reducer among them
        # holds the gloo process group. Freed by a later collection, that may be the interpreter's exit, where
        # gloo's threads can no longer take the GIL and abort the process ("terminate called without an active
        # exception"): free them now, while the interpreter runs (a run that ended frees them in `close`).
        gc.collect()
        release_output_dir(cfg.output_dir)
        if fresh and accelerate_state_exists() and PartialState().num_processes == 1:
            reset_accelerate_state()


def expandable_segments() -> None:
    """torch's CUDA allocator grows its segments in place rather than caching blocks of the sizes first asked for:
    training's batches change shape every step, which fragments such a cache until a step runs out of memory with
    gigabytes reserved but free. On unless PYTORCH_ALLOC_CONF (or the older PYTORCH_CUDA_ALLOC_CONF) says otherwise;
    it takes effect where this process has not used CUDA yet (an `nmt train`, a launched rank)."""
    if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


def _train(cfg: TrainConfig, model: torch.nn.Module | None) -> TrainResult:
    started = time.monotonic()  # the time budget counts from here: data preparation and planning spend it too
    expandable_segments()
    bound_onednn_primitive_caches()  # before the first bf16 matmul (nmt.compat)
    check_run(cfg)  # every range and path key, before any work
    check_trackers(cfg.log_with)
    precision = run_precision(cfg, default_device().type)  # (chosen, why): decided once, printed with the plan
    accelerator = make_accelerator(cfg, precision[0])
    found = claim_output_dir(accelerator, cfg)  # the checkpoints to resume from (none: a fresh run)
    set_seed(cfg.seed)
    setup = set_up(accelerator, cfg, found, started, precision)
    model = build_model(setup.cfg, setup.corpus.tokenizer, model)
    loader, sampler = make_loader(accelerator, setup.cfg, setup.corpus, model)
    # the settings in force (a resumed run's plan may have re-timed the schedule), the objective and optimizer
    settings = planlib.settings(setup.cfg, setup.plan)
    objective, optim = prepare_objective(accelerator, settings, model)
    state = resume(accelerator, settings, setup.corpus, objective, optim, sampler, found)  # fresh without found
    # the budget spent before a resume counts
    run = Run(accelerator, setup.cfg, setup.corpus, objective, optim, state, setup.plan, started - state.elapsed_s)
    start_run(run)
    if run.is_main:
        save_plan(setup.plan, run.out)
    with StopSignals() as signals:
        outcome = Loop(run, run.optim, loader, sampler)(signals)
    if outcome.stopped_by in ("SIGTERM", "SIGINT"):
        result = TrainResult(None, run.state.step, stopped_by=outcome.stopped_by,
                             checkpoint=ckpt.list_checkpoints(cfg.output_dir)[-1])
    else:
        result = finish(run, outcome)
    close(run)
    return result


@dataclass(frozen=True)
class Setup:
    """What setting a run up fixes before its first step (`set_up`), for the whole run."""

    cfg: TrainConfig  # the config resolved once (nmt.plan.resolve): the user's, with what init_from and the plan fix
    plan: Plan  # what nmt chose and why (a re-time during the run makes a new one: Run.follow)
    corpus: Corpus  # the prepared, encoded data, with its tokenizer


def set_up(accelerator: Accelerator, cfg: TrainConfig, found: list, started: float,
           precision: tuple[str, str | None]) -> Setup:
    """The run of `cfg` set up: what a model directory fixes (`init_from`), the data prepared and encoded with the
    run's tokenizer, the config resolved once (`resolved`). `found`: the checkpoints a resumed run continues from,
    whose plan and tokenizer it keeps."""
    previous = load_plan(Path(cfg.output_dir)) if found else None  # a resumed run keeps its plan
    base = inherited(cfg)  # init_from: the model directory's architecture and tokenizer
    tokenizer = resumed_tokenizer(found) or base.tokenizer  # a resume encodes with its own tokenizer, never a new one
    for_data = tokenizer_for_data(base.cfg, previous)
    # the others wait outside any collective (no timeout) while the main process prepares
    corpus = prepare(for_data.data, for_data.tokenizer,
                     functools.partial(main_process_first, local=not cfg.data.shared_cache), tokenizer=tokenizer,
                     max_positions=base.cfg.model.max_positions)
    once = resolved(accelerator, base.cfg, corpus, base.reasons, previous, started, precision)
    return Setup(once.cfg, once.plan, corpus)


# --- before the data: the accelerator, and what a model directory fixes (init_from) ---------------------------------


def check_trackers(names: list) -> None:
    """Every `log_with` name must be a tracker accelerate knows and whose package is installed: accelerate
    itself drops an unavailable one with a debug message, and the run would log nowhere without a word."""
    known = {t.value for t in LoggerType} - {"all"}
    for name in (n for n in names if isinstance(n, str)):  # tracker objects (GeneralTracker) pass as they are
        if name not in known:
            raise NmtError(f"log_with: unknown tracker '{name}'; accelerate knows {', '.join(sorted(known))}")
        if not getattr(accelerate.utils, f"is_{name}_available")():
            raise NmtError(f"log_with: tracker '{name}' is not installed; pip install {name} "
                           "(or remove it: metrics.jsonl is always written)")


def make_accelerator(cfg: TrainConfig, precision: str) -> Accelerator:
    """The run's Accelerator, training in mixed precision `precision` (`run_precision`: the launcher's, else
    chosen for the budget; the plan prints it). Its collectives wait `dist_timeout_minutes` at most, in a process
    group it makes or in one made before (`nmt.launch`, a notebook's own)."""
    timeout = datetime.timedelta(minutes=cfg.dist_timeout_minutes)
    made_before = torch.distributed.is_available() and torch.distributed.is_initialized()
    accelerator = Accelerator(
        # without a GPU, processes started by torchrun (accelerate launch) must still join one gloo group
        cpu=default_device().type == "cpu",
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.accum_steps,
        log_with=cfg.log_with or None,
        project_dir=cfg.output_dir,
        # batches are sharded by our own sampler, so one scheduler step per optimizer step
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)],
    )
    if made_before:  # the kwargs above apply only to a group the Accelerator makes itself
        set_process_group_timeout(timeout)
    if accelerator.device.type == "cuda":  # fp32 products (fp32 runs, the loss, the optimizer's) on tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return accelerator


@dataclass(frozen=True)
class Inherited:
    """What a model directory (`init_from`) fixes for a run."""

    cfg: TrainConfig  # the config with the directory's model and tokenizer settings
    tokenizer: PairTokenizer | None  # the directory's tokenizer (None without init_from)
    reasons: dict[str, str]  # each key the config left open and the directory fixed -> why (for the plan)


def inherited(cfg: TrainConfig) -> Inherited:
    """`cfg` with the model and tokenizer settings of `cfg.init_from`, its tokenizer (None without init_from), and
    the keys `cfg` left open that the model directory fixed, with that reason (for the plan's printout).

    Mismatches are errors naming the key: another language pair, a joint config for a separate-vocabulary model
    (or the reverse), a vocabulary size or model size the directory does not have. `model.dropout` may differ.
    """
    if not cfg.init_from:
        return Inherited(cfg, None, {})
    from nmt.interop import model_directory

    directory = model_directory(cfg.init_from, None, "init_from")  # a Hub id: the model directory it holds, or its import
    cfg = dataclasses.replace(cfg, init_from=str(directory)) if str(directory) != cfg.init_from else cfg
    if not directory.is_dir():
        raise NmtError(f"init_from {directory}: not a folder; give a trained model directory (output_dir/model)")
    model_cfg = load_model_config(directory)
    tokenizer = PairTokenizer.load_for(directory, model_cfg)
    trained = _training_config(directory)
    _check_languages(cfg, trained, directory)
    _check_tokenizer(cfg, tokenizer, trained, directory)
    _check_sizes(cfg, model_cfg, directory)
    if cfg.model.dropout is not None:
        model_cfg = dataclasses.replace(model_cfg, dropout=cfg.model.dropout)
    tok_cfg = dataclasses.replace(cfg.tokenizer, vocab_size=(trained.get("tokenizer") or {}).get("vocab_size")
                                  or tokenizer.tgt_vocab_size, kind=_kind(tokenizer))
    out = dataclasses.replace(cfg, model=model_cfg, tokenizer=tok_cfg)
    trained_lr = (trained.get("optim") or {}).get("lr")
    if cfg.optim.lr is None and not cfg.finetune.lora_r and isinstance(trained_lr, float):
        out = dataclasses.replace(out, optim=dataclasses.replace(out.optim, lr=trained_lr))
    fixed = set(open_keys(cfg)) - set(open_keys(out))
    why = {k: f"the model directory's (init_from {directory})" for k in fixed}
    if "optim.lr" in why:  # the plan's fine-tuning rule for a model nmt trained (nmt.plan.lr_for for the others)
        why["optim.lr"] = ("the peak rate the model was trained with (its training.json): fine-tuning a model nmt "
                           "trained, it validated best of 3e-5 to 1.3e-3 (docs/configuration.md)")
    if "model.dropout" in why:  # the plan's dropout for fine-tuning: the one the model was trained with
        trained_with = (trained.get("model") or {}).get("dropout") == model_cfg.dropout
        why["model.dropout"] = ("as the model was trained (its training.json)" if trained_with else
                                f"as the model directory sets it ({directory / CONFIG_FILE})")
    return Inherited(out, tokenizer, why)


def _training_config(directory: Path) -> dict:
    """The config the directory's model was trained with (its training.json), {} where it records none."""
    config = read_summary(directory).get("config", {})
    if not isinstance(config, dict):
        raise NmtError(f"{directory / SUMMARY_FILE}: its config is not a table; is {directory} a model directory "
                       "written by nmt?")
    return config


def _check_languages(cfg: TrainConfig, trained: dict, directory: Path) -> None:
    data = trained.get("data") or {}
    was, now = (data.get("src_lang"), data.get("tgt_lang")), (cfg.data.src_lang, cfg.data.tgt_lang)
    if None not in was and was != now:
        raise NmtError(f"init_from {directory}: it translates {was[0]}->{was[1]}, this config {now[0]}->{now[1]} "
                       "(data.src_lang / data.tgt_lang); fine-tune a model of the same language pair")


def _check_tokenizer(cfg: TrainConfig, tokenizer: PairTokenizer, trained: dict, directory: Path) -> None:
    if cfg.tokenizer.joint != tokenizer.joint:
        kind = "one joint vocabulary" if tokenizer.joint else "separate source and target vocabularies"
        raise NmtError(f"init_from {directory}: the model has {kind}; set tokenizer.joint: "
                       f"{str(tokenizer.joint).lower()} (the tokenizer comes from the model, it is not retrained)")
    given, had = cfg.tokenizer.vocab_size, (trained.get("tokenizer") or {}).get("vocab_size")
    if given is not None and given not in (had, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size):
        raise NmtError(f"init_from {directory}: tokenizer.vocab_size {given} is not the model's "
                       f"({had or tokenizer.tgt_vocab_size}); leave it null")


def _check_sizes(cfg: TrainConfig, model_cfg, directory: Path) -> None:
    for name in SIZE_FIELDS:
        given = getattr(cfg.model, name)
        if name != "dropout" and given is not None and given != getattr(model_cfg, name):
            raise NmtError(f"init_from {directory}: model.{name} is {getattr(model_cfg, name)} there, {given} in "
                           "this config; the architecture comes from the model directory (leave model sizes null)")


def _kind(tokenizer: PairTokenizer) -> str:
    return "unigram" if type(tokenizer.src.model).__name__ == "Unigram" else "bpe"


def tokenizer_for_data(cfg: TrainConfig, previous: planlib.Plan | None) -> TrainConfig:
    """`cfg` with the tokenizer settings a resumed run was started with, so data preparation reuses its
    tokenizer rather than training one of another size."""
    if previous is None:
        return cfg
    keep = {k: previous.chosen[k] for k in ("tokenizer.vocab_size",) if k in previous.chosen
            and planlib.get(cfg, k) is None}
    return planlib.put(cfg, keep)


# --- the resolution of a run, and the one timing probe ------------------------------------------------------------


def resolved(accelerator, cfg: TrainConfig, corpus, inherited: dict[str, str], previous: Plan | None,
             started: float, precision: tuple[str, str | None]) -> Planned:
    """`cfg` resolved once for the run (`nmt.plan.resolve`): planned and timed on the main process, which shares
    the resolved config and the plan with the others, and printed with the mixed precision `precision`
    (`run_precision`'s (chosen, why), which made the Accelerator)."""
    box = [None]
    if accelerator.is_main_process:
        left = None if cfg.max_minutes is None else cfg.max_minutes - (time.monotonic() - started) / 60
        cfg, plan = planned(cfg, corpus, processes=accelerator.num_processes, device=str(accelerator.device),
                            precision=str(accelerator.mixed_precision), inherited=inherited, previous=previous,
                            minutes_left=left)
        chosen, why = precision
        plan.precision = [chosen, why] if why and chosen == str(accelerator.mixed_precision) else None
        box = [(to_dict(cfg), plan.to_dict())]
    if accelerator.num_processes > 1:  # every process, the main one too, then holds the same plain-data copy
        broadcast_object_list(box)
        cfg, plan = from_dict(TrainConfig, box[0][0]), Plan.from_dict(box[0][1])
    if accelerator.is_main_process:
        print("nmt: " + "\n".join(plan.lines()), flush=True)
    return Planned(cfg, plan)


# --- the model, its data loader, objective and optimizer ------------------------------------------------------------


def build_model(cfg: TrainConfig, tokenizer: PairTokenizer, model: torch.nn.Module | None) -> torch.nn.Module:
    """nmt's model as `cfg.model` says, or the user's own (checked against the contract)."""
    if model is not None:
        check_same_tokenizer(model, tokenizer)
    elif cfg.init_from:  # fine-tuning: the directory's weights (its sizes are cfg.model's, see `inherited`)
        model = open_model(cfg.init_from, cfg=cfg.model).model
    else:
        model = Seq2SeqTransformer(cfg.model)
    if isinstance(model, Seq2SeqTransformer) and default_device().type == "cpu":  # before LoRA's own dropout
        use_cpu_kernels(model, fast_dropout=True)  # the CPU's faster dropout mask (nmt.kernels)
    if cfg.finetune.freeze or cfg.finetune.lora_r:
        apply_finetune(model, cfg.finetune)  # parts frozen, or LoRA layers that alone train
    check_contract(model, tokenizer)
    if cfg.compile and hasattr(model, "start_cache"):  # the training objective is compiled in prepare_objective
        compile_decoder(model)  # validation decodes through the compiled step
    return model


def check_same_tokenizer(model, tokenizer: PairTokenizer) -> None:
    """`train(cfg, model=M)` where M was loaded from a model directory: its tokenizer must be the run's."""
    origin = getattr(model, "pretrained_from", None)
    if origin is None or not Path(origin).is_dir():
        return
    try:
        theirs = PairTokenizer.load(origin)
    except NmtError:
        return  # weights saved without a tokenizer: nothing to compare
    if not theirs.same_as(tokenizer):
        raise NmtError(f"model was loaded from {origin}, but this run trained another tokenizer on its data, so the "
                       f"ids would mean other subwords; fine-tune with init_from={origin} (keeps its tokenizer)")


def check_contract(model: torch.nn.Module, tokenizer: PairTokenizer) -> None:
    """A clear error when a user's model does not follow forward(src_ids, tgt_in_ids) -> (B, T, V)."""
    if not isinstance(model, torch.nn.Module):
        raise NmtError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    name = type(model).__name__
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) != 2:
        raise NmtError(f"{name}.forward must take exactly (src_ids, tgt_in_ids) and derive masks itself; "
                       f"it requires {[p.name for p in params]}")
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(torch.tensor([[5, 6, 3]], device=device), torch.tensor([[2, 5]], device=device))
    if not isinstance(out, torch.Tensor) or out.dim() != 3 or tuple(out.shape[:2]) != (1, 2):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise NmtError(f"{name}.forward(src_ids (1,3), tgt_in_ids (1,2)) returned {shape}; expected logits (1, 2, V)")
    if out.shape[2] != tokenizer.tgt_vocab_size:
        raise NmtError(f"{name} predicts {out.shape[2]} classes but the target vocabulary has "
                       f"{tokenizer.tgt_vocab_size} tokens; build it with tgt_vocab_size={tokenizer.tgt_vocab_size}")
    for attr in ("pad_id", "bos_id", "eos_id"):
        if not hasattr(getattr(model, "cfg", None), attr) and not hasattr(model, attr):
            raise NmtError(f"{name} needs an attribute {attr} (or cfg.{attr}); nmt's tokenizers use pad 0, bos 2, eos 3")


def make_loader(accelerator: Accelerator, cfg: TrainConfig, corpus: Corpus, model: torch.nn.Module):
    """The training DataLoader and its TokenBatchSampler (this process's share of every optimizer step)."""
    train = corpus.splits["train"]
    dropout = bpe_dropout(cfg, corpus)
    sampler = TokenBatchSampler(column(train, "cost"), cfg.max_tokens, rank=accelerator.process_index,
                                world_size=accelerator.num_processes, accum_steps=cfg.accum_steps, seed=cfg.seed,
                                ties=source_lengths(train),  # source lengths: less padding
                                epoch_lengths=dropout.lengths if dropout else None, epoch_rows=corpus.epoch_rows)
    plain = train.select_columns(["src_ids", "tgt_ids"])
    # no worker processes: the BPE-dropout view reads sampler.epoch when a batch is fetched
    loader = DataLoader(dropout.view(lambda: sampler.epoch) if dropout else plain, batch_sampler=sampler,
                        collate_fn=Collator.for_model(model, cfg.pad_to_multiple_of),
                        # its own generator: each new iterator draws a seed, and drawing it from the global
                        # RNG would shift dropout after a resume (which starts a fresh iterator mid-epoch)
                        generator=torch.Generator())
    return loader, sampler


def prepare_objective(accelerator: Accelerator, cfg: TrainConfig, model: torch.nn.Module) -> tuple:
    """The model's `Seq2SeqLoss`, its optimizer and schedule, through `Accelerator.prepare`, for the settings
    `cfg` (a resumed run's: with what its plan re-timed). `compile: true` compiles the prepared
    objective, DDP's wrapper included: torch then splits the graph at DDP's gradient buckets, so their all-reduce
    overlaps the backward (an objective compiled inside DDP would hand it every gradient at the very end)."""
    objective = make_objective(model, cfg, flat_state_dict=not is_fsdp(accelerator), compile_now=False)
    if not cfg.compile:  # (compiled, the graph's own kernels run)
        why = use_attention_path(objective, str(accelerator.mixed_precision))
        if why and accelerator.is_main_process:
            print(f"nmt: {why}", flush=True)
    optim = make_optim(objective, cfg)
    objective, optim.optimizer, optim.scheduler = accelerator.prepare(objective, optim.optimizer, optim.scheduler)
    if cfg.compile:  # torch.compile(DDP(objective)), torch's way for DDP (accelerate's unwrap_model undoes both)
        wrapped = objective is not accelerator.unwrap_model(objective)  # DDP's own pre- and post-forward run eagerly
        objective = torch.compile(objective, fullgraph=not wrapped, dynamic=True)  # dynamic: see make_objective
    return objective, optim


# --- the end of a run ---------------------------------------------------------------------------------------------


def finish(run: Run, outcome: Outcome) -> TrainResult:
    """The final model directory (the checkpoint average if asked for and no worse, else best/), scored on the
    test set, and what the user has (`outcome`: how the loop ended)."""
    if run.cfg.average_last > 1:
        try_average(run)
    final = publish_final(run)
    tuned = tune_alpha(run, final) if run.cfg.tune_alpha else {}
    minutes = run.elapsed() / 60  # the budget's part: the test translation below is not training
    test = score_test(run, final)
    summary = read_summary(final)
    result = TrainResult(final, run.state.step, {**summary["metrics"], **tuned, "step": summary["step"]},
                         minutes=minutes, max_minutes=run.cfg.max_minutes, stop_reason=outcome.reason,
                         epochs=outcome.epochs, test=test, commands=commands(run.cfg, final), start=run.state.start)
    if run.is_main:  # what the end of the run printed, for scripts
        with atomic_file(run.out / "summary.json") as f:
            f.write(json.dumps({**dataclasses.asdict(result), "model_dir": str(final)}, indent=2, default=str))
    return result


def close(run: Run) -> None:
    """The run's end on this process: the trackers and the process group ended (`end_training`).
    On several processes a pause first: gloo's worker threads drop the last collective's tensors after it completed,
    under a lock of their own and needing the interpreter's lock to do so, while destroying the process group (at
    `end_training`, or when DDP's reducer, held by the Accelerator, is freed after it) takes their lock with the
    interpreter's held. Reached first, the destruction waited forever (a rank hung at the end of a run, about one
    run in five of test_parallel's property test); the pause lets the threads finish."""
    if run.accelerator.num_processes > 1:  # one process has no process group
        time.sleep(GLOO_SETTLE_S)
    run.accelerator.end_training()


def score_test(run: Run, model_dir: Path) -> dict:
    """BLEU and chrF of the final model on the test split, beam 4 as `nmt evaluate` decodes (empty: no test set),
    on every process. Each process translates its share of the sentences (`translate_shared`), so a large test set
    takes no longer than its share and no process waits on the others in a collective. A test split of several
    language pairs is scored per pair (`nmt evaluate --tgt-lang` on each), bleu and chrf then being their means."""
    test = run.corpus.splits.get("test")
    if test is None or not len(test) or not (model_dir / CONFIG_FILE).is_file():  # nmt's model: searchable
        return {}
    translator = Translator.from_pretrained(model_dir, device=run.accelerator.device)
    sources, refs = list(test["src"]), list(test["tgt"])
    blocks = run.corpus.stats.eval_pairs.get("test")
    if not blocks:
        hyps = translate_shared(run.accelerator, translator, sources)
        scores = corpus_scores(hyps, refs)
        return {"bleu": scores["bleu"], "chrf": scores["chrf"], "pairs": len(hyps)}
    hyps, start = [], 0
    for _, n in blocks:  # a multilingual run's sources start with their tags, which the translator adds itself
        if n:
            tag = sources[start][: sources[start].index(">") + 1]  # "<2de>..." -> <2de>, de
            hyps += translate_shared(run.accelerator, translator, [s[len(tag):] for s in sources[start: start + n]],
                                     tgt_lang=tag[2:-1])
        start += n
    scores = scores_by_pair(hyps, refs[:start], [(pair, n) for pair, n in blocks])
    return {k: v for k, v in scores.items() if k != "bleu_signature"} | {"pairs": start}


def translate_shared(accelerator: Accelerator, translator: Translator, sources: list[str], **options) -> list[str]:
    """`translator.translate(sources, beam_size=4)` shared by all processes: each translates every world-th
    sentence (an empty share too), and all receive every translation, in order."""
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = translator.translate(sources[rank::world], beam_size=4, **options)
    shares = gather_object([mine]) if world > 1 else [mine]  # one list per process, in rank order
    hyps = [""] * len(sources)
    for r, share in enumerate(shares):
        hyps[r::world] = share
    return hyps


def commands(cfg: TrainConfig, model_dir: Path) -> list[str]:
    """How to use the model: the commands to translate with it and to evaluate it on the test files."""
    src, ref = "TEST.SRC", "TEST.REF"
    test = cfg.data.test
    if isinstance(test, str) and Path(f"{test}.{cfg.data.src_lang}").is_file():
        src, ref = f"{test}.{cfg.data.src_lang}", f"{test}.{cfg.data.tgt_lang}"
    return [f"translate: nmt translate {model_dir} --input FILE --output FILE",
            f"evaluate:  nmt evaluate {model_dir} --src {src} --ref {ref}"]


# --- how well a model directory's tokenizer fits a new corpus (nmt check) -----------------------------------------
