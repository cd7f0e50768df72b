"""The packed oneDNN linear used for CPU inference: PyTorch's private ops it relies on still exist and still
compute F.linear; the packed weight follows the weight when it changes; anything but no-grad float32 CPU
inference goes through F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import one_thread  # noqa: F401

import nmt.fastlinear as fl


def test_private_ops_exist_and_compute_f_linear():
    """Fails loudly when torch renames or changes torch.ops.mkldnn._reorder_linear_weight/_linear_pointwise."""
    assert fl.AVAILABLE, "torch.ops.mkldnn._reorder_linear_weight/_linear_pointwise are gone: update nmt/fastlinear.py"
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((2, 3, 256), (300, 256), (300,)))
    with torch.no_grad():
        assert fl._usable(x, w)
        for relu in (False, True):
            want = F.linear(x, w, b)
            want = F.relu(want) if relu else want
            got = fl.linear(x, w, b, relu=relu)
            assert got.shape == (2, 3, 300) and torch.allclose(got, want, atol=1e-4)
        assert torch.allclose(fl.linear(x[:, :0], w), F.linear(x[:, :0], w))  # no rows
        assert torch.allclose(fl.linear(x.transpose(0, 1), w), F.linear(x.transpose(0, 1), w), atol=1e-4)


def test_packed_weight_follows_changes():
    w = torch.nn.Parameter(torch.randn(300, 256))
    x = torch.randn(4, 256)
    with torch.no_grad():
        first = fl.linear(x, w)
        assert fl.packed(w) is fl.packed(w)  # packed once
        w.mul_(2.0)  # an optimizer step or load_state_dict
        assert torch.allclose(fl.linear(x, w), 2 * first, atol=1e-4)
        w.data = torch.randn(300, 256)  # a new storage
        assert torch.allclose(fl.linear(x, w), F.linear(x, w), atol=1e-4)


@pytest.mark.parametrize("case", ["grad", "float64", "small", "autocast"])
def test_other_cases_take_f_linear(case):
    x, w = torch.randn(4, 256), torch.randn(300, 256)
    if case == "float64":
        x, w = x.double(), w.double()
    if case == "small":
        w = torch.randn(8, 256)
    with torch.set_grad_enabled(case == "grad"), torch.autocast("cpu", enabled=case == "autocast"):
        assert not fl._usable(x, w)


@pytest.mark.parametrize("fused", [True, False])
def test_packed_weight_follows_an_optimizer_step(fused):
    """A fused AdamW step changes the weight in place without bumping its version: the packs are dropped after
    any optimizer step, so decoding between training steps (validation) sees the trained weights."""
    layer = torch.nn.Linear(256, 300)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=fused)
    x = torch.randn(4, 256)
    with torch.no_grad():
        before = fl.linear(x, layer.weight, layer.bias)
    layer(x).pow(2).sum().backward()
    optimizer.step()
    with torch.no_grad():
        after = fl.linear(x, layer.weight, layer.bias)
        assert torch.allclose(after, F.linear(x, layer.weight, layer.bias), atol=1e-4)
        assert not torch.allclose(after, before, atol=1e-2)
