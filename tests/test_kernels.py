"""The opt-in CPU kernels (nmt.kernels): PyTorch's private oneDNN ops the packed linear relies on still exist and
still compute F.linear; the packed weight follows the weight when it changes; anything but no-grad float32 CPU
inference goes through F.linear; the fast dropout keeps its rate, scale and seed; the fused loss gives the plain
loss's sums and gradients. And nothing is switched on by importing: a plain model is plain PyTorch, only Translator
and CPU training opt in."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import model_dir, one_thread  # noqa: F401

import nmt.kernels as kernels

ROOT = Path(__file__).resolve().parents[1]


def test_private_ops_exist_and_compute_f_linear():
    """Fails loudly when torch renames or changes torch.ops.mkldnn._reorder_linear_weight/_linear_pointwise."""
    assert kernels.AVAILABLE, "torch.ops.mkldnn._reorder_linear_weight/_linear_pointwise are gone: update nmt/kernels.py"
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((2, 3, 256), (300, 256), (300,)))
    linear = kernels.PackedLinear()
    with torch.no_grad():
        assert kernels._usable(x, w)
        for relu in (False, True):
            want = F.linear(x, w, b)
            want = F.relu(want) if relu else want
            got = linear(x, w, b, relu=relu)
            assert got.shape == (2, 3, 300) and torch.allclose(got, want, atol=1e-4)
        assert torch.allclose(linear(x[:, :0], w), F.linear(x[:, :0], w))  # no rows
        assert torch.allclose(linear(x.transpose(0, 1), w), F.linear(x.transpose(0, 1), w), atol=1e-4)


def test_packed_weight_follows_changes():
    w = torch.nn.Parameter(torch.randn(300, 256))
    x = torch.randn(4, 256)
    linear = kernels.PackedLinear()
    with torch.no_grad():
        first = linear(x, w)
        assert linear.packed(w) is linear.packed(w)  # packed once
        w.mul_(2.0)  # an optimizer step or load_state_dict
        assert torch.allclose(linear(x, w), 2 * first, atol=1e-4)
        w.data = torch.randn(300, 256)  # a new storage
        assert torch.allclose(linear(x, w), F.linear(x, w), atol=1e-4)


@pytest.mark.parametrize("case", ["grad", "float64", "small", "autocast"])
def test_other_cases_take_f_linear(case):
    x, w = torch.randn(4, 256), torch.randn(300, 256)
    if case == "float64":
        x, w = x.double(), w.double()
    if case == "small":
        w = torch.randn(8, 256)
    with torch.set_grad_enabled(case == "grad"), torch.autocast("cpu", enabled=case == "autocast"):
        assert not kernels._usable(x, w)


def test_cpu_dropout_rate_scale_gradient_and_seed():
    """The fast CPU dropout drops p of the elements (to within 5 sigma), scales the rest by 1/(1-p) so the mean
    is kept, passes the same mask to the gradient, repeats under the same seed and is off in eval mode."""
    drop, n, p = kernels.FastDropout(0.1).train(), 1_000_000, 0.1
    x = torch.ones(n, requires_grad=True)
    torch.manual_seed(0)
    y = drop(x)
    dropped = float(y.eq(0).float().mean())
    assert abs(dropped - p) < 5 * (p * (1 - p) / n) ** 0.5
    kept = y[y.ne(0)]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - round(p * 65536) / 65536)))
    y.backward(torch.full_like(y, 2.0))
    torch.testing.assert_close(x.grad, 2 * y.detach())
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)
    assert not torch.equal(drop(x), y)  # the next call draws a new mask
    assert drop(torch.ones(4, 5, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert torch.equal(drop.eval()(x), x)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_fused_loss_gives_the_plain_losss_sums_and_gradients(smoothing, autocast):
    """Seq2SeqLoss through the fused cross-entropy and through F.cross_entropy's autograd, on a padded batch: the
    same loss, nll and token count, the same gradient on every parameter, in fp32 and under bf16 autocast; the
    loss is F.cross_entropy's (ignore_index, label_smoothing, summed); switching it off gives the plain class back."""
    from helpers import tiny_model

    from nmt.model import Seq2SeqLoss

    gen = torch.Generator().manual_seed(1)
    src = torch.randint(4, 24, (3, 7), generator=gen)
    tgt = torch.randint(4, 24, (3, 6), generator=gen)
    src[0, 5:], tgt[0, 4:], tgt[2, 1:] = 0, 0, 0  # padding (pad_id 0) in both sides, a one-token target
    tgt_in, labels = torch.cat([torch.full((3, 1), 2), tgt[:, :-1]], 1), tgt
    results = []
    for fused in (False, True):
        model = tiny_model(seed=3).train()
        objective = Seq2SeqLoss(model, smoothing)
        if fused:
            kernels.use_fused_loss(objective)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            sums = objective(src, tgt_in, labels)
        sums.loss.backward()
        results.append((sums, {n: p.grad for n, p in model.named_parameters()}))
        assert type(objective) is (kernels.FusedSeq2SeqLoss if fused else Seq2SeqLoss)
    (plain, plain_grads), (fused, fused_grads) = results
    tol = {"atol": 1e-2, "rtol": 1e-2} if autocast else {"atol": 1e-5, "rtol": 1e-5}
    assert int(fused.tokens) == int(plain.tokens) == int(labels.ne(0).sum())
    torch.testing.assert_close(fused.loss, plain.loss, **tol)
    torch.testing.assert_close(fused.nll, plain.nll, **tol)
    assert not fused.nll.requires_grad and fused.loss.requires_grad
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, **tol, msg=name)
    if not autocast:
        logits = tiny_model(seed=3)(src, tgt_in)
        with torch.no_grad():
            want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=0, label_smoothing=smoothing,
                                   reduction="sum")
            got = kernels._SmoothedCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(), 0, smoothing)[0]
        torch.testing.assert_close(got, want)
    assert type(kernels.use_fused_loss(objective, on=False)) is Seq2SeqLoss


def test_importing_hooks_nothing_and_a_plain_model_is_plain_pytorch():
    """No optimizer hook after importing the model, its decoding and the kernels (in a fresh interpreter), and a
    Seq2SeqTransformer built directly drops with nn.Dropout's exact p (the fast dropout's p is 0.100006)."""
    code = ("import nmt.kernels, nmt.model, nmt.translate\n"
            "from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks\n"
            "assert not _global_optimizer_post_hooks and not _global_optimizer_pre_hooks")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]

    from helpers import tiny_model

    model = tiny_model(dropout=0.1).train()
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(type(m) is torch.nn.Dropout for m in drops)
    assert not kernels.uses_packed_linears(model) and "project" not in vars(model)
    y = drops[0](torch.ones(100_000))
    kept = y[y.ne(0)]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.9))


def test_translator_packs_and_cpu_training_drops_fast(tmp_path):
    """Translator.from_pretrained opts its model into packed linears (and translates as the plain model does);
    the model a CPU training run builds gets the fast dropout and no packed linears, an opted-out one neither;
    its objective takes the fused loss on any device, the plain one when compiled."""
    from nmt.config import ModelConfig, TrainConfig
    from nmt.layers import Linear
    from nmt.tokenizer import PairTokenizer
    from nmt.training.loop import default_device
    from nmt.training.run import build_model
    from nmt.translate import Translator

    directory = model_dir(tmp_path / "m")
    translator = Translator.from_pretrained(directory)
    slots = [m for m in translator.model.modules() if isinstance(m, Linear)]
    assert len(slots) > 2 and all(type(m) is kernels.PackedLayerLinear for m in slots)
    assert isinstance(translator.model.project, kernels.PackedProjection)
    plain = Translator(kernels.use_cpu_kernels(Translator.from_pretrained(directory).model), translator.tokenizer)
    assert not kernels.uses_packed_linears(plain.model) and "project" not in vars(plain.model)
    assert translator.translate(["a b c"]) == plain.translate(["a b c"])

    tok = PairTokenizer.load(directory)
    cfg = TrainConfig(model=ModelConfig.preset("tiny", src_vocab_size=tok.src_vocab_size,
                                               tgt_vocab_size=tok.tgt_vocab_size, dropout=0.1))
    model = build_model(cfg, tok, None)
    fast = [m for m in model.modules() if type(m) is kernels.FastDropout]
    assert bool(fast) == (default_device().type == "cpu")
    assert not kernels.uses_packed_linears(model)
    kernels.use_cpu_kernels(model)  # off again
    assert not any(type(m) is kernels.FastDropout for m in model.modules())

    from nmt.model import Seq2SeqLoss
    from nmt.training.loop import make_objective

    for device in ("cpu", "meta"):  # meta: a device that is not the CPU, as a GPU is
        assert type(make_objective(model.to(device), cfg)) is kernels.FusedSeq2SeqLoss
    assert type(make_objective(model, dataclasses.replace(cfg, compile=True))) is Seq2SeqLoss


def test_training_under_mixed_precision_on_a_cpu_takes_the_math_attention_kernel():
    """bf16 or fp16 on a CPU: the math kernel (torch's fused one steps slower there); fp32, another device or a model
    of the user's own: torch's choice. A rule of device and precision, so every process and a resumed run agree."""
    from nmt.model import Seq2SeqLoss
    from tests.helpers import tiny_model

    for precision, path in (("bf16", ("MATH",)), ("fp16", ("MATH",)), ("no", None)):
        objective = Seq2SeqLoss(tiny_model(attention_dropout=0.0))
        why = kernels.use_attention_path(objective, precision)
        assert objective.attention_path == path and (why is None) == (path is None)
    assert why is None and "the math kernel for training in bf16" in kernels.use_attention_path(objective, "bf16")
    assert kernels.use_attention_path(Seq2SeqLoss(tiny_model().to("meta")), "bf16") is None


def test_the_math_kernel_computes_what_torchs_choice_does():
    """An objective on the math kernel runs the math kernel in its forward (and so its backward) and scores a
    batch as torch's choice does, to float32 rounding."""
    from torch.profiler import profile

    from nmt.model import Seq2SeqLoss
    from tests.helpers import sum_error, tiny_model

    objective = Seq2SeqLoss(tiny_model(attention_dropout=0.0).train())
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randint(4, 24, (3, 7), generator=g), torch.randint(4, 24, (3, 6), generator=g)
    losses, ops = {}, {}
    for path in (None, ("MATH",)):
        objective.attention_path = path
        with profile() as prof:
            losses[path] = objective(src, tgt[:, :-1], tgt[:, 1:]).loss
        ops[path] = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_attention_math" in ops[("MATH",)]
    assert not any("flash" in name for name in ops[("MATH",)])
    assert any("flash" in name for name in ops[None])  # torch's own choice here: the fused kernel
    # the loss sums 18 target tokens' terms, each from products of 16 summands and softmaxes over 7 keys
    torch.testing.assert_close(losses[None], losses[("MATH",)], rtol=sum_error(18 * (16 + 7)), atol=0)
