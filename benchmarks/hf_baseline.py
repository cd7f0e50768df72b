"""The HF baseline: transformers' MarianMTModel trained the way the HF translation examples do.

A MarianMTModel from a config (d_model 256, 3+3 layers, 4 heads, FFN 1024, tied embeddings, MarianConfig's
dropout placement: 0.1 on embeddings and residual branches, none on attention weights or activations), a joint
BPE tokenizer of 8,000 trained with `tokenizers`, Accelerate in fp32, AdamW 5e-4 (0.9, 0.98), inverse-sqrt with
1,000 warmup steps, label smoothing 0.1, gradient clipping 1.0, ~4,096-token length-bucketed batches, validation
loss after every epoch with the best weights kept, and beam 4 with `generate` on the test set at the end
(transformers' other generation defaults: length penalty 1.0). BaselineConfig also takes a mixed precision and
a warmup sized to the peer's own steps (benchmarks/quality.py gives it nmt's plan that way).
The wall-clock budget covers training and validation, like nmt's max_minutes.

The data pipeline (reading, cleaning, BPE training, encoding, batching) is nmt's, so a side-by-side run
(benchmarks/quality.py --baseline) compares the model and the recipe, not the tokenizer code.

    python benchmarks/hf_baseline.py --data ../shared/data/tatoeba-en-de --minutes 25
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nmt.batching import (  # noqa: E402
    Collator,  # noqa: E402
    eval_batches,
    global_batches,
)
from nmt.config import DataConfig, TokenizerConfig  # noqa: E402
from nmt.data import Corpus, prepare  # noqa: E402
from nmt.encoding import pair_lengths  # noqa: E402
from nmt.metrics import corpus_scores  # noqa: E402
from nmt.tables import column  # noqa: E402
from nmt.tokenizer import BOS, EOS, PAD  # noqa: E402

TIMED_STEPS = 20  # steps a peer times before sizing its warmup to its own steps (BaselineConfig.warmup_share)


@dataclass
class BaselineConfig:
    """The baseline's recipe; sizes can be shrunk for a smoke test."""

    vocab_size: int = 8000
    d_model: int = 256
    layers: int = 3
    decoder_layers: int | None = None  # None: as many as the encoder's
    heads: int = 4
    ffn: int = 1024
    dropout: float = 0.1  # on embeddings and residual branches
    attention_dropout: float = 0.0  # on the attention weights: MarianConfig's default
    activation_dropout: float = 0.0  # on the feed-forward activation: MarianConfig's default
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 1000
    # None: warmup_steps as given; else that share of the steps the budget holds at this peer's own speed, timed
    # over its first TIMED_STEPS steps (as nmt's plan sizes its warmup to nmt's steps), at most max_warmup
    warmup_share: float | None = None
    max_warmup: int = 4000
    precision: str = "no"  # mixed precision: "no" (fp32) or "bf16" (autocast), as Accelerator(mixed_precision=...)
    label_smoothing: float = 0.1
    max_grad_norm: float = 1.0
    max_tokens: int = 4096
    beam: int = 4
    seed: int = 1


@dataclass
class BaselineResult:
    steps: int = 0
    epochs: int = 0
    train_seconds: float = 0.0
    tokens_per_s: float = 0.0
    best_valid_loss: float = math.inf
    best_epoch: int = 0
    scores: dict = field(default_factory=dict)
    valid_scores: dict = field(default_factory=dict)  # BLEU/chrF of the kept model on validation (valid=True)
    hypotheses: list[str] = field(default_factory=list)
    phases: dict = field(default_factory=dict)
    warmup_steps: int | None = None  # the warmup sized to the peer's own steps (warmup_share)


def marian(vocab: int, d_model: int, layers: int, heads: int, ffn: int, dropout: float,
           decoder_layers: int | None = None, **config) -> nn.Module:
    """A freshly initialized MarianMTModel with tied embeddings, in nmt's special ids; `config`: more
    MarianConfig fields (attention_dropout and activation_dropout: `dropout`'s unless given)."""
    from transformers import MarianConfig, MarianMTModel

    cfg = MarianConfig(vocab_size=vocab, d_model=d_model, encoder_layers=layers,
                       decoder_layers=decoder_layers or layers,
                       encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                       decoder_ffn_dim=ffn, activation_function="relu", dropout=dropout,
                       **{"attention_dropout": dropout, "activation_dropout": dropout, **config},
                       scale_embedding=True, pad_token_id=PAD, decoder_start_token_id=BOS,
                       eos_token_id=EOS, forced_eos_token_id=EOS)
    return MarianMTModel(cfg)


def marian_loss(model: nn.Module, batch: dict, smoothing: float) -> torch.Tensor:
    """Mean token cross-entropy, as HF's Seq2SeqTrainer computes it."""
    logits = model(input_ids=batch["src_ids"], attention_mask=batch["src_ids"].ne(PAD), use_cache=False,
                   decoder_input_ids=batch["tgt_in_ids"], decoder_attention_mask=batch["tgt_in_ids"].ne(PAD)).logits
    ce = nn.CrossEntropyLoss(label_smoothing=smoothing, ignore_index=PAD)
    return ce(logits.view(-1, logits.shape[-1]), batch["labels"].view(-1))


def _rows(split, order: np.ndarray) -> list[dict]:
    return [split[int(i)] for i in order]


@torch.no_grad()
def valid_loss(model: nn.Module, batches: list[dict]) -> float:
    """Token-level NLL (no smoothing) over collated batches."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        n = int(batch["labels"].ne(PAD).sum())
        total += float(marian_loss(model, batch, 0.0)) * n
        count += n
    model.train()
    return total / max(count, 1)


@torch.no_grad()
def translate(model: nn.Module, corpus: Corpus, split: str, beam: int, batch_size: int = 64) -> list[str]:
    """Beam search with `generate` over the split's encoded sources, in corpus order."""
    model.eval()
    data = corpus.splits[split]
    src_len, _ = pair_lengths(data)
    order = np.argsort(src_len, kind="stable")
    out: list[str] = [""] * len(order)
    for start in range(0, len(order), batch_size):
        idx = order[start: start + batch_size]
        src = Collator()(_rows(data, idx))["src_ids"]
        ids = model.generate(input_ids=src, attention_mask=src.ne(PAD), num_beams=beam,
                             max_new_tokens=int(src.shape[1] * 1.5) + 10)
        for i, text in zip(idx, corpus.tokenizer.decode_tgt(ids.tolist())):
            out[int(i)] = text
    return out


def train_baseline(data: DataConfig, minutes: float, cfg: BaselineConfig | None = None,
                   log=print, valid: bool = False) -> BaselineResult:
    """Trains the baseline for `minutes` of wall time, keeps the epoch with the best validation loss,
    and scores `data.test` with beam search (and, with `valid`, the validation set too, after the choice).
    The test set is read once, at the end."""
    from accelerate import Accelerator

    cfg = cfg or BaselineConfig()
    res = BaselineResult()
    t0 = time.perf_counter()
    corpus = prepare(data, TokenizerConfig(vocab_size=cfg.vocab_size, joint=True))
    res.phases["data + tokenizer"] = time.perf_counter() - t0
    torch.manual_seed(cfg.seed)
    accelerator = Accelerator(mixed_precision=cfg.precision)
    model = marian(corpus.tokenizer.tgt_vocab_size, cfg.d_model, cfg.layers, cfg.heads, cfg.ffn, cfg.dropout,
                   cfg.decoder_layers, attention_dropout=cfg.attention_dropout,
                   activation_dropout=cfg.activation_dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
    warmup = [cfg.warmup_steps]  # sized to this peer's own steps after TIMED_STEPS (warmup_share)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup[0], math.sqrt(warmup[0] / (s + 1))))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    train = corpus.splits["train"]
    cost, src_len = column(train, "cost"), pair_lengths(train)[0]  # nmt's pair_cost and ties, as nmt.train
    collate = Collator()
    valid = corpus.splits["valid"]
    valid_batches = [collate(_rows(valid, order))  # collated once, scored after every epoch
                     for order in eval_batches(column(valid, "cost"), cfg.max_tokens, 0, 1)]
    best_state, tokens, budget = None, 0, minutes * 60
    t0 = time.perf_counter()
    model.train()
    while time.perf_counter() - t0 < budget:
        for order in global_batches(cost, cfg.max_tokens, 1, cfg.seed + res.epochs, ties=src_len):
            batch = collate(_rows(train, order))
            loss = marian_loss(model, batch, cfg.label_smoothing)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            res.steps += 1
            tokens += int(batch["labels"].ne(PAD).sum())
            if cfg.warmup_share is not None and res.steps == TIMED_STEPS:
                steps = round(budget / ((time.perf_counter() - t0) / TIMED_STEPS))
                warmup[0] = max(1, min(cfg.max_warmup, round(cfg.warmup_share * steps)))
                log(f"hf baseline: {TIMED_STEPS} steps timed, ~{steps:,} in the budget: warmup {warmup[0]:,} steps")
                res.warmup_steps = warmup[0]
            if time.perf_counter() - t0 >= budget:
                break
        else:
            res.epochs += 1
        loss_v = valid_loss(model, valid_batches)
        log(f"hf baseline: step {res.steps} epoch {res.epochs} valid nll {loss_v:.3f} "
            f"({(time.perf_counter() - t0) / 60:.1f} min)")
        if loss_v < res.best_valid_loss:
            res.best_valid_loss, res.best_epoch = loss_v, res.epochs
            best_state = copy.deepcopy(accelerator.unwrap_model(model).state_dict())
    res.train_seconds = time.perf_counter() - t0
    res.tokens_per_s = tokens / res.train_seconds
    res.phases["training (incl. validation)"] = res.train_seconds
    model = accelerator.unwrap_model(model)
    model.load_state_dict(best_state)
    if valid:
        res.valid_scores = corpus_scores(translate(model, corpus, "valid", cfg.beam), corpus.splits["valid"]["tgt"])
    t0 = time.perf_counter()
    res.hypotheses = translate(model, corpus, "test", cfg.beam)
    res.scores = corpus_scores(res.hypotheses, corpus.splits["test"]["tgt"])
    res.phases[f"test translation (beam {cfg.beam}, {len(res.hypotheses)} sentences)"] = time.perf_counter() - t0
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train/valid/test.<src>/<tgt>")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--minutes", type=float, default=25.0)
    parser.add_argument("--cache-dir", default=None, help="nmt's data cache (default: nmt's)")
    args = parser.parse_args()
    p = Path(args.data)
    extra = {"cache_dir": args.cache_dir} if args.cache_dir else {}
    data = DataConfig(train=str(p / "train"), valid=str(p / "valid"), test=str(p / "test"), src_lang=args.src,
                      tgt_lang=args.tgt, **extra)
    res = train_baseline(data, args.minutes)
    print(f"steps {res.steps} ({res.epochs} epochs), {res.tokens_per_s:.0f} target tokens/s, "
          f"best valid nll {res.best_valid_loss:.3f} after epoch {res.best_epoch}")
    print(f"test BLEU {res.scores['bleu']:.2f}  {res.scores['bleu_signature']}")
    print(f"test chrF {res.scores['chrf']:.2f}  {res.scores['chrf_signature']}")


if __name__ == "__main__":
    main()
