"""Shared fixtures: a private Hugging Face cache, small parallel corpora on disk, a tiny training config."""

import os
import tempfile


def cores() -> int:
    """The cores this process may run on (a container's share, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# before anything imports datasets/evaluate: keep their caches out of the user's home
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="nmt-test-hf-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# under pytest-xdist each worker (and what it starts) gets its share of the cores, set before torch is imported:
# more threads than cores makes OpenMP's waiting threads spin against each other (a training 10 times slower)
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores() // workers)))
# torch.compile builds every kernel, as on CI's clean machine: none comes from an earlier run's cache on disk
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="nmt-test-inductor-"))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from nmt.config import DataConfig, ModelConfig, OptimConfig, TokenizerConfig, TrainConfig  # noqa: E402
from nmt.synthetic import generate_pairs  # noqa: E402


def write_pairs(prefix: Path, pairs: list[tuple[str, str]], src: str = "en", tgt: str = "xx") -> Path:
    Path(f"{prefix}.{src}").write_text("".join(a + "\n" for a, _ in pairs), encoding="utf-8")
    Path(f"{prefix}.{tgt}").write_text("".join(b + "\n" for _, b in pairs), encoding="utf-8")
    return prefix


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """train/valid/test .en/.xx files of the synthetic language: 600 / 40 / 40 pairs."""
    d = tmp_path_factory.mktemp("corpus")
    pairs = generate_pairs(680, seed=7)
    write_pairs(d / "train", pairs[:600])
    write_pairs(d / "valid", pairs[600:640])
    write_pairs(d / "test", pairs[640:])
    return d



@pytest.fixture(scope="session")
def served_model(corpus_dir, tmp_path_factory) -> Path:
    """A tiny model trained 12 steps on corpus_dir (en -> xx): what the server tests serve."""
    from nmt import train
    from nmt.compat import reset_accelerate_state

    reset_accelerate_state()
    result = train(tiny_config(corpus_dir, tmp_path_factory.mktemp("serve"), max_steps=12))
    reset_accelerate_state()
    return result.model_dir

@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> Path:
    """A model directory with a random tiny model: enough for commands that only read and write files."""
    from helpers import model_dir

    return model_dir(tmp_path_factory.mktemp("random") / "model")

def tiny_config(corpus_dir: Path, out: Path, **overrides) -> TrainConfig:
    """A config that trains a tiny model on `corpus_dir` in seconds."""
    base = dict(
        data=DataConfig(train=str(corpus_dir / "train"), valid=str(corpus_dir / "valid"),
                        test=str(corpus_dir / "test"), cache_dir=str(out / "cache")),
        tokenizer=TokenizerConfig(vocab_size=300),
        model=ModelConfig.preset("tiny"),
        optim=OptimConfig(lr=3e-3, warmup_steps=10, label_smoothing=0.1),
        output_dir=str(out / "run"), max_tokens=400, max_steps=12, eval_every=6, save_every=6,
        log_every=3, eval_max_sentences=16,
    )
    base.update(overrides)
    return TrainConfig(**base)


def both_directions(corpus_dir: Path, name: str) -> list:
    """data.train/valid/test items of `corpus_dir`'s split `name` read both ways: en->xx and xx->en."""
    return [str(corpus_dir / name), {"path": str(corpus_dir / name), "src_lang": "xx", "tgt_lang": "en"}]


def multilingual_config(corpus_dir: Path, out: Path, temperature: float = 1.0, reverse_weight: float = 1.0,
                        **overrides) -> TrainConfig:
    """`tiny_config` of a two-pair multilingual run: the corpus in both directions (en-xx, xx-en; the second
    weighted by `reverse_weight`)."""
    train = both_directions(corpus_dir, "train")
    train[1]["weight"] = reverse_weight
    data = DataConfig(train=train, valid=both_directions(corpus_dir, "valid"),
                      test=both_directions(corpus_dir, "test"), temperature=temperature, cache_dir=str(out / "cache"))
    return tiny_config(corpus_dir, out, data=data, **overrides)


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate's process-wide state (PartialState, AcceleratorState, GradientState) is forgotten before and
    after the test; the fixture's value forgets it mid-test (between two trainings)."""
    from nmt.compat import reset_accelerate_state

    reset_accelerate_state()
    yield reset_accelerate_state
    reset_accelerate_state()


@pytest.fixture
def tiny_cfg(corpus_dir, tmp_path) -> TrainConfig:
    return tiny_config(corpus_dir, tmp_path)


class ShortOfMemory:
    """Inside it, nmt's model runs out of memory (`torch.OutOfMemoryError`) on this process's training passes
    numbered (from 1) in `forward` (in the forward), `backward` (at the start of the backward, before any gradient
    is done) and `late` (in the backward, once the decoder's gradients are done); "all": every pass. `model` is
    the model it saw, for its weights afterwards."""

    def __init__(self, forward=(), backward=(), late=()):
        self.at = {"forward": forward, "backward": backward, "late": late}
        self.passes, self.model = 0, None

    def due(self, where: str) -> bool:
        chosen = self.at[where]
        return chosen == "all" or self.passes in chosen

    def __enter__(self):
        from nmt.model import Seq2SeqTransformer

        self.real = real = Seq2SeqTransformer.decode_hidden

        def decode_hidden(model, tgt_in_ids, memory, src_ids, cache=None):
            training = model.training and torch.is_grad_enabled()
            self.model, self.passes = model, self.passes + training
            if training and self.due("forward"):
                raise torch.OutOfMemoryError("CUDA out of memory (forward, raised by the test)")
            if training and self.due("late"):
                memory.register_hook(self.raise_in_backward)  # the encoder's output: reached after the decoder
            hidden = real(model, tgt_in_ids, memory, src_ids, cache)
            if training and self.due("backward"):
                hidden.register_hook(self.raise_in_backward)
            return hidden

        Seq2SeqTransformer.decode_hidden = decode_hidden
        return self

    @staticmethod
    def raise_in_backward(grad):
        raise torch.OutOfMemoryError("CUDA out of memory (backward, raised by the test)")

    def __exit__(self, *exc):
        from nmt.model import Seq2SeqTransformer

        Seq2SeqTransformer.decode_hidden = self.real


# --- the suite on every core (pytest-xdist) ----------------------------------------------------------------------


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, at most 8: each worker holds its own torch and fixtures."""
    return max(1, min(8, cores()))


@pytest.fixture(autouse=True)
def one_multiprocess_run_at_a_time(request, tmp_path_factory):
    """Under pytest-xdist (`--dist loadfile`: a test file runs on one worker, its module fixtures built once) the
    multi-process tests wait for each other, whichever worker runs them: each starts a process per core, and
    their process-group timeouts are kept short so that a hang fails in seconds."""
    if request.node.get_closest_marker("multiprocess") is None or "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    from filelock import FileLock

    with FileLock(tmp_path_factory.getbasetemp().parent / "multiprocess.lock"):  # the workers' common directory
        yield
