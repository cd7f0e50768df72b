"""nn.DataParallel, as the DataParallel question (docs/coming-from-dataparallel.md) uses it: it cuts every tensor
argument along dim 0.

The model takes batch-leading ids only, so any cut is harmless. A negative control shows that the question's
design (a (T, T) target mask passed to forward) breaks under the very same cut, so these tests would catch
that bug coming back. On CPU DataParallel calls the module directly; the cut is simulated exactly as
`torch.cuda.comm.scatter` makes it (`torch.chunk` along dim 0), and done for real when GPUs exist.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ATOL, PAD, one_thread, run_scattered, scatter_like, src_batch, tgt_in_batch, tiny_model  # noqa: F401
from torch import nn

from nmt.model import label_smoothed_nll

V = 24
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
many_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                               reason="needs 2 or more GPUs")


def example_batch(B: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(src_ids (B,9), tgt_in_ids (B,6)): the last rows are unpadded, so some chunks carry no padding."""
    gen = torch.Generator().manual_seed(0)
    src_lens, tgt_lens = [2, 9, 4, 1, 9, 9, 9][:B], [6, 2, 3, 6, 1, 6, 4][:B]
    return src_batch(gen, src_lens, V, width=9), tgt_in_batch(gen, tgt_lens, V, width=6)


class SeedStyle(nn.Module):
    """The DataParallel question's design: masks built by the caller and passed in, a (T, T) causal mask among them."""

    def __init__(self, d_model: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, d_model, padding_idx=PAD)
        self.core = nn.Transformer(d_model, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                   dim_feedforward=32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d_model, V)

    def forward(self, src_ids, tgt_in_ids, tgt_mask, src_is_pad):
        hidden = self.core(self.embed(src_ids), self.embed(tgt_in_ids), tgt_mask=tgt_mask,
                           src_key_padding_mask=src_is_pad, memory_key_padding_mask=src_is_pad)
        return self.out(hidden)


def seed_style_args(src_ids, tgt_in_ids):
    T = tgt_in_ids.shape[1]
    return src_ids, tgt_in_ids, nn.Transformer.generate_square_subsequent_mask(T), src_ids.eq(PAD)


def test_seed_usage_runs_and_equals_the_unwrapped_model():
    model = tiny_model(seed=1, vocab=V, layers=2).to(DEVICE)
    src_ids, tgt_in_ids = (t.to(DEVICE) for t in example_batch())
    dp = torch.nn.DataParallel(model)
    with torch.no_grad():
        out = dp(src_ids, tgt_in_ids)
        expected = model(src_ids, tgt_in_ids)
    assert out.shape == (7, 6, V)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_devices", [2, 3, 4])
def test_scattered_forward_equals_the_whole_batch(n_devices):
    model = tiny_model(seed=2, vocab=V, layers=2)
    src_ids, tgt_in_ids = example_batch()
    parts = scatter_like((src_ids, tgt_in_ids), n_devices)
    assert len(parts) == len(torch.arange(7).chunk(n_devices))  # 7 rows on 4 devices: 3 chunks, as DataParallel
    assert any(not bool(s.eq(PAD).any()) for s, _ in parts)  # one chunk takes the no-padding fast path
    with torch.no_grad():
        torch.testing.assert_close(run_scattered(model, n_devices, src_ids, tgt_in_ids), model(src_ids, tgt_in_ids),
                                   atol=ATOL, rtol=0)


def test_training_through_the_scatter_gives_the_whole_batch_gradient():
    """DataParallel's backward sums the replicas' gradients: on shared weights that is the whole-batch gradient."""
    model = tiny_model(seed=3, vocab=V, dropout=0.0).train()
    src_ids, tgt_in_ids = example_batch()
    labels = torch.cat([tgt_in_ids[:, 1:], torch.full((7, 1), PAD)], dim=1)

    def grads(logits):
        model.zero_grad()
        loss, _, n_tokens = label_smoothed_nll(logits, labels, PAD, smoothing=0.1)
        (loss / n_tokens).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    whole, scattered = grads(model(src_ids, tgt_in_ids)), grads(run_scattered(model, 3, src_ids, tgt_in_ids))
    for name in whole:
        torch.testing.assert_close(scattered[name], whole[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_negative_control_seed_style_mask_breaks_under_the_same_scatter():
    """The DataParallel question's bug reproduced: the (T, T) mask is cut to (T / n, T) like any tensor argument."""
    seed_model = SeedStyle().eval()
    src_ids, tgt_in_ids = example_batch(B=4)
    args = seed_style_args(src_ids, tgt_in_ids)
    with torch.no_grad():
        assert seed_model(*args).shape == (4, 6, V)  # whole, it works
        assert [tuple(replica[2].shape) for replica in scatter_like(args, 2)] == [(3, 6), (3, 6)]
        with pytest.raises(RuntimeError, match="attn_mask"):
            run_scattered(seed_model, 2, *args)
        # ours, same batch, same harness: fine
        ours = tiny_model(seed=0, vocab=V)
        torch.testing.assert_close(run_scattered(ours, 2, src_ids, tgt_in_ids), ours(src_ids, tgt_in_ids),
                                   atol=ATOL, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n_devices", [2, 3, 4])
def test_simulated_scatter_matches_torch_scatter(n_devices):
    """The CPU simulation cuts exactly as DataParallel's real scatter does (all replicas on GPU 0 here)."""
    from torch.nn.parallel.scatter_gather import scatter

    src_ids, tgt_in_ids = example_batch()
    real = scatter((src_ids, tgt_in_ids), [0] * n_devices)
    simulated = scatter_like((src_ids, tgt_in_ids), n_devices)
    assert len(real) == len(simulated)
    for got, want in zip(real, simulated):
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


@many_gpus
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_real_dataparallel_on_gpus_equals_one_gpu():
    n = torch.cuda.device_count()
    model = tiny_model(seed=4, vocab=V, layers=2).cuda()
    src_ids, tgt_in_ids = example_batch()
    src_ids, tgt_in_ids = src_ids.cuda(), tgt_in_ids.cuda()
    with torch.no_grad():
        out = torch.nn.DataParallel(model)(src_ids, tgt_in_ids)
        torch.testing.assert_close(out, model(src_ids, tgt_in_ids), atol=1e-4, rtol=1e-4)
        seed_model = SeedStyle().cuda().eval()
        args = [a.cuda() for a in seed_style_args(src_ids[: 2 * n], tgt_in_ids[: 2 * n])]
        with pytest.raises(RuntimeError, match="attn_mask"):
            torch.nn.DataParallel(seed_model)(*args)
