"""The model chapter (nmt.model): the encoder-decoder's properties (causality, padding and batch splits change
nothing, cached decoding equals recomputation, the batch-leading contract), its model directories, the
label-smoothed loss (sums over real tokens that add up over any split) and the training objective (Seq2SeqLoss)."""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import ATOL, PAD, chunks_at, one_thread, src_batch, tgt_in_batch, tiny_model  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_model, save_model

from nmt.batching import Collator
from nmt.model import (
    LossSums,
    Seq2SeqLoss,
    Seq2SeqTransformer,
    label_smoothed_nll,
    unwrap_objective,
)

V = 24
PROPERTY = settings(max_examples=30, deadline=None)


@st.composite
def models(draw) -> Seq2SeqTransformer:
    """Any tiny model: pre/post-norm, shared/separate embeddings, relu/gelu, 1-2 layers."""
    return tiny_model(seed=draw(st.integers(0, 2**16)), vocab=V, layers=draw(st.integers(1, 2)),
                      pre_norm=draw(st.booleans()), share=draw(st.booleans()),
                      activation=draw(st.sampled_from(["relu", "gelu"])))


@st.composite
def batches(draw, min_rows: int = 1, max_rows: int = 4, max_src: int = 7, max_tgt: int = 8):
    """(src_ids (B,S), tgt_in_ids (B,T)) with random lengths per row: some padding, some none."""
    B = draw(st.integers(min_rows, max_rows))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    src_lens = draw(st.lists(st.integers(1, max_src), min_size=B, max_size=B))
    tgt_lens = draw(st.lists(st.integers(1, max_tgt), min_size=B, max_size=B))
    return src_batch(gen, src_lens, V), tgt_in_batch(gen, tgt_lens, V)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=ATOL, rtol=0)


@PROPERTY
@given(model=models(), batch=batches(max_tgt=8), data=st.data())
def test_future_target_tokens_never_change_earlier_logits(model, batch, data):
    src_ids, tgt_in_ids = batch
    T = tgt_in_ids.shape[1]
    if T < 2:
        tgt_in_ids = torch.cat([tgt_in_ids, torch.full_like(tgt_in_ids, 5)], dim=1)
        T = 2
    t = data.draw(st.integers(0, T - 2), label="last unchanged position")
    changed = tgt_in_ids.clone()
    # a different word at every later position (the shift keeps it off the special ids)
    changed[:, t + 1 :] = (tgt_in_ids[:, t + 1 :] + 7) % (V - 4) + 4
    with torch.no_grad():
        before, after = model(src_ids, tgt_in_ids), model(src_ids, changed)
    assert close(before[:, : t + 1], after[:, : t + 1])
    assert not close(before[:, t + 1], after[:, t + 1])  # the change did reach the model


@PROPERTY
@given(model=models(), batch=batches(), extra=st.integers(1, 6))
def test_extra_source_padding_changes_nothing(model, batch, extra):
    src_ids, tgt_in_ids = batch
    padded = torch.cat([src_ids, torch.full((src_ids.shape[0], extra), PAD)], dim=1)
    with torch.no_grad():
        assert close(model(src_ids, tgt_in_ids), model(padded, tgt_in_ids))
        S = src_ids.shape[1]
        assert close(model.encode(src_ids), model.encode(padded)[:, :S])


@PROPERTY
@given(model=models(), batch=batches(min_rows=2))
def test_row_of_padded_batch_equals_it_alone(model, batch):
    src_ids, tgt_in_ids = batch
    with torch.no_grad():
        logits = model(src_ids, tgt_in_ids)  # (B, T, V)
        for i in range(src_ids.shape[0]):
            s, t = int(src_ids[i].ne(PAD).sum()), int(tgt_in_ids[i].ne(PAD).sum())
            alone = model(src_ids[i : i + 1, :s], tgt_in_ids[i : i + 1, :t])
            assert close(logits[i : i + 1, :t], alone)


def decode_stepwise(model, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits from a cache fed one target position at a time."""
    memory = model.encode(src_ids)
    cache = model.start_cache(memory, src_ids)
    steps = [model.decode(tgt_in_ids[:, j : j + 1], memory, src_ids, cache=cache) for j in range(tgt_in_ids.shape[1])]
    return torch.cat(steps, dim=1)


@PROPERTY
@given(model=models(), batch=batches(min_rows=2, max_rows=6), data=st.data())
def test_splitting_the_batch_anywhere_changes_nothing(model, batch, data):
    src_ids, tgt_in_ids = batch
    B = src_ids.shape[0]
    cuts = data.draw(st.lists(st.integers(1, B - 1), min_size=1, max_size=B - 1), label="cut points")
    parts = chunks_at(B, cuts)
    joined = lambda fn: torch.cat([fn(p) for p in parts], dim=0)
    with torch.no_grad():
        memory = model.encode(src_ids)
        assert close(joined(lambda p: model(src_ids[p], tgt_in_ids[p])), model(src_ids, tgt_in_ids))
        assert close(joined(lambda p: model.encode(src_ids[p])), memory)
        assert close(joined(lambda p: model.decode(tgt_in_ids[p], memory[p], src_ids[p])),
                     model.decode(tgt_in_ids, memory, src_ids))
        assert close(joined(lambda p: decode_stepwise(model, src_ids[p], tgt_in_ids[p])),
                     decode_stepwise(model, src_ids, tgt_in_ids))


@PROPERTY
@given(model=models(), batch=batches(max_tgt=9), data=st.data())
def test_cached_decoding_equals_full_recomputation(model, batch, data):
    """Fed in random groups of positions, with one random reorder (permute, repeat, drop) of the cache."""
    src_ids, tgt_in_ids = batch
    B, T = tgt_in_ids.shape
    bounds = chunks_at(T, data.draw(st.lists(st.integers(1, max(T - 1, 1)), max_size=4), label="feed cuts"))
    reorder_before = data.draw(st.integers(0, len(bounds)), label="reorder before group")  # len: never
    index = torch.tensor(data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=2 * B), label="index"))
    rows = torch.arange(B)
    with torch.no_grad():
        memory = model.encode(src_ids)
        cache = model.start_cache(memory, src_ids)
        for g, part in enumerate(bounds):
            if g == reorder_before:
                cache.reorder(index)
                rows = rows[index]
            assert cache.length == part.start
            got = model.decode(tgt_in_ids[rows, part], memory[rows], src_ids[rows], cache=cache)
            full = model(src_ids[rows], tgt_in_ids[rows, : part.stop])[:, part]
            assert close(got, full), f"positions {part.start}..{part.stop - 1}"


VARIANTS = list(itertools.product([True, False], [True, False], ["relu", "gelu"]))


@pytest.mark.parametrize("pre_norm,share,activation", VARIANTS)
def test_every_variant_trains_end_to_end(pre_norm, share, activation):
    """Forward and backward in train mode with dropout: every parameter receives a finite gradient."""
    model = tiny_model(seed=1, vocab=V, tgt_vocab=V if share else V + 5, layers=2, pre_norm=pre_norm,
                       share=share, activation=activation, dropout=0.1).train()
    gen = torch.Generator().manual_seed(0)
    src_ids, tgt_in_ids = src_batch(gen, [5, 3, 1], V), tgt_in_batch(gen, [4, 6, 2], V)
    logits = model(src_ids, tgt_in_ids)
    assert logits.shape == (3, 6, model.cfg.tgt_vocab_size)
    logits.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} gets no gradient"


def tensor_params(fn) -> list[str]:
    sig = inspect.signature(fn, eval_str=True)
    return [n for n, p in sig.parameters.items() if "Tensor" in str(p.annotation)]


def test_batch_leading_contract():
    """Every tensor that crosses the model's API or leaves the collator has dim 0 == B, and B=3 differs
    from every other dim (S=5, T=7, D=16, V=24, H=2), so a tensor laid out any other way would show."""
    B, S, T = 3, 5, 7
    assert tensor_params(Seq2SeqTransformer.forward) == ["src_ids", "tgt_in_ids"]
    assert tensor_params(Seq2SeqTransformer.encode) == ["src_ids"]
    assert tensor_params(Seq2SeqTransformer.decode) == ["tgt_in_ids", "memory", "src_ids"]
    gen = torch.Generator().manual_seed(0)
    examples = [{"src_ids": src_batch(gen, [n], V)[0].tolist(), "tgt_ids": list(range(4, 4 + m))}
                for n, m in [(5, 2), (3, 6), (1, 4)]]
    batch = Collator()(examples)
    assert set(batch) == {"src_ids", "tgt_in_ids", "labels"}
    assert {k: tuple(v.shape) for k, v in batch.items()} == {"src_ids": (B, S), "tgt_in_ids": (B, T), "labels": (B, T)}
    model = tiny_model(seed=0, vocab=V)
    with torch.no_grad():
        assert model(batch["src_ids"], batch["tgt_in_ids"]).shape == (B, T, V)
        n_real = Seq2SeqLoss(model)(batch["src_ids"], batch["tgt_in_ids"], batch["labels"]).tokens
        assert n_real == int(batch["labels"].ne(PAD).sum())
        memory = model.encode(batch["src_ids"])
        assert memory.shape == (B, S, 16)
        cache = model.start_cache(memory, batch["src_ids"])
        logits = model.decode(batch["tgt_in_ids"][:, :1], memory, batch["src_ids"], cache=cache)
        assert logits.shape == (B, 1, V)
    cached = [t for kv in cache.cross_kv + cache.self_kv for t in kv] + [cache.attend]
    assert all(t.shape[0] == B for t in cached)


def test_model_without_sizes_is_named():
    """size 'auto' is resolved by train() from the corpus; a model built directly needs sizes or a preset."""
    from nmt import ModelConfig
    from nmt.errors import NmtError

    with pytest.raises(NmtError, match=r"model.d_model, .*model.dropout not set.*size preset"):
        Seq2SeqTransformer(ModelConfig(src_vocab_size=10, tgt_vocab_size=10))
    assert Seq2SeqTransformer(ModelConfig(src_vocab_size=10, tgt_vocab_size=10, size="tiny")).cfg.d_model == 32


def test_fresh_weights_are_drawn_as_the_config_says():
    """From d_model 128 on, matrices from N(0, 0.02) but attention's input projections Xavier-uniform and embeddings
    N(0, d^-1/2) (nmt's start); Xavier-uniform matrices and N(0, d^-1/2) embeddings below it and with init_std 0;
    every matrix and embedding from N(0, init_std) as given otherwise."""
    from nmt import ModelConfig

    def stds(**kw) -> tuple[float, float, float]:
        torch.manual_seed(0)
        model = Seq2SeqTransformer(ModelConfig(src_vocab_size=2000, tgt_vocab_size=2000, **kw))
        matrices = {n: p for n, p in model.named_parameters() if p.dim() > 1 and "embed" not in n}
        inputs = [p for n, p in matrices.items() if n.endswith(("qkv.weight", ".q.weight", ".kv.weight"))]
        rest = [p for n, p in matrices.items() if not n.endswith(("qkv.weight", ".q.weight", ".kv.weight"))]
        assert len(inputs) == 3 * model.cfg.n_decoder_layers + model.cfg.n_encoder_layers  # qkv; q and kv
        return (torch.cat([m.flatten() for m in rest]).std().item(), torch.cat([m.flatten() for m in inputs]).std().item(),
                model.tgt_embed.weight[1:].std().item())

    rest, inputs, embedding = stds(size="d128")
    assert rest == pytest.approx(0.02, rel=0.05) and embedding == pytest.approx(128 ** -0.5, rel=0.05)
    assert inputs > 0.05  # Xavier's: sqrt(2 / (128 + 3 x 128)) = 0.0625 for qkv, more for q and kv
    assert stds(size="d128", init_std=0.02) == pytest.approx((0.02, 0.02, 0.02), rel=0.05)
    assert stds(size="small", init_std=0.05) == pytest.approx((0.05, 0.05, 0.05), rel=0.05)
    for kw in ({"size": "tiny"}, {"size": "d128", "init_std": 0.0}):
        rest, inputs, embedding = stds(**kw)
        d = 32 if kw["size"] == "tiny" else 128
        assert embedding == pytest.approx(d ** -0.5, rel=0.05) and rest > 0.05  # Xavier: sqrt(2 / (in + out))


def test_a_training_micro_step_and_a_cached_decode_step_never_wait_for_the_device():
    """Forward + backward of the objective on a padded batch, and one cached decoder step, read nothing from the
    device (on a GPU each read stalls the host until the device's queue drains): the masks come from the ids on
    the device, and the token count stays a tensor."""
    from helpers import HostSyncs

    gen = torch.Generator().manual_seed(0)
    model = tiny_model(seed=0, vocab=V, layers=2, dropout=0.1).train()
    src_ids, tgt_in_ids = src_batch(gen, [5, 3, 7], V), tgt_in_batch(gen, [4, 6, 2], V)
    labels = torch.cat([tgt_in_ids[:, 1:], torch.zeros_like(tgt_in_ids[:, :1])], 1)
    with HostSyncs() as syncs:
        sums = Seq2SeqLoss(model, 0.1)(src_ids, tgt_in_ids, labels)
        sums.loss.backward()
    assert syncs.calls == [] and isinstance(sums.tokens, torch.Tensor)
    model.eval()
    with torch.no_grad():
        memory = model.encode(src_ids)
        cache = model.start_cache(memory, src_ids)
        model.decode(tgt_in_ids[:, :1], memory, src_ids, cache=cache)
        with HostSyncs() as syncs:
            model.decode(tgt_in_ids[:, 1:2], memory, src_ids, cache=cache)
    assert syncs.calls == []


@pytest.mark.slow
def test_compile_true_compiles_the_objective_whole_under_the_recompile_limit_and_matches_eager():
    """`compile: true` (training's make_objective) compiles Seq2SeqLoss with fullgraph=True: a simulated run of 21
    steps over seven bucketed batch shapes, two of them a lone sentence, with a validation pass (eval mode, no
    gradients) every 5 steps, stays under torch's recompile limit (a graph past it is a hard failure under
    fullgraph) and its training losses are the eager ones within 1e-4."""
    from helpers import in_fresh_interpreter

    in_fresh_interpreter("test_model", "compiled_objective_case")


def compiled_objective_case() -> None:
    """The body of the test above, run in a fresh interpreter."""
    from torch._dynamo.utils import counters

    from nmt.config import TrainConfig
    from nmt.training.loop import make_objective

    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 5, 6), (6, 9, 8), (1, 13, 12), (3, 17, 19), (8, 6, 5), (1, 3, 2), (5, 11, 10)]
    batches = []
    for B, S, T in shapes:
        src = src_batch(gen, torch.randint(2, S + 1, (B,), generator=gen).tolist(), V, width=S)
        tgt = tgt_in_batch(gen, torch.randint(2, T + 1, (B,), generator=gen).tolist(), V, width=T)
        batches.append((src, tgt, torch.cat([tgt[:, 1:], torch.zeros_like(tgt[:, :1])], 1)))

    def losses(compiled: bool) -> list[float]:
        model = tiny_model(seed=0, vocab=V, layers=2).train()
        objective = make_objective(model, TrainConfig(compile=compiled))
        assert isinstance(objective, Seq2SeqLoss)  # eager on the CPU: the fused loss (nmt.kernels)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for i in range(21):
            objective.train()
            sums = objective(*batches[i % len(batches)])
            (sums.loss / sums.tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(float(sums.loss.detach() / sums.tokens))
            if i % 5 == 4:  # validation: eval mode (no dropout), no autograd
                objective.eval()
                with torch.no_grad():
                    for batch in batches[:4]:
                        objective(*batch)
        return out

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = losses(False), losses(True)
    assert 1 <= counters["stats"]["unique_graphs"] < torch._dynamo.config.recompile_limit
    assert max(abs(a - b) for a, b in zip(eager, compiled)) < 1e-4


# --- the label-smoothed loss ---------------------------------------------------------------------------------------

LOSS_V = 11  # a small vocabulary for the loss's own logits


def logit_batch(seed: int, B: int = 5, T: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B,T,LOSS_V), labels (B,T)) with rows of 1..T real labels then padding."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, LOSS_V, generator=gen) * 3
    labels = torch.randint(1, LOSS_V, (B, T), generator=gen)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    labels[torch.arange(T)[None, :] >= lengths[:, None]] = PAD
    return logits, labels


@pytest.mark.parametrize("seed", range(3))
def test_no_smoothing_is_cross_entropy_over_real_tokens(seed):
    logits, labels = logit_batch(seed)
    loss, nll, n_tokens = label_smoothed_nll(logits, labels, PAD, smoothing=0.0)
    expected = F.cross_entropy(logits.view(-1, LOSS_V), labels.view(-1), ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(nll, expected, atol=1e-4, rtol=1e-6)
    assert n_tokens == int(labels.ne(PAD).sum())


def test_smoothing_matches_its_formula():
    """(1 - eps) * nll + eps * (mean over the vocabulary of -log p), summed over real tokens."""
    logits, labels = logit_batch(3)
    eps = 0.1
    loss, nll, _ = label_smoothed_nll(logits, labels, PAD, smoothing=eps)
    real = labels.ne(PAD)
    lp = torch.log_softmax(logits[real], dim=-1)
    expected = ((1 - eps) * -lp.gather(1, labels[real][:, None]).squeeze(1) - eps * lp.mean(-1)).sum()
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-6)
    assert not torch.isclose(loss, nll)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_padding_positions_do_not_contribute(smoothing):
    logits, labels = logit_batch(4)
    noisy = logits.clone()
    noisy[labels.eq(PAD)] = torch.randn_like(noisy[labels.eq(PAD)]) * 100
    assert labels.eq(PAD).any()
    a, b = label_smoothed_nll(logits, labels, PAD, smoothing), label_smoothed_nll(noisy, labels, PAD, smoothing)
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    assert a[2] == b[2]
    noisy.requires_grad_(True)
    label_smoothed_nll(noisy, labels, PAD, smoothing)[0].backward()
    assert noisy.grad[labels.eq(PAD)].abs().max() == 0


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("cut", [1, 2, 4])
def test_sums_over_parts_of_a_batch_add_up_to_the_whole(smoothing, cut):
    """Per-token normalisation happens once per optimizer step, so the loss sums and token counts of
    micro-batches must add up exactly to those of the whole logit_batch (also with different padded widths)."""
    logits, labels = logit_batch(5)
    whole = label_smoothed_nll(logits, labels, PAD, smoothing)
    # the second part trimmed to its own longest row, as its collator would pad it
    width = int(labels[cut:].ne(PAD).sum(1).max())
    parts = [label_smoothed_nll(logits[:cut], labels[:cut], PAD, smoothing),
             label_smoothed_nll(logits[cut:, :width], labels[cut:, :width], PAD, smoothing)]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole[0], atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(parts[0][1] + parts[1][1], whole[1], atol=1e-4, rtol=1e-6)
    assert parts[0][2] + parts[1][2] == whole[2]
    mean_of_means = (parts[0][0] / parts[0][2] + parts[1][0] / parts[1][2]) / 2
    assert not torch.isclose(mean_of_means, whole[0] / whole[2])  # why sums: means of parts would differ


def test_all_padding_gives_zero():
    loss, nll, n = label_smoothed_nll(torch.randn(2, 3, LOSS_V), torch.zeros(2, 3, dtype=torch.long), PAD, 0.1)
    assert float(loss) == 0.0 and float(nll) == 0.0 and n == 0


def test_bf16_logits_get_a_bf16_gradient_and_a_float32_loss():
    logits, labels = logit_batch(7)
    x = logits.bfloat16().requires_grad_(True)
    loss, nll, _ = label_smoothed_nll(x, labels, PAD, 0.1)
    assert loss.dtype == nll.dtype == torch.float32
    loss.backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


# --- the training objective ----------------------------------------------------------------------------------------

class LogitsOnly(torch.nn.Module):
    """nmt's model seen through the generic contract only: forward -> logits, nothing else."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.pad_id = model, 0

    def forward(self, src_ids, tgt_in_ids):
        return self.inner(src_ids, tgt_in_ids)


def objective_batch():
    src_ids = torch.tensor([[5, 6, 7, 3], [8, 9, 3, PAD]])
    tgt_in_ids = torch.tensor([[2, 5, 6], [2, 7, PAD]])
    labels = torch.tensor([[5, 6, 3], [7, 3, PAD]])
    return src_ids, tgt_in_ids, labels


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_objective_of_nmts_model_and_of_any_model_give_the_loss_of_the_logits(smoothing):
    model = tiny_model(seed=0, vocab=V, dropout=0.0)
    own = Seq2SeqLoss(model, smoothing)(*objective_batch())
    plain = Seq2SeqLoss(LogitsOnly(model), smoothing)(*objective_batch())
    src_ids, tgt_in_ids, labels = objective_batch()
    reference = label_smoothed_nll(model(src_ids, tgt_in_ids), labels, PAD, smoothing)
    assert isinstance(own, LossSums) and own.tokens == plain.tokens == reference[2] == 5
    for got in (own, plain):
        torch.testing.assert_close(got.loss, reference[0], atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(got.nll, reference[1], atol=1e-5, rtol=1e-6)
    assert own.loss.requires_grad and not own.nll.requires_grad


def test_pad_id_comes_from_the_model():
    model = LogitsOnly(tiny_model(seed=0, vocab=V))
    model.pad_id = 1
    assert Seq2SeqLoss(model).pad_id == 1
    assert Seq2SeqLoss(tiny_model(seed=0, vocab=V)).pad_id == 0  # from model.cfg.pad_id


def test_state_dict_is_the_plain_models(tmp_path):
    """Checkpoints written through the objective load into a bare model, and old ones into the objective."""
    model = tiny_model(seed=0, vocab=V)
    objective = Seq2SeqLoss(model)
    assert list(objective.state_dict()) == list(model.state_dict())
    save_model(objective, str(tmp_path / "new.safetensors"))  # as accelerate's save_state writes it
    bare = tiny_model(seed=1, vocab=V)
    assert load_model(bare, str(tmp_path / "new.safetensors")) == (set(), [])
    save_model(tiny_model(seed=2, vocab=V), str(tmp_path / "old.safetensors"))  # a model file written before
    restored = Seq2SeqLoss(tiny_model(seed=3, vocab=V))
    load_model(restored, str(tmp_path / "old.safetensors"))  # strict: missing or unexpected names raise
    for a, b in zip(tiny_model(seed=2, vocab=V).state_dict().values(), restored.model.state_dict().values()):
        assert torch.equal(a, b)
    assert unwrap_objective(restored) is restored.model and unwrap_objective(model) is model


def test_fsdp_keeps_the_prefix():
    objective = Seq2SeqLoss(tiny_model(seed=0, vocab=V), flat_state_dict=False)
    assert all(k.startswith("model.") for k in objective.state_dict())


def test_checkpointed_activations_give_the_same_gradients_from_less_saved_memory():
    """`checkpoint_activations`: training keeps each layer's input only and runs the layer again in the backward,
    its dropout replayed, so the gradients are those without it, and the tensors saved for the backward (what
    activation memory is) are fewer bytes; evaluation runs as before."""
    from nmt.model import Seq2SeqLoss

    gen = torch.Generator().manual_seed(4)
    src, tgt = src_batch(gen, [9, 5, 7], 30), tgt_in_batch(gen, [8, 6, 3], 30)
    labels = torch.cat([tgt[:, 1:], torch.zeros_like(tgt[:, :1])], 1)
    grads, saved = [], []
    for checkpointed in (False, True):
        model = tiny_model(seed=1, vocab=30, layers=2, dropout=0.1, checkpoint_activations=checkpointed).train()
        saved.append(0)

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[-1] += t.numel() * t.element_size()
            return t

        torch.manual_seed(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = Seq2SeqLoss(model, 0.1)(src, tgt, labels).loss
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    assert saved[1] < 0.6 * saved[0]
    model.eval()
    assert torch.equal(model(src, tgt), tiny_model(seed=1, vocab=30, layers=2, dropout=0.1).eval()(src, tgt))
