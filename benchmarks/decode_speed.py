"""Decoding speed: nmt's search against Hugging Face `MarianMTModel.generate` and the CTranslate2 export.

    python benchmarks/decode_speed.py                      # 224 sentences, batch 32, 3 rounds, 1 thread
    python benchmarks/decode_speed.py --threads 2 --rounds 5
    python benchmarks/decode_speed.py --profile            # cProfile of nmt's beam search, then exit
    python benchmarks/decode_speed.py --ensemble           # also nmt beam 4 with an ensemble of two models
    python benchmarks/decode_speed.py --compile            # also nmt with its decoder step compiled

One model size for all (d_model 256, 3+3 layers, 4 heads, FFN 1024, vocabulary 8000), random weights:
nmt's model, a `MarianMTModel` from a `MarianConfig` of the same dimensions, and the nmt model exported
to CTranslate2 (float32 and int8). Every system decodes the same length-sorted batches of random source
ids (5-30 tokens) and generates exactly as many tokens: a batch's target length is its longest source,
and </s> is impossible before it (nmt/CT2: the output embedding of </s> is set so that its logit is
-30 for every decoder state; HF: min_new_tokens). Systems run interleaved in every round, in a rotating
order; the figure is the median round. CPU; `--threads` for torch and CTranslate2 alike.
"nmt sample" draws (top-k 10) on the same decoding path as greedy; the figure to watch is nmt beam 4 /
CT2 float32 beam 4 (same float32 arithmetic; target >= 1.1).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nmt.config import ModelConfig  # noqa: E402
from nmt.decoding import (  # noqa: E402
    Ensemble,  # noqa: E402
    SamplingConfig,  # noqa: E402
    SearchConfig,
    beam_search,
    compile_decoder,
    greedy,
)
from nmt.kernels import use_cpu_kernels  # noqa: E402
from nmt.model import Seq2SeqTransformer  # noqa: E402

PAD, UNK, BOS, EOS = 0, 1, 2, 3
DIMS = dict(d_model=256, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=1024)
VOCAB = 8000
EOS_LOGIT = -30.0


def nmt_model(seed: int = 0) -> Seq2SeqTransformer:
    """A random model whose </s> logit is exactly EOS_LOGIT: the final LayerNorm's output n has zero mean
    (gain 1), so with bias b = 1 (all ones) and e_eos = EOS_LOGIT * b / |b|^2, (n + b) . e_eos = EOS_LOGIT."""
    torch.manual_seed(seed)
    cfg = ModelConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dropout=0.0, max_positions=256, **DIMS)
    model = use_cpu_kernels(Seq2SeqTransformer(cfg).eval(), packed_linears=True)  # as Translator decodes
    with torch.no_grad():
        model.dec_norm.bias.fill_(1.0)
        model.tgt_embed.weight[EOS] = EOS_LOGIT / cfg.d_model
    return model


def hf_model(seed: int = 0):
    from hf_baseline import marian  # benchmarks/ is on sys.path when this file runs as a script

    torch.manual_seed(seed)
    assert DIMS["n_encoder_layers"] == DIMS["n_decoder_layers"]
    return marian(VOCAB, DIMS["d_model"], DIMS["n_encoder_layers"], DIMS["n_heads"], DIMS["d_ff"], 0.0,
                  max_position_embeddings=256).eval()


def sources(n: int, seed: int) -> list[list[int]]:
    """n random sentences of 5-30 tokens (the last one </s>)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 31, (n,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (k - 1,), generator=g).tolist() + [EOS] for k in lengths]


def batches(srcs: list[list[int]], size: int) -> list[tuple[torch.Tensor, int]]:
    """Length-sorted (src_ids (B, S), target length L) batches; L = the longest source of the batch."""
    order = sorted(srcs, key=len)
    out = []
    for i in range(0, len(order), size):
        rows = order[i: i + size]
        ids = torch.full((len(rows), max(map(len, rows))), PAD, dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = torch.tensor(r)
        out.append((ids, ids.shape[1]))
    return out


# Each system: (src_ids, L) -> number of generated tokens (checked against the others).

def run_nmt(model, beam: int, sampling: SamplingConfig | None = None):
    def run(src_ids: torch.Tensor, L: int) -> int:
        cfg = SearchConfig(beam_size=beam, max_len_a=L, max_len_b=0.0, max_new_tokens=L)
        with torch.inference_mode():
            if beam == 1:
                hyps = greedy(model, src_ids, cfg, sampling)
            else:
                hyps = [n[0] for n in beam_search(model, src_ids, cfg)]
        return sum(len(h.tokens) for h in hyps)  # L each: L - 1 words, then the forced </s>
    return run


def run_hf(model, beam: int):
    def run(src_ids: torch.Tensor, L: int) -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=src_ids, attention_mask=src_ids.ne(PAD), num_beams=beam, do_sample=False,
                                 max_new_tokens=L, min_new_tokens=L)
        return out.shape[0] * (out.shape[1] - 1)  # without the decoder start token; no row ends early
    return run


def run_ct2(translator, beam: int, vocab: list[str]):
    def run(src_ids: torch.Tensor, L: int) -> int:
        tokens = [[vocab[i] for i in row if i != PAD] for row in src_ids.tolist()]
        res = translator.translate_batch(tokens, beam_size=beam, max_batch_size=len(tokens), min_decoding_length=L,
                                         max_decoding_length=L)
        return sum(len(r.hypotheses[0]) for r in res)
    return run


def build_systems(args, model, tmp: Path) -> dict:
    systems = {"nmt greedy": run_nmt(model, 1), "nmt beam4": run_nmt(model, 4),
               "nmt sample": run_nmt(model, 1, SamplingConfig(topk=10, seed=0))}
    if args.ensemble:
        systems["nmt ens2 beam4"] = run_nmt(Ensemble([model, nmt_model(args.seed + 1)]), 4)
    if args.compile:  # the decoder step compiled whole (nmt.decoding.compile_decoder, what compile: true does)
        compiled = compile_decoder(nmt_model(args.seed))
        systems |= {"nmt greedy compiled": run_nmt(compiled, 1), "nmt beam4 compiled": run_nmt(compiled, 4)}
    try:
        hf = hf_model()
        systems |= {"HF greedy": run_hf(hf, 1), "HF beam4": run_hf(hf, 4)}
    except ImportError:
        print("transformers is not installed: HF systems skipped (pip install 'nmt[bench]')")
    try:
        import ctranslate2

        from nmt.ct2 import save_ctranslate2
    except ImportError:
        print("ctranslate2 is not installed: CT2 systems skipped (pip install 'nmt[ct2]')")
        return systems
    vocab = ["<pad>", "<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(4, VOCAB)]
    for quant in ("float32", "int8"):
        save_ctranslate2(model, vocab, vocab, tmp / quant, quantization=quant)
        tr = ctranslate2.Translator(str(tmp / quant), device="cpu", compute_type=quant, intra_threads=args.threads)
        systems |= {f"CT2 {quant} greedy": run_ct2(tr, 1, vocab), f"CT2 {quant} beam4": run_ct2(tr, 4, vocab)}
    return systems


def measure(systems: dict, work: list, rounds: int) -> dict[str, tuple[float, int]]:
    """{name: (median seconds per round, generated tokens)}, systems interleaved and rotated each round."""
    names = list(systems)
    times: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, int] = {}
    for name in names:  # warm-up: one batch each (allocator, thread pools, lazy imports)
        systems[name](*work[0])
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start = time.perf_counter()
            tokens[name] = sum(systems[name](ids, L) for ids, L in work)
            times[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names), flush=True)
    return {n: (statistics.median(times[n]), tokens[n]) for n in names}


def report(results: dict[str, tuple[float, int]], args, n_sentences: int) -> None:
    counts = {t for _, t in results.values()}
    print(f"\n{n_sentences} sentences (source 5-30 tokens), batch {args.batch}, {args.threads} thread(s), median of "
          f"{args.rounds} rounds; generated tokens per system: {sorted(counts)}")
    print(f"{'system':<20}{'tokens/s':>10}{'seconds':>10}")
    for name, (sec, tok) in results.items():
        print(f"{name:<20}{tok / sec:>10.0f}{sec:>10.2f}")
    speed = {n: t / s for n, (s, t) in results.items()}
    print()
    for a, b, target in (("nmt beam4", "CT2 float32 beam4", 1.1), ("nmt greedy", "CT2 float32 greedy", None),
                         ("nmt sample", "nmt greedy", None), ("nmt ens2 beam4", "nmt beam4", None),
                         ("nmt beam4", "HF beam4", 2.0), ("nmt greedy", "HF greedy", 1.5),
                         ("CT2 int8 beam4", "HF beam4", 5.0), ("CT2 float32 beam4", "HF beam4", None),
                         ("CT2 int8 beam4", "nmt beam4", None)):
        if a in speed and b in speed:
            goal = f"  (target >= {target}x: {'met' if speed[a] / speed[b] >= target else 'NOT met'})" if target else ""
            print(f"{a} / {b}: {speed[a] / speed[b]:.2f}x{goal}")
    if len(counts) != 1:
        print("WARNING: systems generated different numbers of tokens; the comparison is not like for like")


def profile(model, work: list) -> None:
    run = run_nmt(model, 4)
    run(*work[0])
    prof = cProfile.Profile()
    prof.enable()
    for ids, L in work:
        run(ids, L)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sentences", type=int, default=224, help="source sentences (7 batches of 32)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch and CTranslate2 intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="comma-separated substrings: run only matching systems (e.g. 'nmt,HF beam')")
    p.add_argument("--profile", action="store_true", help="cProfile nmt beam 4 over all batches and exit")
    p.add_argument("--ensemble", action="store_true", help="also time nmt beam 4 with an ensemble of two models")
    p.add_argument("--compile", action="store_true", help="also time nmt with its decoder step compiled")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = nmt_model(args.seed)
    work = batches(sources(args.sentences, args.seed), args.batch)
    if args.profile:
        return profile(model, work)
    with tempfile.TemporaryDirectory(prefix="nmt-bench-ct2-") as tmp:  # the CTranslate2 exports
        systems = build_systems(args, model, Path(tmp))
        if args.only:
            keys = [k.strip() for k in args.only.split(",")]
            systems = {n: f for n, f in systems.items() if any(k in n for k in keys)}
        report(measure(systems, work, args.rounds), args, args.sentences)


if __name__ == "__main__":
    main()
