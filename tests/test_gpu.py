"""On a real GPU (`pytest -m gpu`; skipped without CUDA): what the CPU proofs (tests/helpers.OffHost, FakeTensor) stand
in for, checked on the device itself with torch.cuda.set_sync_debug_mode.

- a training step synchronizes once (its figures, read together), a beam search once a step;
- `nmt train` on a GPU trains in mixed precision with TF32 products, prefetching into pinned memory;
- bf16 weights decode as fp32 ones do on a trained model.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from helpers import src_batch, tgt_in_batch, tiny_model

from nmt.config import TrainConfig
from nmt.decoding import SearchConfig, beam_search
from nmt.model import Seq2SeqLoss
from nmt.training.loop import OneDevice, make_optim, train_step
from tests.conftest import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu import host_syncs  # noqa: E402  (the device check's count: torch.cuda.set_sync_debug_mode's warnings)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def windows(device: str, n: int = 3) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for lengths in ([5, 3], [7, 2, 4], [3])[:n]:
        tgt = tgt_in_batch(gen, lengths, 30)
        out.append({"src_ids": src_batch(gen, lengths, 30).to(device), "tgt_in_ids": tgt.to(device),
                    "labels": torch.cat([tgt[:, 1:], torch.zeros_like(tgt[:, :1])], 1).to(device)})
    return out


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_training_step_synchronizes_once(precision):
    model = tiny_model(vocab=30, dropout=0.1).cuda().train()
    objective = Seq2SeqLoss(model, 0.1)
    cfg = TrainConfig()
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 10
    optim, one, window = make_optim(objective, cfg), OneDevice(torch.device("cuda"), 3, precision), windows("cuda")
    train_step(one, objective, optim, window)  # warm-up: allocator, kernels
    assert host_syncs(torch.device("cuda"), lambda: train_step(one, objective, optim, window)) == 1


def test_a_beam_search_reads_the_device_once_a_step():
    model = tiny_model(vocab=30).cuda().eval()
    src = windows("cuda", 1)[0]["src_ids"]
    config = SearchConfig(beam_size=4, max_len_a=0.0, max_len_b=8.0, max_new_tokens=8)
    with torch.inference_mode():
        beam_search(model, src, config)
        calls = host_syncs(torch.device("cuda"), lambda: beam_search(model, src, config))
    assert calls <= 8 + 1  # one read a step (is every hypothesis finished?) and the results once


def test_nmt_train_on_a_gpu_is_mixed_precision_with_tf32_and_pinned_prefetching(corpus_dir, tmp_path, monkeypatch):
    from nmt import train
    from nmt.training import loop
    from nmt.training import run as training_run

    pinned, made = [], []
    fetch, make = loop.Prefetcher.next, training_run.make_accelerator

    def fetched(self):
        window, position = fetch(self)
        pinned.extend(b["src_ids"].is_pinned() for b in window)
        return window, position

    def accelerator(cfg, precision):
        made.append(make(cfg, precision))
        return made[-1]

    monkeypatch.setattr(loop.Prefetcher, "next", fetched)
    monkeypatch.setattr(training_run, "make_accelerator", accelerator)
    train(tiny_config(corpus_dir, tmp_path, max_steps=6, eval_every=6, save_every=6))
    assert made[0].device.type == "cuda" and str(made[0].mixed_precision) in ("bf16", "fp16")
    assert torch.backends.cuda.matmul.allow_tf32 and pinned and all(pinned)


def test_bf16_weights_decode_as_fp32_ones_on_a_trained_model(corpus_dir, tmp_path):
    from nmt import Translator, train

    cfg = tiny_config(corpus_dir, tmp_path, max_steps=200, eval_every=200, save_every=200)
    train(dataclasses.replace(cfg, max_steps=200))
    sources = (corpus_dir / "test.en").read_text(encoding="utf-8").splitlines()[:20]
    fp32 = Translator.from_pretrained(Path(cfg.output_dir) / "model", device="cuda").translate(sources, beam_size=4)
    bf16 = Translator.from_pretrained(Path(cfg.output_dir) / "model", device="cuda", dtype="bf16").translate(
        sources, beam_size=4)
    assert sum(a == b for a, b in zip(fp32, bf16)) >= 0.9 * len(sources)
