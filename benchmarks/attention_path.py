"""The attention kernel of a training step: torch's own choice against the one nmt takes (`nmt.kernels.
use_attention_path`), for each dropout placement and precision, side by side in one process.

    python benchmarks/attention_path.py [--data ../shared/data/tatoeba-en-de] [--rounds 3] [--steps 4]
                                        [--max-tokens 1024] [--precisions fp32,bf16] [--models nmt,marian]

Models: `nmt`, the 256-wide 3+3 model of benchmarks/train_speed.py, with nmt's dropout placement (0.1 on the
attention weights and activations too) and with Marian's (0.1 on embeddings and residual branches only); `marian`,
the shape an imported OPUS-MT model fine-tunes in (transformers' MarianConfig of Helsinki-NLP/opus-mt-en-de:
512 wide, 6+6 layers, swish, vocabulary 58,101, no dropout on attention weights or activations, read by
`nmt.interop.model_config_from_hf`). Each optimizer step is taken as training takes it (`train_step` on the
corpus's batches, AdamW, clipping), under each precision, on three attention paths: torch's choice, the math
kernel, and nmt's (what `use_attention_path` chose, printed). Rounds interleave every row; prints the median
seconds a step per row and nmt's step against the faster of the two kernels (at most 1.0x, within the spread,
is the aim: no setting makes a step slower than the fastest path the device has).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nmt.batching import TokenBatchSampler  # noqa: E402
from nmt.config import DataConfig, ModelConfig, TokenizerConfig, TrainConfig  # noqa: E402
from nmt.data import prepare  # noqa: E402
from nmt.kernels import use_attention_path, use_cpu_kernels  # noqa: E402
from nmt.model import Seq2SeqTransformer  # noqa: E402
from nmt.tables import column  # noqa: E402
from nmt.training.loop import OneDevice, make_objective, make_optim, train_step  # noqa: E402
from nmt.training.timing import batches  # noqa: E402

TORCHS = "torch's choice"
PATHS = {TORCHS: None, "math": ("MATH",), "nmt": "chosen"}


def model_configs(names: list[str], vocab: int) -> dict[str, ModelConfig]:
    """The rows' models: nmt's 256-wide model with each dropout placement, and an imported Marian's shape."""
    out = {}
    if "nmt" in names:
        base = dict(src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=256, n_heads=4, n_encoder_layers=3,
                    n_decoder_layers=3, d_ff=1024, dropout=0.1)
        out["nmt, nmt's dropout"] = ModelConfig(**base)
        out["nmt, Marian's dropout"] = ModelConfig(**base, attention_dropout=0.0, activation_dropout=0.0)
    if "marian" in names:
        from transformers import MarianConfig

        from nmt.interop import model_config_from_hf

        hf = MarianConfig(vocab_size=58101, decoder_vocab_size=58101, d_model=512, encoder_layers=6,
                          decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
                          encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="swish", dropout=0.1,
                          attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, pad_token_id=58100,
                          decoder_start_token_id=58100, eos_token_id=0, max_position_embeddings=512)
        out["imported Marian"] = model_config_from_hf(hf)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="a corpus folder (train/valid/test.<src>/<tgt>); default: "
                                                     "the quickstart's built-in corpus")
    parser.add_argument("--src", default="en")
    parser.add_argument("--tgt", default="de")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps a row per round (after one warm-up)")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--precisions", default=None,
                        help="fp32,bf16 (default: fp32, and bf16 where the CPU multiplies bf16 in hardware)")
    parser.add_argument("--models", default="nmt,marian")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = (DataConfig(train="builtin:synthetic", src_lang="en", tgt_lang="xx") if args.data is None else
            DataConfig(train=f"{args.data}/train", valid=f"{args.data}/valid", test=f"{args.data}/test",
                       src_lang=args.src, tgt_lang=args.tgt))
    corpus = prepare(data, TokenizerConfig(vocab_size=8000))
    train = corpus.splits["train"]
    plan = TokenBatchSampler(column(train, "cost"), args.max_tokens, seed=1).plan(0)
    cfg = TrainConfig(max_tokens=args.max_tokens)
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-4, 1000  # the rate does not change a step's time
    device = torch.device("cpu")
    precisions = {"fp32": "no", "bf16": "bf16"}
    if args.precisions is None:
        from nmt.compat import mkldnn_bf16_supported

        args.precisions = "fp32,bf16" if mkldnn_bf16_supported() else "fp32"  # (bf16 emulated is ~20x slower)
    configs = model_configs(args.models.split(","), corpus.tokenizer.tgt_vocab_size)
    rows = [(name, precision, path) for name in configs for precision in args.precisions.split(",") for path in PATHS]
    chosen, times, built = {}, {}, {}
    for _ in range(args.rounds):
        for name, precision, path in rows:
            if name not in built:
                torch.manual_seed(1)
                built[name] = use_cpu_kernels(Seq2SeqTransformer(configs[name]), fast_dropout=True)  # as trained
            objective = make_objective(built[name], cfg)
            if PATHS[path] == "chosen":
                chosen[name, precision] = use_attention_path(objective, precisions[precision])
            else:
                objective.attention_path = PATHS[path]
            optim, one = make_optim(objective, cfg), OneDevice(device, 1, precisions[precision])
            windows = ([plan.batches[i % len(plan)]] for i in range(args.steps + 1))
            seconds = []
            for i, window in enumerate(batches(cfg, train, windows, device, built[name])):
                start = time.perf_counter()
                train_step(one, objective, optim, window)
                if i:
                    seconds.append(time.perf_counter() - start)
            times.setdefault((name, precision, path), []).append(statistics.median(seconds))
            print(f"  {name}, {precision}, {path}: {statistics.median(seconds):.3f} s a step", flush=True)

    print(f"\nseconds a training step ({args.max_tokens:,}-token batches, median of {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads)")
    print(f"{'model, dropout':<24}{'precision':>10}{'torch':>9}{'math':>9}{'nmt':>9}{'nmt / fastest':>15}")
    for name, precision in dict.fromkeys((n, p) for n, p, _ in rows):
        t = {path: statistics.median(times[name, precision, path]) for path in PATHS}
        fastest = min(t[TORCHS], t["math"])
        print(f"{name:<24}{precision:>10}{t[TORCHS]:>9.3f}{t['math']:>9.3f}"
              f"{t['nmt']:>9.3f}{t['nmt'] / fastest:>14.2f}x")
    for (name, precision), why in chosen.items():
        print(f"  {name}, {precision}: {why or TORCHS}")


if __name__ == "__main__":
    main()
