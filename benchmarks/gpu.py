"""The GPU check: one prepared script of what a GPU user meets, under 5 minutes on one H100.

On a CUDA device (`size: base`, 16,384-token batches, the precision training picks: bf16 autocast where the GPU has
bf16 units, else fp16 with a scaler; TF32 for fp32 products, as `nmt train` sets them):

1. the device: its name, the datasheet's dense bf16 rate (H100 / H200 SXM, PCIe and NVL told apart) and a measured
   bf16 GEMM ceiling, against which each training rate is given as MFU;
2. training through the real loop (`nmt.train` on a synthetic corpus: accelerate, the DataLoader, collation, the
   prefetcher, checkpoints) beside `OneDevice` steps on preloaded batches (what the plan times), so the loop's cost
   shows as a ratio; host syncs of one step counted by `torch.cuda.set_sync_debug_mode`; peak memory;
3. the fused loss against the plain one, and compile on and off (tokens/s, peak memory);
4. decoding beam 4 with fp32, TF32 and bf16 weights (tokens/s, syncs a step, peak memory), and the compiled decoder
   on batches of uneven sizes (its translations against eager decoding's);
5. DDP on every GPU of the node (`accelerate launch --multi_gpu`) against one GPU's real loop.

On a CPU the same code runs at small sizes (tests/test_benchmarks.py runs it), so the check stays runnable:

    python benchmarks/gpu.py                    # CUDA: size base; a CPU: size tiny, a few steps
    python benchmarks/gpu.py --steps 10 --no-compile --sentences 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from decode_speed import batches as decode_batches  # noqa: E402

from nmt.config import DataConfig, ModelConfig, OptimConfig, TokenizerConfig, TrainConfig  # noqa: E402
from nmt.decoding import SearchConfig, beam_search, compile_decoder  # noqa: E402
from nmt.model import Seq2SeqLoss, Seq2SeqTransformer  # noqa: E402
from nmt.synthetic import generate_pairs  # noqa: E402
from nmt.training import timing  # noqa: E402
from nmt.training.loop import OneDevice, make_objective, make_optim, peak_memory_gib, run_precision, train_step  # noqa: E402

PAD, EOS = 0, 3
# dense bf16 tensor-core rates, FLOP/s, from NVIDIA's datasheets; the first name that torch's device name contains
# wins, so the NVL and PCIe parts come before the SXM one of the same chip
DATASHEET_BF16 = (
    ("H200 NVL", "H200 NVL", 835e12), ("H200", "H200 SXM", 989e12),
    ("H100 NVL", "H100 NVL", 835e12), ("H100 PCIe", "H100 PCIe", 756e12), ("H100", "H100 SXM", 989e12),
    ("A100", "A100", 312e12), ("L40S", "L40S", 362e12), ("L4", "L4", 121e12),
)


def datasheet(name: str) -> tuple[str, float] | None:
    """(the part, its dense bf16 FLOP/s) of a device named `name` (torch.cuda.get_device_name), None if unknown."""
    return next(((part, rate) for key, part, rate in DATASHEET_BF16 if key in name), None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_ceiling(device: torch.device, n: int) -> float:
    """FLOP/s of an n^3 matmul in bf16 (fp32 on a CPU), best of 5."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def flops_per_token(cfg: ModelConfig, src_len: float, tgt_len: float) -> float:
    """Training FLOPs per target token: 6 x the matmul parameters a token passes (encoder side scaled by the
    source/target length ratio) plus attention's score and value products, and the output projection."""
    d, f = cfg.d_model, cfg.d_ff
    enc = cfg.n_encoder_layers * (4 * d * d + 2 * d * f) * src_len / tgt_len
    dec = cfg.n_decoder_layers * (8 * d * d + 2 * d * f)
    attn = 2 * d * (cfg.n_encoder_layers * src_len**2 / tgt_len + cfg.n_decoder_layers * (tgt_len / 2 + src_len))
    return 6 * (enc + dec + d * cfg.tgt_vocab_size) + 6 * attn


def host_syncs(device: torch.device, step) -> int | None:
    """The synchronizing CUDA calls `step()` makes (torch.cuda.set_sync_debug_mode's warnings); None on a CPU."""
    if device.type != "cuda":
        step()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> str:
    """What training's progress line shows as mem= (`peak_memory_gib`): a GPU's tensors since `peak_reset`, a CPU
    process's resident peak since it started."""
    return f"{peak_memory_gib(device):.2f} GiB" + ("" if device.type == "cuda" else " (the process's resident peak)")


# --- the corpus and the real loop ----------------------------------------------------------------------------------


def write_corpus(d: Path, n: int) -> DataConfig:
    """`n` synthetic training pairs and 64 validation pairs as en/xx text files."""
    pairs = generate_pairs(n + 64, seed=0)
    for name, part in (("train", pairs[:n]), ("valid", pairs[n:])):
        (d / f"{name}.en").write_text("".join(a + "\n" for a, _ in part), encoding="utf-8")
        (d / f"{name}.xx").write_text("".join(b + "\n" for _, b in part), encoding="utf-8")
    return DataConfig(train=str(d / "train"), valid=str(d / "valid"), cache_dir=str(d / "cache"))


def run_config(data: DataConfig, out: Path, size: str, vocab: int, max_tokens: int, steps: int) -> TrainConfig:
    """A run of `steps` steps that validates and saves only at its end, logging every steps // 3."""
    return TrainConfig(data=data, tokenizer=TokenizerConfig(vocab_size=vocab), model=ModelConfig(size=size),
                       optim=OptimConfig(lr=5e-4, warmup_steps=100), max_tokens=max_tokens, max_steps=steps,
                       eval_every=10**6, save_every=10**6, log_every=max(1, steps // 3), eval_max_sentences=64,
                       average_last=0, output_dir=str(out))


def loop_rate(out: Path) -> float:
    """Target tokens/s of a finished run's training steps: its metrics.jsonl's log rows after the first (which
    holds the warm-up)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return statistics.mean(rates[1:] or rates)


def real_loop(cfg: TrainConfig, device: torch.device) -> tuple[float, str]:
    """`nmt.train(cfg)` as a user runs it: target tokens/s and peak memory."""
    from nmt import train

    peak_reset(device)
    train(cfg)
    return loop_rate(Path(cfg.output_dir)), peak_gib(device)


def ddp(cfg: TrainConfig, gpus: int) -> float:
    """`accelerate launch --multi_gpu --num_processes gpus run.py` of `cfg`: target tokens/s over all processes (a
    step's tokens are every process's)."""
    out = Path(cfg.output_dir)
    args = [f"--data.train={cfg.data.train}", f"--data.valid={cfg.data.valid}", f"--data.cache_dir={cfg.data.cache_dir}",
            f"--tokenizer.vocab_size={cfg.tokenizer.vocab_size}", f"--model.size={cfg.model.size}",
            f"--max_tokens={cfg.max_tokens}", f"--max_steps={cfg.max_steps}", f"--eval_every={cfg.eval_every}",
            f"--save_every={cfg.save_every}", f"--log_every={cfg.log_every}", "--average_last=0",
            f"--eval_max_sentences={cfg.eval_max_sentences}", f"--output_dir={out}"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(gpus),
           str(ROOT / "run.py"), *args]
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    return loop_rate(out)


# --- one device, preloaded batches -------------------------------------------------------------------------------


def preloaded(cfg: TrainConfig, n: int, device: torch.device) -> tuple[Seq2SeqTransformer, list[list[dict]]]:
    """The model the run trains (the prepared corpus's vocabulary) and `n` windows of its real batches on `device`,
    collated as the plan's probe collates them."""
    from nmt.batching import TokenBatchSampler
    from nmt.data import prepare
    from nmt.tables import column

    corpus = prepare(cfg.data, cfg.tokenizer)
    tok, train = corpus.tokenizer, corpus.splits["train"]
    model_cfg = replace(ModelConfig.preset(cfg.model.size), src_vocab_size=tok.src_vocab_size,
                        tgt_vocab_size=tok.tgt_vocab_size, share_embeddings=tok.joint, max_positions=512)
    torch.manual_seed(0)
    model = Seq2SeqTransformer(model_cfg)
    plan = TokenBatchSampler(column(train, "cost"), cfg.max_tokens, seed=0).plan(0)
    chunks = ([plan.batches[i % len(plan)]] for i in range(n))
    return model, list(timing.batches(cfg, train, chunks, device, model))


def one_device(model: Seq2SeqTransformer, cfg: TrainConfig, windows: list, device: torch.device, steps: int,
               precision: str, plain: bool = False) -> dict:
    """OneDevice steps over the preloaded `windows`, after one of each shape: tokens/s, syncs of a step, peak
    memory. The objective training builds (`make_objective`: the fused loss, or the compiled one under compile), or
    with `plain` the plain `Seq2SeqLoss`."""
    model = replace_weights(model).to(device).train()
    objective = Seq2SeqLoss(model, cfg.optim.label_smoothing) if plain else \
        make_objective(model, cfg)
    optim, one = make_optim(objective, cfg), OneDevice(device, 1, precision)
    peak_reset(device)
    started = time.perf_counter()
    for window in windows:  # warm-up: every shape once (compilation, allocator, cuBLAS plans)
        train_step(one, objective, optim, window)
    sync(device)
    warm_s = time.perf_counter() - started
    syncs = host_syncs(device, lambda: train_step(one, objective, optim, windows[0]))
    tokens, times = 0, []
    for i in range(steps):
        sync(device)
        start = time.perf_counter()
        stats = train_step(one, objective, optim, windows[i % len(windows)])
        sync(device)
        times.append(time.perf_counter() - start)
        tokens += stats.tokens
    return {"tok_s": tokens / sum(times), "warm_s": warm_s, "syncs": syncs, "peak": peak_gib(device),
            "median_ms": 1000 * statistics.median(times), "loss": stats.loss}


def replace_weights(model: Seq2SeqTransformer) -> Seq2SeqTransformer:
    """A fresh copy of `model` (each measurement starts from the same weights)."""
    copy = Seq2SeqTransformer(model.cfg)
    copy.load_state_dict(model.state_dict())
    return copy


# --- decoding ------------------------------------------------------------------------------------------------------


def search(model: Seq2SeqTransformer, ids: torch.Tensor, length: int) -> list:
    """Beam 4, `length` tokens for every sentence."""
    return beam_search(model, ids, SearchConfig(beam_size=4, max_len_a=length, max_len_b=0.0, max_new_tokens=length))


def decode(model: Seq2SeqTransformer, n: int, device: torch.device, compiled: bool = True) -> None:
    """Beam 4 with fp32, TF32 and bf16 weights on the same batches, every sentence generating exactly L tokens
    (</s> made impossible), then (`compiled`) the compiled decoder on batches of uneven sizes against eager
    decoding."""
    vocab = model.cfg.tgt_vocab_size
    with torch.no_grad():
        model.dec_norm.bias.fill_(1.0)
        model.tgt_embed.weight[EOS] = -30.0 / model.cfg.d_model
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(4, vocab, (k - 1,), generator=g).tolist() + [EOS]
            for k in torch.randint(5, 31, (n,), generator=g).tolist()]
    work = [(ids.to(device), L) for ids, L in decode_batches(srcs, 64)]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    for name, dtype, allow_tf32 in (("fp32", torch.float32, False), ("TF32", torch.float32, True),
                                    ("bf16", torch.bfloat16, False)):
        if device.type != "cuda" and name != "fp32":
            continue  # TF32 and bf16 weights are what a GPU decodes with
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        m = replace_weights(model).to(device, dtype).eval()
        with torch.inference_mode():
            search(m, *work[0])
            peak_reset(device)
            syncs = host_syncs(device, lambda m=m: search(m, *work[0]))
            sync(device)
            start, tokens = time.perf_counter(), 0
            for ids, L in work:
                search(m, ids, L)
                tokens += ids.shape[0] * L
            sync(device)
        rate = tokens / (time.perf_counter() - start)
        per_step = "n/a on a CPU" if syncs is None else f"{syncs / work[0][1]:.2f}"
        print(f"decode {name} beam4: {rate:,.0f} tok/s; host syncs a step {per_step}; peak memory {peak_gib(device)}")
    torch.backends.cuda.matmul.allow_tf32 = tf32
    if not compiled:
        return
    eager, fast = replace_weights(model).to(device).eval(), replace_weights(model).to(device).eval()
    compile_decoder(fast)
    uneven = [(ids[: max(1, ids.shape[0] - 7 * i)], L) for i, (ids, L) in enumerate(work[:4])]
    same, started = 0, time.perf_counter()
    with torch.inference_mode():
        for ids, L in uneven:
            a, b = search(eager, ids, L), search(fast, ids, L)
            same += sum(x[0].tokens == y[0].tokens for x, y in zip(a, b))
    total = sum(ids.shape[0] for ids, _ in uneven)
    print(f"decode compiled beam4 on {len(uneven)} batches of {', '.join(str(ids.shape[0]) for ids, _ in uneven)} "
          f"sentences: {same} of {total} translations as eager's ({time.perf_counter() - started:.1f} s with compilation)")


# --- the check -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", help="model size preset (default: base on CUDA, tiny on a CPU)")
    p.add_argument("--vocab", type=int, help="requested vocabulary (default: 32000 on CUDA, 1000 on a CPU)")
    p.add_argument("--max-tokens", type=int, help="padded tokens a micro-batch (default: 16384 on CUDA, 1024 on a CPU)")
    p.add_argument("--steps", type=int, help="timed training steps of each kind (default: 30 on CUDA, 3 on a CPU)")
    p.add_argument("--pairs", type=int, help="synthetic training pairs (default: 60000 on CUDA, 2000 on a CPU)")
    p.add_argument("--sentences", type=int, default=512, help="sentences decoded (batches of 64)")
    p.add_argument("--no-compile", action="store_true", help="train and decode without compile only")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    size, vocab = args.size or ("base" if cuda else "tiny"), args.vocab or (32000 if cuda else 1000)
    max_tokens, steps = args.max_tokens or (16384 if cuda else 1024), args.steps or (30 if cuda else 3)
    precision = run_precision(TrainConfig(), device.type)[0] if cuda else "no"  # a GPU's: always mixed
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as nmt train sets them
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    sheet, ceiling = datasheet(name), gemm_ceiling(device, 8192 if cuda else 1024)
    print(f"device {name}; torch {torch.__version__}; {torch.cuda.device_count()} GPU(s); model size {size}; "
          f"precision {precision}; batches of {max_tokens:,} tokens")
    print((f"peak: datasheet ({sheet[0]}) {sheet[1] / 1e12:.0f} TFLOP/s dense bf16, " if sheet else
           "peak: datasheet unknown, ") + f"measured GEMM {ceiling / 1e12:.1f} TFLOP/s")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = write_corpus(tmp, args.pairs or (60000 if cuda else 2000))
        cfg = run_config(data, tmp / "run", size, vocab, max_tokens, steps + max(3, steps // 3))
        model, windows = preloaded(cfg, 6, device)
        src_len = statistics.mean(float(w[0]["src_ids"].ne(PAD).sum(1).float().mean()) for w in windows)
        tgt_len = statistics.mean(float(w[0]["labels"].ne(PAD).sum(1).float().mean()) for w in windows)
        per_token = flops_per_token(model.cfg, src_len, tgt_len)

        def mfu(tok_s: float) -> str:
            rate = tok_s * per_token
            return (f"MFU {rate / sheet[1]:.1%} of the datasheet, " if sheet else "") + f"{rate / ceiling:.1%} of the GEMM"

        loop_tok_s, loop_peak = real_loop(cfg, device)
        kinds = [("fused loss", False, False), ("plain loss", False, True)]
        kinds += [] if args.no_compile else [("compiled", True, False)]
        results = {}
        for kind, compiled, plain in kinds:
            r = one_device(model, replace(cfg, compile=compiled), windows, device, steps, precision, plain)
            results[kind] = r
            syncs = "n/a on a CPU" if r["syncs"] is None else r["syncs"]
            print(f"train OneDevice, {kind}: {r['tok_s']:,.0f} target tok/s, {mfu(r['tok_s'])}; median step "
                  f"{r['median_ms']:.1f} ms; warm-up {r['warm_s']:.1f} s; host syncs a step {syncs}; peak memory "
                  f"{r['peak']}; loss {r['loss']:.3f}")
        print(f"train real loop (nmt.train: accelerate, DataLoader, collation, prefetcher): {loop_tok_s:,.0f} target "
              f"tok/s, {mfu(loop_tok_s)}; peak memory {loop_peak}; real loop / OneDevice fused loss "
              f"{loop_tok_s / results['fused loss']['tok_s']:.2f}")
        gpus = torch.cuda.device_count()
        if gpus > 1:
            node = ddp(replace(cfg, output_dir=str(tmp / "ddp")), gpus)
            print(f"train DDP on {gpus} GPUs: {node:,.0f} target tok/s over the node, {node / loop_tok_s / gpus:.2f} "
                  "of linear scaling from one GPU's real loop")
        else:
            print("train DDP: one device here, nothing to spread over")
        torch.manual_seed(0)
        decode(replace_weights(model), args.sentences, device, compiled=not args.no_compile)


if __name__ == "__main__":
    main()
