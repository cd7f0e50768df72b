"""Everything before the first step: the Accelerator, the data pipeline, the model and its objective, the
optimizer, `prepare`, and restoring a checkpoint."""

from __future__ import annotations

import datetime
import inspect

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.logging import get_logger
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader

from nmt.adapters import apply_finetune
from nmt.batching import TokenBatchSampler
from nmt.collate import Collator
from nmt.compat import is_fsdp
from nmt.config import TrainConfig
from nmt.data import Corpus
from nmt.dropout_epochs import bpe_dropout
from nmt.encoding import source_lengths
from nmt.errors import NmtError
from nmt.model import Seq2SeqTransformer
from nmt.objective import Seq2SeqLoss
from nmt.tables import column
from nmt.tokenizer import PairTokenizer
from nmt.training.finetune import check_same_tokenizer
from nmt.training.loop import default_device, launched_precision, make_optim, run_precision

log = get_logger(__name__)


def check_trackers(names: list) -> None:
    """Every `log_with` name must be a tracker accelerate knows and whose package is installed: accelerate
    itself drops an unavailable one with a debug message, and the run would log nowhere without a word."""
    import accelerate.utils
    from accelerate.utils import LoggerType

    known = {t.value for t in LoggerType} - {"all"}
    for name in (n for n in names if isinstance(n, str)):  # tracker objects (GeneralTracker) pass as they are
        if name not in known:
            raise NmtError(f"log_with: unknown tracker '{name}'; accelerate knows {', '.join(sorted(known))}")
        if not getattr(accelerate.utils, f"is_{name}_available")():
            raise NmtError(f"log_with: tracker '{name}' is not installed; pip install {name} "
                           "(or remove it: metrics.jsonl is always written)")


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """The run's Accelerator; its mixed precision the launcher's, else chosen for the budget (`run_precision`)."""
    device_type = default_device().type
    precision = run_precision(cfg, device_type)
    accelerator = Accelerator(
        # without a GPU, processes started by torchrun (accelerate launch) must still join one gloo group
        cpu=device_type == "cpu",
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.accum_steps,
        log_with=cfg.log_with or None,
        project_dir=cfg.output_dir,
        # batches are sharded by our own sampler, so one scheduler step per optimizer step
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=cfg.dist_timeout_minutes))],
    )
    if precision == "bf16" and launched_precision() is None and accelerator.is_main_process:
        print(f"nmt: mixed precision bf16, chosen for the time budget: this {device_type.upper()} multiplies bf16 "
              "in hardware (ACCELERATE_MIXED_PRECISION=no trains in fp32)", flush=True)
    return accelerator


def build_model(cfg: TrainConfig, tokenizer: PairTokenizer, model: torch.nn.Module | None) -> torch.nn.Module:
    """nmt's model as `cfg.model` says, or the user's own (checked against the contract); compiled if asked."""
    if model is not None:
        check_same_tokenizer(model, tokenizer)
    elif cfg.init_from:  # fine-tuning: the directory's weights (its sizes are cfg.model's, see finetune.pretrained)
        model = Seq2SeqTransformer.from_pretrained(cfg.init_from, cfg=cfg.model)
    else:
        model = Seq2SeqTransformer(cfg.model)
    if cfg.finetune.freeze or cfg.finetune.lora_r:
        apply_finetune(model, cfg.finetune)  # parts frozen, or LoRA layers that alone train
    check_contract(model, tokenizer)
    if cfg.compile:  # in place: the module keeps its type, state_dict keys and save/load
        model.compile()
    return model


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
    """The model's `Seq2SeqLoss`, its optimizer and schedule, through `Accelerator.prepare`."""
    objective = Seq2SeqLoss(model, cfg.optim.label_smoothing, flat_state_dict=not is_fsdp(accelerator))
    optim = make_optim(objective, cfg)
    objective, optim.optimizer, optim.scheduler = accelerator.prepare(objective, optim.optimizer, optim.scheduler)
    register_search_methods(accelerator, accelerator.unwrap_model(objective).model)
    return objective, optim


def register_search_methods(accelerator: Accelerator, base: torch.nn.Module) -> None:
    """Under FSDP2 a module's sharded weights are gathered only inside forward(); search calls encode/decode/
    start_cache and each decoder layer's cross_kv, so FSDP is told to gather around those methods too (a no-op
    on a module that is not an FSDP unit: the model's own weights are the objective's, and validation under
    FSDP decodes a gathered copy)."""
    if not is_fsdp(accelerator):
        return
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name in ("encode", "decode", "start_cache"):
        if hasattr(base, name):
            register_fsdp_forward_method(base, name)
    for module in base.modules():
        if hasattr(module, "cross_kv"):  # a decoder layer: called outside forward when a cache starts
            register_fsdp_forward_method(module, "cross_kv")
