"""CPU inference linears through oneDNN with weights packed once (the layout its kernels want).

`linear(x, weight, bias)` is `F.linear`, except when nothing needs gradients and everything is float32 on
a CPU with oneDNN: then the weight is reordered once into oneDNN's blocked layout (kept beside the model,
refreshed when the weight changes) and multiplied there. On the small row counts of a decoding step this is
up to twice as fast as MKL's sgemm on the plain weight, which is most of a CPU decoding step.

The two ops are PyTorch's own private ones that inductor's CPU freezing uses (`torch.ops.mkldnn.
_reorder_linear_weight` / `_linear_pointwise`), reached through `nmt.compat` like every private API;
`tests/test_fastlinear.py` fails loudly if they change. Without them, `F.linear` runs.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from nmt import compat

_PACKED: dict[int, tuple[tuple, torch.Tensor]] = {}  # id(weight) -> (what it was packed from, packed weight)
AVAILABLE = compat.mkldnn_packed_linear_available()
enabled = True  # switch off to compare against F.linear
MIN_WEIGHT = 256 * 256  # smaller weights take F.linear: oneDNN's ~0.1 ms set-up per call outweighs its gain


def forget(*_hook_args) -> None:
    """Drop every packed weight; each is packed again on its next use."""
    _PACKED.clear()


# A fused optimizer (torch.optim.AdamW(fused=True), what training uses) updates weights in place without bumping
# their version counter (torch 2.13), so the key in `packed` cannot see a training step: any optimizer step drops
# the packs, or validation during training would decode with the weights of its first validation.
register_optimizer_step_post_hook(forget)


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (enabled and AVAILABLE and weight.numel() >= MIN_WEIGHT and x.device.type == "cpu"
            and x.dtype == weight.dtype == torch.float32
            and not torch.is_grad_enabled() and not weight.is_inference() and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


def packed(weight: torch.Tensor) -> torch.Tensor:
    """weight (N, K) in oneDNN's layout, packed on first use and again whenever it changed (in place or moved)."""
    key = (compat.tensor_version(weight), weight.data_ptr(), weight.shape)
    hit = _PACKED.get(id(weight))
    if hit is not None and hit[0] == key:
        return hit[1]
    if hit is None:
        weakref.finalize(weight, _PACKED.pop, id(weight), None)  # the packed copy goes with its weight
    with torch.inference_mode(False), torch.no_grad():  # a normal tensor, usable outside inference mode too
        out = compat.mkldnn_pack_linear_weight(weight.detach())
    _PACKED[id(weight)] = (key, out)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) (..., K) -> (..., N), then ReLU if `relu` (fused into the product on oneDNN)."""
    if not _usable(x, weight):
        y = F.linear(x, weight, bias)
        return F.relu(y) if relu else y
    return compat.mkldnn_packed_linear(x, packed(weight), bias, relu)
