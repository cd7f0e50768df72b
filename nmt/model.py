"""The model chapter: the encoder-decoder Transformer (batch first), the cache its incremental decoding keeps, and
the loss it is trained on. It takes token ids only and derives every mask itself.

`forward(src_ids, tgt_in_ids) -> logits` is all that DDP/DataParallel ever call; search calls `encode` and
`decode` (with a `DecoderCache` for incremental decoding) on the unwrapped model. In reading order: the model
(`Seq2SeqTransformer`, built from the parts of nmt.layers); the decoder's key/value cache; the label-smoothed
cross-entropy; and the training objective (`Seq2SeqLoss`), the module `Accelerator.prepare` receives.
Shapes: B batch, S source, T target, D model, H heads, Dh head width, V vocabulary.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nmt.batching import special_id
from nmt.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from nmt.config import ModelConfig, to_dict
from nmt.errors import NmtError
from nmt.layers import DecoderLayer, EncoderLayer, key_attend, sinusoids

# --- The model -------------------------------------------------------------------------------------------------------


ATTENTION_INPUTS = ("qkv.weight", ".q.weight", ".kv.weight")  # queries, keys and values (`reset_parameters`)


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder Transformer taking only batch-leading LongTensors of token ids."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.src_vocab_size <= 0 or cfg.tgt_vocab_size <= 0:
            raise NmtError("model.src_vocab_size and model.tgt_vocab_size must be set (train fills them from the tokenizer)")
        if cfg.unresolved():
            raise NmtError(f"model.{', model.'.join(cfg.unresolved())} not set: give them, or a size preset "
                           "(ModelConfig(size='small'), or ModelConfig.preset('small')); size 'auto' is resolved by "
                           "train() from the corpus size")
        self.cfg = cfg
        shared = cfg.share_embeddings and cfg.src_vocab_size == cfg.tgt_vocab_size
        self.tgt_embed = nn.Embedding(cfg.tgt_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.src_embed = self.tgt_embed if shared else nn.Embedding(cfg.src_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.register_buffer("positions", sinusoids(cfg.max_positions, cfg.d_model, cfg.positions), persistent=False)
        if cfg.final_logits_bias:  # a buffer, as in Marian: stored with the weights, never trained
            self.register_buffer("final_logits_bias", torch.zeros(cfg.tgt_vocab_size))
        self.drop = nn.Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        self.enc_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model) if cfg.pre_norm else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fresh weights (`ModelConfig.fresh_std`): matrices from N(0, std), biases 0, LayerNorms 1 and 0, the
        padding row 0; std 0: Xavier-uniform matrices and N(0, d_model^-1/2) embeddings (scaled by sqrt(d_model),
        they start at the positions' unit scale). nmt's default start (`ModelConfig.mixed_start`) draws the matrices
        from N(0, 0.02) but keeps the Xavier start for attention's input projections and the embeddings; an init_std
        given draws every matrix and embedding from N(0, init_std)."""
        std = self.cfg.fresh_std() or None
        mixed = self.cfg.mixed_start()
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                if std is None or (mixed and name.endswith(ATTENTION_INPUTS)):
                    nn.init.xavier_uniform_(p)
                else:
                    nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for emb in {self.src_embed, self.tgt_embed}:
            nn.init.normal_(emb.weight, std=self.cfg.d_model ** -0.5 if std is None or mixed else std)
            with torch.no_grad():
                emb.weight[self.cfg.pad_id].zero_()

    def embed(self, ids: torch.Tensor, table: nn.Embedding, offset: int = 0) -> torch.Tensor:
        """(B, L) ids -> (B, L, D): scaled embeddings plus sinusoidal positions from `offset`."""
        L = ids.shape[1]
        if offset + L > self.cfg.max_positions:
            raise NmtError(f"sequence of {offset + L} tokens is longer than model.max_positions={self.cfg.max_positions}")
        x = table(ids) * math.sqrt(self.cfg.d_model) if self.cfg.scale_embedding else table(ids)
        x = x + self.positions[offset : offset + L].to(table.weight.dtype)
        return self.drop(x)

    def encode(self, src_ids: torch.Tensor) -> torch.Tensor:
        """src_ids (B, S) -> memory (B, S, D)."""
        attend = key_attend(src_ids, self.cfg.pad_id)
        x = self.embed(src_ids, self.src_embed)
        for layer in self.encoder:
            x = self._through(layer, x, attend)
        return self.enc_norm(x)

    def _through(self, layer: nn.Module, *args):
        """`layer(*args)`; in training with `checkpoint_activations`, keeping only its input for the backward, which
        runs the layer again (with the same dropout) to get the rest: activation memory of one layer, not all."""
        if self.cfg.checkpoint_activations and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
        return layer(*args)

    def start_cache(self, memory: torch.Tensor, src_ids: torch.Tensor) -> DecoderCache:
        """A cache holding the cross-attention K/V of `memory` (B, S, D) for every decoder layer."""
        cross = [layer.cross_kv(memory) for layer in self.decoder]
        return DecoderCache(cross, key_attend(src_ids, self.cfg.pad_id))

    def decode_hidden(self, tgt_in_ids: torch.Tensor, memory: torch.Tensor, src_ids: torch.Tensor,
                      cache: DecoderCache | None = None) -> torch.Tensor:
        """Target prefix (B, T) -> the decoder's hidden states (B, T, D): the one decoder path.

        Without a cache, the whole prefix is run causally (training, forced decoding). With one (from
        `start_cache`), `tgt_in_ids` holds only the new positions; the cache grows by them.
        """
        if cache is None:
            cross, self_kv, group, offset = [memory] * len(self.decoder), None, 1, 0
            attend = key_attend(src_ids, self.cfg.pad_id)
        else:
            cross, attend, self_kv, group, offset = cache.cross_kv, cache.attend, cache.self_kv, cache.group, cache.length
        x = self.embed(tgt_in_ids, self.tgt_embed, offset)
        for i, layer in enumerate(self.decoder):
            x = self._through(layer, x, cross[i], attend, None if self_kv is None else self_kv[i], group)
        return self.dec_norm(x)

    def decode(self, tgt_in_ids: torch.Tensor, memory: torch.Tensor, src_ids: torch.Tensor,
               cache: DecoderCache | None = None) -> torch.Tensor:
        """Target prefix (B, T) -> logits (B, T, V) (see `decode_hidden`)."""
        return self.project(self.decode_hidden(tgt_in_ids, memory, src_ids, cache))

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., D) -> (..., V) through the output projection tied to the target embedding."""
        return F.linear(hidden, self.tgt_embed.weight, getattr(self, "final_logits_bias", None))

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor) -> torch.Tensor:
        """src_ids (B, S), tgt_in_ids (B, T) -> logits (B, T, V) at every position, as cached decoding computes them."""
        return self.project(self.decode_hidden(tgt_in_ids, self.encode(src_ids), src_ids))

    @torch.no_grad()
    def generate(self, src_ids: torch.Tensor, beam_size: int = 1, max_new_tokens: int = 128, **kwargs) -> torch.Tensor:
        """Translations as (B, L) ids ending in eos_id then pad_id. See `nmt.decoding.generate`."""
        from nmt.decoding import generate  # the model's convenience entry into search (search never imports model)

        return generate(self, src_ids, beam_size=beam_size, max_new_tokens=max_new_tokens, **kwargs)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save_pretrained(self, directory: str | Path, state_dict: dict | None = None) -> None:
        """config.json + model.safetensors (no pickle anywhere). `state_dict` overrides the module's own
        (e.g. full weights gathered from FSDP shards)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(json.dumps(to_dict(self.cfg), indent=2))
        state = {k: v.detach().contiguous().cpu() for k, v in (state_dict or self.state_dict()).items()}
        if self.src_embed is self.tgt_embed:
            state.pop("src_embed.weight", None)  # shared tensors are stored once
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


# --- The decoder's key/value cache -----------------------------------------------------------------------------------
# The decoder's key/value cache for incremental decoding (`Seq2SeqTransformer.start_cache`), kept apart from
# the model: what a search reorders, repeats and prunes as hypotheses go.
# Shapes: G sentences, R = G * group hypothesis rows, H heads, S source, t steps so far, Dh head width.

class SelfKV:
    """One decoder layer's self-attention keys and values so far, stored time-major (t, R, H, Dh).

    A reorder of the rows (beams re-ranked, sentences finished) is only noted; the next `extend` copies the
    old steps in the new row order and appends the new one in a single pass (time-major, the old steps are
    one contiguous block of the result). Attention reads them as (R, H, t, Dh) views.
    """

    def __init__(self):
        self.k: torch.Tensor | None = None  # (t, R, H, Dh)
        self.v: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None  # reorder still to apply: new row i is old row rows[i]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[0]

    def reorder(self, rows: torch.Tensor) -> None:
        if self.k is not None:
            self.rows = rows if self.rows is None else self.rows.index_select(0, rows)

    def settle(self) -> None:
        """Apply the noted reorder now (a compiled step then sees one kind of cache: rows in order)."""
        if self.rows is not None:
            self.k, self.v, self.rows = self.k.index_select(1, self.rows), self.v.index_select(1, self.rows), None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions k, v (R, H, n, Dh); returns all positions, (R, H, t + n, Dh) each."""
        self.k, self.v = self._append(self.k, k), self._append(self.v, v)
        self.rows = None
        return tuple(self)

    def __iter__(self):
        """K and V as batch-leading (R, H, t, Dh) views (after `extend`)."""
        if self.k is not None:
            yield from (self.k.permute(1, 2, 0, 3), self.v.permute(1, 2, 0, 3))

    def _append(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        new = new.permute(2, 0, 1, 3)  # (n, R, H, Dh)
        if old is None:
            return new.contiguous()
        out = new.new_empty(old.shape[0] + new.shape[0], *new.shape[1:])
        if self.rows is None:
            out[: old.shape[0]] = old
        else:
            torch.index_select(old, 1, self.rows, out=out[: old.shape[0]])
        out[old.shape[0]:] = new
        return out


class DecoderCache:
    """Per-layer keys/values for incremental decoding; every tensor is batch-leading (self-attention K/V are
    stored time-major, `SelfKV`, and seen batch-leading).

    Cross-attention K/V come from the encoder output once per sentence; self-attention K/V grow by one step
    per call, one row per hypothesis. A sentence's `group` hypotheses (beam search's K beams) are consecutive
    rows and share its cross-attention K/V, which are never copied per beam. `select` re-indexes every layer at
    once when hypotheses are re-ranked, repeated or pruned.
    """

    def __init__(self, cross_kv: list[tuple], attend: torch.Tensor | None):
        self.cross_kv = cross_kv  # per layer (G, H, S, Dh) twice
        self.attend = attend  # (G, 1, 1, S) or None
        self.self_kv = [SelfKV() for _ in cross_kv]  # R = G * group rows
        self.group = 1

    @property
    def length(self) -> int:
        return self.self_kv[0].length

    def select(self, rows: torch.Tensor, sentences: torch.Tensor | None = None, group: int = 1) -> None:
        """Keep hypothesis rows `rows` (R',) in that order, `group` per sentence; `sentences` (G',) picks the
        sentences that go on (None: all of them, in order)."""
        for kv in self.self_kv:
            kv.reorder(rows)
        if sentences is not None:
            self.cross_kv = [(k.index_select(0, sentences), v.index_select(0, sentences)) for k, v in self.cross_kv]
            self.attend = None if self.attend is None else self.attend.index_select(0, sentences)
        self.group = group

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` (K,) of a cache holding one row per sentence, in that order."""
        self.select(index, index, 1)

    def settle(self) -> None:
        """Apply every layer's noted reorder now (`SelfKV.settle`)."""
        for kv in self.self_kv:
            kv.settle()


# --- Label-smoothed cross-entropy ------------------------------------------------------------------------------------
# Sums, not means: the training loop divides by the number of target tokens in the whole optimizer step (all
# processes, all micro-batches), so the gradient does not depend on how a step is split. The token count stays a
# tensor: reading it on the host would make a GPU wait for the batch.


def label_smoothed_nll(logits: torch.Tensor, labels: torch.Tensor, pad_id: int,
                       smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (B, T, V), labels (B, T) -> (smoothed loss sum, nll sum, number of real tokens), scalars in fp32.

    Positions whose label is `pad_id` are not scored. The loss is `F.cross_entropy(logits, labels, ignore_index=
    pad_id, label_smoothing=smoothing, reduction="sum")`, computed as F.cross_entropy computes it (log-softmax, then
    the nll and the smoothing term), so that the unsmoothed nll (detached; perplexity reports it) needs no second
    pass over the (B, T, V) log-probabilities.
    """
    lprobs = F.log_softmax(logits.flatten(0, 1).float(), dim=-1)  # (B*T, V), fp32 also under autocast
    loss, nll, real = smoothed_sums(lprobs, labels.flatten(), pad_id, smoothing)
    return loss, nll.detach(), real.sum()


def smoothed_sums(lprobs: torch.Tensor, labels: torch.Tensor, pad_id: int,
                  smoothing: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lprobs (N, V), labels (N,) -> (smoothed loss sum, nll sum, real (N,) bool): the formula of both losses (this
    one and nmt.kernels' fused one)."""
    real = labels.ne(pad_id)
    nll = F.nll_loss(lprobs, labels, ignore_index=pad_id, reduction="sum")
    loss = nll
    if smoothing:
        uniform = -(lprobs.sum(-1) * real).sum() / lprobs.shape[-1]  # -log p averaged over the vocabulary
        loss = (1.0 - smoothing) * nll + smoothing * uniform
    return loss, nll, real


# --- The training objective ------------------------------------------------------------------------------------------
# The training objective: a module wrapping any model, returning summed label-smoothed loss sums.
#
# `Seq2SeqLoss` is what `Accelerator.prepare` receives for training, so DDP/FSDP wrap one forward that
# scores a micro-batch: the model's logits through `label_smoothed_nll`. Its state dict is the plain model's
# (no `model.` prefix), so checkpoints and model directories keep the layout of a bare model.

_INNER = re.compile(r"(^|\.)model\.")


class LossSums(NamedTuple):
    """Sums over the real (non-pad) target tokens of a batch."""

    loss: torch.Tensor  # label-smoothed loss sum, scalar, carries the gradient
    nll: torch.Tensor  # negative log-likelihood sum, scalar, detached
    tokens: torch.Tensor  # real target tokens scored, a scalar tensor (read on the host only when logged)


class Seq2SeqLoss(nn.Module):
    """`forward(src_ids (B,S), tgt_in_ids (B,T), labels (B,T)) -> LossSums` of any model following the contract
    `model(src_ids, tgt_in_ids) -> logits (B, T, V)`.

    Args:
        model: the model.
        label_smoothing: epsilon of the smoothed loss (the nll is always unsmoothed).
        flat_state_dict: state dicts without the `model.` prefix (off under FSDP, whose sharded checkpoints
            name parameters by their path from the wrapped root).
    """

    def __init__(self, model: nn.Module, label_smoothing: float = 0.0, flat_state_dict: bool = True):
        super().__init__()
        self.model = model
        self.label_smoothing = float(label_smoothing)
        self.pad_id = special_id(model, "pad_id")
        if flat_state_dict:
            self.register_state_dict_post_hook(_drop_prefix)
            self.register_load_state_dict_pre_hook(_add_prefix)
            self.register_load_state_dict_post_hook(_report_without_prefix)

    # the attention kernels a training step may take (SDPBackend names, "MATH"; None: torch's own choice for each
    # call); `nmt.kernels.use_attention_path` narrows it where torch's choice makes the step slower on this device
    attention_path: tuple[str, ...] | None = None

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, labels: torch.Tensor) -> LossSums:
        logits = self.logits(src_ids, tgt_in_ids)  # (B, T, V)
        return LossSums(*label_smoothed_nll(logits, labels, self.pad_id, self.label_smoothing))

    def logits(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor) -> torch.Tensor:
        """The model's logits (B, T, V), its attention on `attention_path` where one is set (the kernel a call
        takes in the forward is the one its backward runs)."""
        if self.attention_path is None:
            return self.model(src_ids, tgt_in_ids)
        with sdpa_kernel([getattr(SDPBackend, name) for name in self.attention_path]):
            return self.model(src_ids, tgt_in_ids)


def _drop_prefix(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_prefix(module, state_dict, prefix, *args) -> None:
    inner = prefix + "model."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def _report_without_prefix(module, incompatible) -> None:
    """Missing/unexpected keys named as in the flat state dict (safetensors' load_model matches them so)."""
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [_INNER.sub(r"\1", k, count=1) for k in keys]


def unwrap_objective(module: nn.Module) -> nn.Module:
    """The plain model inside a (possibly already unwrapped) `Seq2SeqLoss`; other modules as they are."""
    return module.model if isinstance(module, Seq2SeqLoss) else module
