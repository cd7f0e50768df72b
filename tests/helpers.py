"""Builders shared by the model, search and DataParallel tests: tiny models, padded id batches, a CPU scatter."""

from __future__ import annotations

import pytest
import torch

from nmt.config import ModelConfig
from nmt.model import Seq2SeqTransformer

PAD, UNK, BOS, EOS = 0, 1, 2, 3
FIRST_WORD = 4  # ids below this are special
ATOL = 1e-5  # float32 logits are O(1): differences above this mean a real change, not rounding


def tiny_model(seed: int = 0, vocab: int = 24, tgt_vocab: int | None = None, d_model: int = 16, layers: int = 1,
               pre_norm: bool = True, share: bool = True, activation: str = "relu", dropout: float = 0.0,
               dtype: torch.dtype = torch.float32) -> Seq2SeqTransformer:
    """A 1-2 layer model with d_model 16 in eval mode, initialised from `seed`."""
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny", src_vocab_size=vocab, tgt_vocab_size=tgt_vocab or vocab, d_model=d_model,
                             n_heads=2, n_encoder_layers=layers, n_decoder_layers=layers, d_ff=2 * d_model,
                             dropout=dropout, pre_norm=pre_norm, share_embeddings=share, activation=activation,
                             max_positions=128)
    return Seq2SeqTransformer(cfg).to(dtype).eval()


def src_batch(gen: torch.Generator, lengths: list[int], vocab: int, width: int | None = None) -> torch.Tensor:
    """(B, S) source ids: `lengths[i] - 1` random words, then </s>, then padding up to `width`."""
    width = width or max(lengths)
    out = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, : n - 1] = torch.randint(FIRST_WORD, vocab, (n - 1,), generator=gen)
        out[i, n - 1] = EOS
    return out


def tgt_in_batch(gen: torch.Generator, lengths: list[int], vocab: int, width: int | None = None) -> torch.Tensor:
    """(B, T) decoder inputs: <s>, then `lengths[i] - 1` random words, then padding up to `width`."""
    width = width or max(lengths)
    out = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, 0] = BOS
        out[i, 1:n] = torch.randint(FIRST_WORD, vocab, (n - 1,), generator=gen)
    return out


def chunks_at(n: int, cuts: list[int]) -> list[slice]:
    """Row slices of a batch of n rows cut before each index in `cuts`."""
    bounds = [0, *sorted(set(cuts)), n]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def scatter_like(obj, n: int) -> list:
    """What nn.DataParallel's scatter does to call arguments, on CPU: every tensor is cut into up to n
    chunks along dim 0 with `torch.chunk` (as `torch.cuda.comm.scatter` does); tuples, lists and dicts
    are scattered element-wise; anything else is repeated. Returns one argument set per replica."""
    if isinstance(obj, torch.Tensor):
        return list(obj.chunk(n, dim=0))
    if isinstance(obj, (tuple, list)) and obj:
        parts = [scatter_like(x, n) for x in obj]
        return [type(obj)(p) for p in zip(*parts)]
    if isinstance(obj, dict) and obj:
        parts = [scatter_like(v, n) for v in obj.values()]
        return [dict(zip(obj.keys(), p)) for p in zip(*parts)]
    return [obj] * n


def run_scattered(module: torch.nn.Module, n: int, *args) -> torch.Tensor:
    """DataParallel's forward on n devices, simulated on CPU: scatter, run each replica, gather on dim 0."""
    return torch.cat([module(*replica_args) for replica_args in scatter_like(tuple(args), n)], dim=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads and lose a lot to contention on shared CPUs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def model_dir(path, seed: int = 0, vocab: int = 60, layers: int = 1, mirrored: bool = False):
    """A model directory (random tiny model + a BPE tokenizer trained on synthetic pairs), as train writes one;
    `mirrored`: the tokenizer is trained on the text spelled backwards (another tokenizer of the same size)."""
    from pathlib import Path

    from nmt.config import TokenizerConfig
    from nmt.synthetic import generate_pairs
    from nmt.tokenizer import PairTokenizer, train_tokenizer

    texts = [t[::-1] if mirrored else t for pair in generate_pairs(200, seed=7) for t in pair]
    tok = train_tokenizer(texts, TokenizerConfig(vocab_size=vocab, min_frequency=1))
    model = tiny_model(seed=seed, vocab=tok.get_vocab_size(), layers=layers)
    path = Path(path)
    model.save_pretrained(path)
    PairTokenizer(tok).save(path)
    return path
