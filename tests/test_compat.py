"""Each private or text-matched third-party API that nmt.compat relies on still exists and behaves as it did
when checked (accelerate 1.15.0, torch 2.13.0, datasets 5.2.0). A failure here names what changed upstream."""

import inspect
import platform
import subprocess
import sys

import pytest
import torch

from nmt import compat


def test_accelerate_state_singletons_and_their_reset(fresh_accelerate_state):
    from accelerate.state import AcceleratorState, GradientState, PartialState

    for cls in (PartialState, AcceleratorState, GradientState):
        assert isinstance(cls._shared_state, dict), f"{cls.__name__}._shared_state is no longer a dict"
    assert "reset_partial_state" in inspect.signature(AcceleratorState._reset_state).parameters
    assert compat.accelerate_state_is_empty() and not compat.accelerate_state_exists()
    PartialState(cpu=True)
    GradientState()
    assert compat.accelerate_state_exists() and not compat.accelerate_state_is_empty()
    compat.reset_accelerate_state()
    assert compat.accelerate_state_is_empty() and not PartialState._shared_state and not GradientState._shared_state


def test_mkldnn_bf16_probe_answers_a_bool():
    assert hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported"), "torch dropped the private mkldnn bf16 probe"
    assert isinstance(compat.mkldnn_bf16_supported(), bool)


def test_mkldnn_packed_linear_computes_f_linear():
    assert compat.mkldnn_packed_linear_available(), "torch dropped mkldnn _reorder_linear_weight/_linear_pointwise"
    x, w, b = torch.randn(5, 64), torch.randn(48, 64), torch.randn(48)
    packed = compat.mkldnn_pack_linear_weight(w)
    assert torch.allclose(compat.mkldnn_packed_linear(x, packed, b, False), torch.nn.functional.linear(x, w, b), atol=1e-4)
    assert torch.allclose(compat.mkldnn_packed_linear(x, packed, b, True), torch.relu(x @ w.T + b), atol=1e-4)


def test_dataset_fingerprint_follows_the_content():
    import datasets

    a, b = datasets.Dataset.from_dict({"x": [1, 2]}), datasets.Dataset.from_dict({"x": [1, 3]})
    assert isinstance(compat.dataset_fingerprint(a), str) and compat.dataset_fingerprint(a)
    assert compat.dataset_fingerprint(a) != compat.dataset_fingerprint(b)
    assert compat.dataset_fingerprint(a) == compat.dataset_fingerprint(datasets.Dataset.from_dict({"x": [1, 2]}))


@pytest.mark.parametrize("kind, fsdp", [("FSDP", True), ("MULTI_GPU", False), ("NO", False)])
def test_is_fsdp_compares_the_enum(kind, fsdp):
    from accelerate.utils import DistributedType

    class FakeAccelerator:
        distributed_type = DistributedType[kind]

    assert compat.is_fsdp(FakeAccelerator()) is fsdp


def test_the_default_store_is_the_process_groups(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        store = compat.default_store()
        store.set("nmt/test", "done")
        assert store.get("nmt/test") == b"done"
    finally:
        dist.destroy_process_group()


def test_dataset_indices_are_the_rows_a_selection_reads():
    import datasets

    ds = datasets.Dataset.from_dict({"src": list("abcdef")})
    assert compat.dataset_indices(ds) is None
    picked = ds.select([4, 1, 1]).select([2, 0])
    assert compat.dataset_indices(picked).tolist() == [1, 4]
    assert ds.data.table.take(compat.dataset_indices(picked)).column("src").to_pylist() == picked["src"]


def test_a_generator_that_yields_nothing_is_recognised_by_datasets_text(tmp_path):
    import datasets

    def nothing():
        yield from ()

    with pytest.raises(Exception) as failed:  # with features given, as nmt's readers give them
        datasets.Dataset.from_generator(nothing, features=datasets.Features({"src": datasets.Value("string")}),
                                        cache_dir=str(tmp_path))
    assert compat.generator_yielded_nothing(failed.value), str(failed.value)
    assert not compat.generator_yielded_nothing(ValueError("another failure"))


def test_state_dict_mismatches_are_read_from_torchs_message():
    small, big = torch.nn.Linear(2, 3), torch.nn.Linear(2, 4)
    with pytest.raises(RuntimeError) as wrong_shape:
        big.load_state_dict(small.state_dict())
    assert compat.state_dict_mismatch(wrong_shape.value) == "weight is (3, 2) in the checkpoint but (4, 2) in the model"
    with pytest.raises(RuntimeError) as missing:
        small.load_state_dict({"weight": small.weight})
    assert compat.state_dict_mismatch(missing.value).startswith("missing weights ")
    assert compat.state_dict_mismatch(RuntimeError("out of memory")) is None


def test_tensor_version_counts_in_place_changes():
    t = torch.zeros(3)
    before = compat.tensor_version(t)
    t.add_(1)
    assert compat.tensor_version(t) == before + 1


def test_a_changed_private_api_is_one_error_naming_both_versions():
    from nmt.errors import NmtError

    with pytest.raises(NmtError, match=r"^torch \S+ changed thing, which nmt uses as torch 2\.13 has it \(Attrib"):
        with compat.private("torch", "thing", "2.13"):
            raise AttributeError("no thing")


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"), reason="glibc")
def test_release_free_memory_hands_the_heaps_free_pages_back():
    """Freed blocks scattered over the C heap stay resident until released (what varied training batches leave)."""
    script = """
import sys
from nmt.compat import release_free_memory
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024
blocks = [bytearray(64 * 1024) for _ in range(4000)]  # 250 MiB of heap blocks, each under the mmap threshold
kept = blocks[::50]  # a few stay alive, spread over the heap
del blocks
before = rss()
release_free_memory()
print(before, rss())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    assert before > 200 and after < before - 150, out


@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"), reason="glibc")
def test_bounded_onednn_caches_keep_few_primitives_of_many_shapes(monkeypatch):
    """bf16 linears of 300 row counts: with oneDNN's and ideep's default caches their compiled primitives stay
    resident; bounded, a small fraction of them. A capacity the user set is kept."""
    script = """
import sys, torch
from nmt.compat import bound_onednn_primitive_caches, release_free_memory
if sys.argv[1] == "bounded":
    bound_onednn_primitive_caches()
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024
linear = torch.nn.Linear(192, 768)
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    linear(torch.randn(4, 192))
    before = rss()
    for rows in range(8, 308):
        linear(torch.randn(rows, 192))
release_free_memory()
print(rss() - before)
"""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    grown = {kind: int(subprocess.run([sys.executable, "-c", script, kind], capture_output=True, text=True,
                                      check=True).stdout) for kind in ("default", "bounded")}
    if grown["default"] < 64:
        pytest.skip(f"oneDNN keeps little per bf16 primitive on this CPU ({grown})")
    assert grown["bounded"] < grown["default"] / 2, grown
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    compat.bound_onednn_primitive_caches()
    assert compat.os.environ["LRU_CACHE_CAPACITY"] == "512" and compat.os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    with pytest.raises(ValueError, match="at least one"):
        compat.bound_onednn_primitive_caches(0)
