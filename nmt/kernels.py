"""Opt-in CPU fast paths for nmt's model: a linear through oneDNN with its weight packed once, a dropout whose
mask costs a quarter of torch's random draws, a label-smoothed cross-entropy with a hand-written backward, and the
attention kernel a training step takes where torch's own choice is the slower one (`use_attention_path`). The model
and its objective are plain PyTorch (`F.linear`, `nn.Dropout`, `F.log_softmax` and autograd); nothing here runs
until `use_cpu_kernels` switches it on for one model or objective, and importing this module changes nothing global
(no hooks on anyone's optimizers, no caches shared between models).

Who opts in: `Translator.from_pretrained` on a CPU (packed linears: inference with a model directory's fixed
weights) and a training run on the CPU (the fast dropout and the fused loss; not under torch.compile). Both swap
modules of the plain model or objective for subclasses defined here (and back), so the model's own code and
signatures know nothing of them; on a GPU none runs. Training never packs its linears: a fused optimizer step
(torch.optim.AdamW(fused=True), what training uses) updates weights in place without bumping their version counter,
so a pack could not see a training step, and validation would decode with stale weights.

The packed linear uses PyTorch's own private ops that inductor's CPU freezing uses (`torch.ops.mkldnn.
_reorder_linear_weight` / `_linear_pointwise`), reached through `nmt.compat` like every private API;
`tests/test_kernels.py` fails loudly if they change. Without them, `F.linear` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nmt import compat
from nmt.config import ModelConfig
from nmt.layers import FeedForward, Linear
from nmt.model import LossSums, Seq2SeqLoss, smoothed_sums

AVAILABLE = compat.mkldnn_packed_linear_available()
MIN_WEIGHT = 256 * 256  # smaller weights take F.linear: oneDNN's ~0.1 ms set-up per call outweighs its gain
INT64 = torch.iinfo(torch.int64)


def use_cpu_kernels(model: nn.Module, packed_linears: bool = False, fast_dropout: bool = False) -> nn.Module:
    """Switch `model`'s CPU fast paths on (True) or off (False), in place; returns `model`.

    `packed_linears`: every `nmt.layers.Linear` of the model becomes a `PackedLayerLinear` (the same parameters,
    multiplied through a `PackedLinear` of its own), and the model's output projection goes through one too.
    For inference only (see above). `fast_dropout`: every `nn.Dropout` of the model becomes a `FastDropout` (and
    back when False). Call it before adapters are added, so that their own layers stay torch's. (The objective's
    fused loss has a switch of its own, `use_fused_loss`: it serves any model's objective, and switching it
    leaves the model's modules as they are.)
    """
    for module in model.modules():
        if type(module) in (Linear, PackedLayerLinear):
            module.__class__ = PackedLayerLinear if packed_linears else Linear
            module.packed = PackedLinear() if packed_linears else None
        elif type(module) in (FeedForward, PackedFeedForward) and isinstance(module.act, nn.ReLU):
            module.__class__ = PackedFeedForward if packed_linears else FeedForward
        elif hasattr(module, "project") and hasattr(module, "tgt_embed"):  # nmt's Seq2SeqTransformer
            if packed_linears:
                module.project = PackedProjection(module)
            else:
                module.__dict__.pop("project", None)
    swap = (nn.Dropout, FastDropout) if fast_dropout else (FastDropout, nn.Dropout)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is swap[0]:
                setattr(parent, name, swap[1](child.p).train(child.training))
    return model


def uses_packed_linears(model: nn.Module) -> bool:
    """Whether `use_cpu_kernels(model, packed_linears=True)` is in effect."""
    return any(type(m) is PackedLayerLinear for m in model.modules())


# --- The packed linear -------------------------------------------------------------------------------------------
# `PackedLinear()(x, weight, bias)` is `F.linear`, except when nothing needs gradients and everything is float32 on
# a CPU with oneDNN: then the weight is reordered once into oneDNN's blocked layout (kept on the module it serves,
# refreshed when the weight changes) and multiplied there. On the small row counts of a decoding step this is up to
# twice as fast as MKL's sgemm on the plain weight, which is most of a CPU decoding step.


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (not torch.compiler.is_compiling()  # first: a compiled graph takes F.linear and asks nothing else
            and AVAILABLE and weight.numel() >= MIN_WEIGHT and x.device.type == "cpu"
            and x.dtype == weight.dtype == torch.float32
            and not torch.is_grad_enabled() and not weight.is_inference() and not torch.is_autocast_enabled("cpu"))


class PackedLinear:
    """F.linear for one module's weight, through oneDNN's packed layout where `_usable`. The packed copy lives here,
    on the module (not in a global table), with the key it was packed from: (version, data pointer, shape)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.pack: torch.Tensor | None = None

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        """weight (N, K) in oneDNN's layout, packed on first use and again whenever it changed (in place or moved)."""
        key = (compat.tensor_version(weight), weight.data_ptr(), weight.shape)
        if self.pack is None or self.key != key:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable outside inference mode too
                self.pack = compat.mkldnn_pack_linear_weight(weight.detach())
            self.key = key
        return self.pack

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 relu: bool = False) -> torch.Tensor:
        """F.linear(x, weight, bias) (..., K) -> (..., N), then ReLU if `relu` (fused into the product on oneDNN)."""
        if not _usable(x, weight):
            y = F.linear(x, weight, bias)
            return F.relu(y) if relu else y
        return compat.mkldnn_packed_linear(x, self.packed(weight), bias, relu)


class PackedLayerLinear(Linear):
    """`nmt.layers.Linear` multiplying through its own `PackedLinear` (`use_cpu_kernels` swaps it in)."""

    packed: PackedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, self.weight, self.effective_bias())


class PackedFeedForward(FeedForward):
    """`nmt.layers.FeedForward` with ReLU, its activation fused into the packed up-projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up
        if type(up) is not PackedLayerLinear:  # under an adapter (LoRA wraps the layer)
            return super().forward(x)
        return self.down(self.drop(up.packed(x, up.weight, up.effective_bias(), relu=True)))


class PackedProjection:
    """A model's output projection (tied to its target embedding) through a `PackedLinear`."""

    def __init__(self, model: nn.Module):
        self.model, self.linear = model, PackedLinear()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        m = self.model
        return self.linear(hidden, m.tgt_embed.weight, getattr(m, "final_logits_bias", None))


# --- The fast CPU dropout ----------------------------------------------------------------------------------------
# Torch's CPU dropout draws one random number per element, serially: on the feed-forward activations it took longer
# than the matmul before it (8% of a training step in all). Here each 64-bit draw gives four 16-bit uniforms, so p is
# rounded to a multiple of 2^-16 (0.1 -> 0.100006) and the scale 1/(1-p) with it.


class _CpuDropout(torch.autograd.Function):
    """Dropout whose keep-mask comes from 64-bit random words, four 16-bit uniforms per draw."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        n, cut = x.numel(), round(p * 65536)  # drop where a uniform 16-bit integer falls below the cut
        words = torch.randint(INT64.min, INT64.max, ((n + 3) // 4,), dtype=torch.int64, device=x.device)
        keep = torch.ge(words.view(torch.int16)[:n], cut - 32768, out=x.new_empty(n)).view(x.shape)  # 1. or 0.
        ctx.scale = 65536 / (65536 - cut)  # 1 / (1 - p) for the p actually used
        ctx.save_for_backward(keep)
        return torch.addcmul(x.new_zeros(()), x, keep, value=ctx.scale)  # x * keep / (1 - p) in one pass

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return torch.addcmul(grad.new_zeros(()), grad, keep, value=ctx.scale), None


class FastDropout(nn.Dropout):
    """nn.Dropout, with the faster mask of `_CpuDropout` on the CPU. Elsewhere (GPUs have fused dropout kernels) and
    under torch.compile it is nn.Dropout itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not self.training or x.device.type != "cpu" or not 0 < self.p < 1 - 2**-17
                or torch.compiler.is_compiling()):
            return super().forward(x)
        return _CpuDropout.apply(x, self.p)


# --- The fused label-smoothed cross-entropy ------------------------------------------------------------------------
# Autograd through F.log_softmax, the nll's gather and the smoothing term's sum builds three (N, V) gradients in the
# backward (the gather's scattered one, the sum's expanded one, their sum) and then log_softmax's own backward over
# them: four passes over the logits' size, a quarter of a CPU training step at d_model 128 and 8,000 subwords.
# Here the backward is one expression, softmax - (1 - eps) onehot - eps / V per real token, written into the saved
# log-probabilities' buffer (so a second backward fails autograd's version check instead of going wrong).


class _SmoothedCrossEntropy(torch.autograd.Function):
    """label_smoothed_nll's sums with a hand-written backward: (logits (N, V), labels (N,)) -> (loss, nll)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, pad_id: int, smoothing: float):
        lprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # (N, V), fp32 also under autocast
        loss, nll, real = smoothed_sums(lprobs, labels, pad_id, smoothing)
        if loss is nll:  # its own tensor: the nll alone is marked as carrying no gradient
            loss = nll.clone()
        weight = real.to(lprobs.dtype)  # (N,) 1 for a real token, 0 for padding
        ctx.save_for_backward(lprobs, labels, weight)
        ctx.smoothing, ctx.dtype = smoothing, logits.dtype
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_nll):
        lprobs, labels, weight = ctx.saved_tensors
        eps = ctx.smoothing
        g = (grad_loss * weight)[:, None]  # (N, 1): the loss's gradient on each row; padding's rows get 0
        grad = lprobs.exp_().mul_(g)  # softmax * g, in the log-probabilities' buffer
        if eps:
            grad.sub_(g * (eps / grad.shape[1]))
        grad.scatter_add_(1, labels[:, None], g * -(1.0 - eps))
        return grad.to(ctx.dtype), None, None, None


class FusedSeq2SeqLoss(Seq2SeqLoss):
    """`nmt.model.Seq2SeqLoss` scoring the model's logits through `_SmoothedCrossEntropy`: the same sums (within
    float rounding) and gradient. Under torch.compile, which fuses the plain loss itself, the plain loss runs."""

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, labels: torch.Tensor) -> LossSums:
        if torch.compiler.is_compiling():
            return super().forward(src_ids, tgt_in_ids, labels)
        logits = self.logits(src_ids, tgt_in_ids)  # (B, T, V)
        labels = labels.flatten()
        loss, nll = _SmoothedCrossEntropy.apply(logits.flatten(0, 1), labels, self.pad_id, self.label_smoothing)
        return LossSums(loss, nll, labels.ne(self.pad_id).sum())


def use_fused_loss(objective: Seq2SeqLoss, on: bool = True) -> Seq2SeqLoss:
    """Score `objective` through the fused cross-entropy (on) or the plain one (off), in place; returns it. Its
    state dict, hooks and wrapped model stay as they are."""
    if type(objective) in (Seq2SeqLoss, FusedSeq2SeqLoss):
        objective.__class__ = FusedSeq2SeqLoss if on else Seq2SeqLoss
    return objective


# --- the attention kernel of a training step -------------------------------------------------------------------------


def use_attention_path(objective: Seq2SeqLoss, precision: str) -> str | None:
    """On a CPU under mixed `precision` (bf16, fp16), the objective's training steps take the math attention kernel
    (`Seq2SeqLoss.attention_path`); returns what was chosen and why, or None where torch's own choice stays (fp32,
    where its kernels step alike; a GPU, whose fused kernels are the fastest; a model of the user's own).

    torch picks a CPU's kernel from the call alone: without dropout on the attention weights it takes the fused
    (flash) kernel, whose forward is the faster but whose backward in bf16 takes several times the math kernel's at
    a translation model's shapes (forward and backward, B48 H4 T20 D32, one thread: 19.6 ms against 3.6 ms on an AMX
    CPU, 23.5 against 11.2 on AVX2; fp32 level); with dropout it takes the math kernel. So a run without attention
    dropout (Marian's placement, every imported OPUS-MT model) stepped slower than one with it. The choice is a
    rule of the device and precision, not a timing, so every process and a resumed run take the same kernels and
    compute bit for bit what an uninterrupted run computes (`benchmarks/attention_path.py` measures it). Decoding
    is not touched: it runs the forward only, where torch's choice is the fast one."""
    model = objective.model
    weight, cfg = next(model.parameters()), getattr(model, "cfg", None)
    if weight.device.type != "cpu" or not isinstance(cfg, ModelConfig) or precision not in ("bf16", "fp16"):
        objective.attention_path = None
        return None
    objective.attention_path = ("MATH",)
    return (f"attention: the math kernel for training in {precision} on the CPU (torch's fused kernel steps "
            f"slower there, forward and backward together; attention dropout {cfg.dropout_at('attention'):g})")
