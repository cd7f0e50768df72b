"""The GPU check: one short script (a few minutes) that measures what a GPU user meets.

On a CUDA device: trains `size: base` in bf16 autocast, with `compile: true` and without, on the same token-budget
batches (the objective training builds: `nmt.training.run.make_objective`, fused AdamW, clipping), then decodes
beam 4 against CTranslate2 (float32 and float16) when it is installed. Prints for each: target tokens/s, MFU against
the device's peak bf16 rate (its datasheet figure where known, and a measured 8192^3 bf16 GEMM), peak memory, and the
host syncs of one training step and of one beam-search step (reads of the device, counted as tests/helpers.HostSyncs
counts them).

On a CPU it runs the same code at small sizes, so CI keeps it working:

    python benchmarks/gpu.py                    # CUDA: size base, 30 timed steps each way; CPU: size tiny
    python benchmarks/gpu.py --steps 10 --no-compile --sentences 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from decode_speed import batches, run_ct2, run_nmt  # noqa: E402
from helpers import HostSyncs  # noqa: E402
from train_speed import pick_batches, synthetic_pairs  # noqa: E402

from nmt.config import ModelConfig, TrainConfig  # noqa: E402
from nmt.decoding import SearchConfig, beam_search  # noqa: E402
from nmt.model import Seq2SeqTransformer  # noqa: E402
from nmt.training.loop import OneDevice, make_optim, train_step  # noqa: E402
from nmt.training.run import make_objective  # noqa: E402

PAD = 0
DATASHEET_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "L4": 121e12}


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


def train(cfg: ModelConfig, batches: list[dict], device: torch.device, compiled: bool, steps: int,
          precision: str) -> dict:
    torch.manual_seed(0)
    model = Seq2SeqTransformer(cfg).to(device).train()
    train_cfg = TrainConfig(compile=compiled)
    train_cfg.optim.lr, train_cfg.optim.warmup_steps = 5e-4, 100  # what a plan would fill in
    objective = make_objective(model, train_cfg, device)
    optim = make_optim(objective, train_cfg)
    one = OneDevice(device, 1, precision)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for b in batches:  # warm-up: every shape once (compilation, allocator, cuBLAS plans)
        train_step(one, objective, optim, [b])
    sync(device)
    warm_s = time.perf_counter() - started
    with HostSyncs() as syncs:
        train_step(one, objective, optim, [batches[0]])
    tokens, times = 0, []
    for i in range(steps):
        b = batches[i % len(batches)]
        sync(device)
        start = time.perf_counter()
        stats = train_step(one, objective, optim, [b])
        sync(device)
        times.append(time.perf_counter() - start)
        tokens += stats.tokens
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"tok_s": tokens / sum(times), "warm_s": warm_s, "syncs": len(syncs.calls), "sync_calls": syncs.calls,
            "peak": peak, "median_step_ms": 1000 * statistics.median(times), "loss": stats.loss}


def decode_all(systems: dict, work: list) -> dict[str, float]:
    """Tokens/s of each system over all batches, after one warm-up batch."""
    out = {}
    for name, run in systems.items():
        run(*work[0])
        start, tokens = time.perf_counter(), 0
        for src_ids, L in work:
            tokens += run(src_ids, L)
        out[name] = tokens / (time.perf_counter() - start)
    return out


def decode(model: Seq2SeqTransformer, vocab: int, n: int, device: torch.device, tmp: Path) -> None:
    """nmt beam 4 against CTranslate2 on the same batches, every system generating exactly L tokens per sentence
    (</s> made impossible as in decode_speed.py), and the host syncs of nmt's beam-search steps."""
    with torch.no_grad():
        model.dec_norm.bias.fill_(1.0)
        model.tgt_embed.weight[3] = -30.0 / model.cfg.d_model
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(4, vocab, (k - 1,), generator=g).tolist() + [3]
            for k in torch.randint(5, 31, (n,), generator=g).tolist()]
    work = [(ids.to(device), L) for ids, L in batches(srcs, 64)]
    model = model.to(device).eval()
    ids, L = work[0]
    with HostSyncs() as syncs, torch.inference_mode():
        beam_search(model, ids, SearchConfig(beam_size=4, max_len_a=L, max_len_b=0.0, max_new_tokens=L))
    systems = {"nmt beam4": run_nmt(model, 4)}
    try:
        import ctranslate2

        from nmt.translate import save_ctranslate2
    except ImportError:
        ctranslate2 = None
        print("ctranslate2 is not installed: CT2 skipped (pip install 'nmt[ct2]')")
    if ctranslate2 is not None:
        words = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(4, vocab)]
        kinds = ("float32", "float16") if device.type == "cuda" else ("float32",)
        save_ctranslate2(model.cpu(), words, words, tmp / "ct2")  # float32 weights; float16 computed from them
        model.to(device)
        for kind in kinds:
            tr = ctranslate2.Translator(str(tmp / "ct2"), device=device.type, compute_type=kind, intra_threads=1)
            systems[f"CT2 {kind} beam4"] = run_ct2(tr, 4, words)
    rates = decode_all(systems, work)
    print(f"decode nmt beam4: {rates['nmt beam4']:,.0f} tok/s; host syncs per step "
          f"{syncs.calls.count('tolist') / L:.2f} ({len(syncs.calls)} in {L} steps)")
    for name, rate in rates.items():
        if name != "nmt beam4":
            print(f"decode {name}: {rate:,.0f} tok/s; nmt beam4 / {name}: {rates['nmt beam4'] / rate:.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", help="model size preset (default: base on CUDA, tiny on a CPU)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: 32000 on CUDA, 1000 on a CPU)")
    p.add_argument("--max-tokens", type=int, help="padded tokens per batch (default: 16384 on CUDA, 1024 on a CPU)")
    p.add_argument("--steps", type=int, default=30, help="timed training steps each way")
    p.add_argument("--sentences", type=int, default=512, help="sentences decoded (batches of 64)")
    p.add_argument("--no-compile", action="store_true", help="train without compile only")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    size, vocab = args.size or ("base" if cuda else "tiny"), args.vocab or (32000 if cuda else 1000)
    max_tokens, precision = args.max_tokens or (16384 if cuda else 1024), "bf16" if cuda else "no"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = ModelConfig.preset(size, src_vocab_size=vocab, tgt_vocab_size=vocab, max_positions=512)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    datasheet = next((v for k, v in DATASHEET_BF16.items() if k in name), None)
    ceiling = gemm_ceiling(device, 8192 if cuda else 1024)
    print(f"device {name}; torch {torch.__version__}; model size {size} (d{cfg.d_model}, {cfg.n_encoder_layers}+"
          f"{cfg.n_decoder_layers} layers, vocabulary {vocab}); {precision}; batches of {max_tokens} tokens")
    print(f"peak: datasheet {datasheet / 1e12:.0f} TFLOP/s, " if datasheet else "peak: datasheet unknown, ", end="")
    print(f"measured GEMM {ceiling / 1e12:.1f} TFLOP/s")
    batches = pick_batches(synthetic_pairs(4000, vocab, 0), max_tokens, 6, 0)
    src_len = statistics.mean(float(b["src_ids"].ne(PAD).sum(1).float().mean()) for b in batches)
    tgt_len = statistics.mean(float(b["labels"].ne(PAD).sum(1).float().mean()) for b in batches)
    per_token = flops_per_token(cfg, src_len, tgt_len)
    for compiled in ([False] if args.no_compile else [False, True]):
        r = train(cfg, batches, device, compiled, args.steps, precision)
        rate = r["tok_s"] * per_token
        mfu = f"MFU {rate / datasheet:.1%} of datasheet, " if datasheet else "MFU "
        memory = f", peak memory {r['peak'] / 2**30:.2f} GiB" if r["peak"] is not None else ""
        print(f"train compile={'on ' if compiled else 'off'}: {r['tok_s']:,.0f} target tok/s, {mfu}"
              f"{rate / ceiling:.1%} of the GEMM ceiling{memory}; median step {r['median_step_ms']:.1f} ms; "
              f"warm-up {r['warm_s']:.1f} s; host syncs per step {r['syncs']} {r['sync_calls']}; loss {r['loss']:.3f}")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        decode(Seq2SeqTransformer(cfg), vocab, args.sentences, device, Path(tmp))

if __name__ == "__main__":
    main()
