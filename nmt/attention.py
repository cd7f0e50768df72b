"""Cross-attention alignments of a translation, and their picture.

`scaled_dot_product_attention` returns no weights, so they are recomputed from the model's own modules:
one teacher-forced decoder pass over the chosen translation, with a forward pre-hook on a decoder
layer's cross-attention that captures its query input; keys come from that layer's `cross_kv`.
Drawing uses matplotlib's Agg canvas only (no pyplot, no display), as `nmt.tools.plot` does.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import torch

from nmt.errors import NmtError


@torch.no_grad()
def cross_attention(model, src_ids: torch.Tensor, tgt_ids: list[int], layer: int = -1,
                    average: bool = True) -> torch.Tensor:
    """Cross-attention weights of one sentence pair, in float32 on the CPU.

    Args:
        model: a `Seq2SeqTransformer` (eval mode: dropout would perturb the pass).
        src_ids: (1, S) or (S,) source ids of one sentence, without padding.
        tgt_ids: the T target ids to force (the translation, usually ending in </s>).
        layer: decoder layer index (default: the last).
        average: average over heads -> (T, S); False -> (H, T, S).

    Row t holds the attention of the step that predicted tgt_ids[t] (input: <s> + tgt_ids[:t]); rows sum to 1.
    """
    src_ids = src_ids.reshape(1, -1)
    if bool(src_ids.eq(model.cfg.pad_id).any()):
        raise NmtError("cross_attention takes one sentence without padding")
    return cross_attentions(model, src_ids.tolist(), [list(tgt_ids)], layer, average)[0]


@torch.no_grad()
def cross_attentions(model, src_ids: list[list[int]], tgt_ids: list[list[int]], layer: int = -1,
                     average: bool = True) -> list[torch.Tensor]:
    """`cross_attention` of many sentence pairs in one padded teacher-forced pass: per pair, its (T_i, S_i) weights
    ((H, T_i, S_i) without `average`), as the pair alone gives them (padded keys get no weight; the decoder is
    causal, so padding after a target changes none of its rows). `src_ids` and `tgt_ids`: one list of ids per
    pair, without padding."""
    from nmt.batching import pad

    if not src_ids:
        return []
    if any(not t for t in tgt_ids):
        raise NmtError("cross_attention needs at least one target token")
    n_layers = len(model.decoder)
    if not -n_layers <= layer < n_layers:
        raise NmtError(f"decoder layer {layer} does not exist: the model has {n_layers} "
                       f"(0..{n_layers - 1}, or -1 for the last)")
    block = model.decoder[layer]
    device = next(model.parameters()).device
    src = pad(src_ids, model.cfg.pad_id).to(device)  # (B, S)
    tgt_in = pad([[model.cfg.bos_id, *t[:-1]] for t in tgt_ids], model.cfg.pad_id).to(device)  # (B, T)
    seen: list[torch.Tensor] = []
    handle = block.cross_attn.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        memory = model.encode(src)
        model.decode_hidden(tgt_in, memory, src)
    finally:
        handle.remove()
    attn = block.cross_attn
    q = attn.heads(attn.q(seen[-1])).float()  # (B, H, T, Dh)
    k = block.cross_kv(memory)[0].float()  # (B, H, S, Dh)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    scores = scores.masked_fill(src.eq(model.cfg.pad_id)[:, None, None, :], torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1).cpu()  # (B, H, T, S)
    weights = weights.mean(1) if average else weights
    return [weights[i, ..., : len(t), : len(s)] for i, (s, t) in enumerate(zip(src_ids, tgt_ids))]


def plot_alignment(src_tokens: list[str], tgt_tokens: list[str], weights: torch.Tensor, out: str | Path,
                   title: str | None = None, dpi: int = 120) -> Path:
    """Draw weights (T, S) as a heatmap: source subwords along the top, target subwords down the side (as the
    tokenizer writes them, "▁" marking a word start), a colorbar, and `title` above (default: the source and
    the translation, read back from the tokens; "" for none).
    The format follows the suffix (.png, .svg, .pdf). Returns the path written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    weights = torch.as_tensor(weights, dtype=torch.float32).cpu()
    T, S = weights.shape
    if (T, S) != (len(tgt_tokens), len(src_tokens)):
        raise NmtError(f"weights of shape {(T, S)} do not match {len(tgt_tokens)} target and "
                       f"{len(src_tokens)} source tokens")
    out = Path(out)
    cell = 0.42  # inches per token: labels of ~10 characters stay readable
    fig = Figure(figsize=(min(max(5.0, 2.8 + cell * S), 40.0), min(max(4.0, 2.4 + cell * T), 40.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(weights.numpy(), cmap="viridis", vmin=0.0, vmax=max(float(weights.max()), 1e-6), aspect="auto",
                      interpolation="nearest")
    ax.set_xticks(range(S), src_tokens, rotation=60, ha="left", rotation_mode="anchor")
    ax.set_yticks(range(T), tgt_tokens)
    ax.xaxis.tick_top()
    ax.set_xlabel("source subwords")
    ax.xaxis.set_label_position("top")
    ax.set_ylabel("target subwords (in generation order)")
    ax.set_xticks([x - 0.5 for x in range(1, S)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, T)], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.5, alpha=0.4)
    ax.tick_params(which="minor", length=0)
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, label="attention weight")
    title = title if title is not None else f"{_text(src_tokens)}  \u2192  {_text(tgt_tokens)}"
    if title:
        fig.suptitle("\n".join(textwrap.wrap(title, width=max(40, int(fig.get_figwidth() * 9)))), fontsize=11)
    fig.tight_layout()
    from nmt.tools.plot import save_figure

    return save_figure(fig, out, dpi)



def _text(tokens: list[str]) -> str:
    """Subword tokens back to text (Metaspace: "▁" starts a word), without specials."""
    return "".join(t for t in tokens if t not in ("</s>", "<s>", "<pad>")).replace("\u2581", " ").strip()
