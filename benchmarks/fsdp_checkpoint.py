"""FSDP2 checkpoints without a pickle, two ways, on a model of NLLB-600M's shape: sizes and save/load times.

Two gloo processes on this CPU (`nmt.launch`) build nmt's model at NLLB-600M's shape (d_model 1024, 16 heads,
12 + 12 layers, d_ff 4096, a shared vocabulary of 256,206: 615M parameters), shard it as accelerate_configs/
fsdp.yaml does (`fully_shard` on every Encoder/DecoderLayer and the root), take one AdamW step so the optimizer
holds its state, and then write and read the training state each way:

- gathered: what nmt writes (`nmt.training.fsdp`): every process takes part in gathering the full weights and
  AdamW state to the main process's CPU memory, which writes `model.safetensors` and `optimizer.safetensors`
  (`nmt.checkpoint.write_state`); resuming, every process reads both files and keeps its shard.
- sharded: `torch.distributed.checkpoint` with `HuggingFaceStorageWriter(save_distributed=True)` /
  `HuggingFaceStorageReader`: each process writes its own shards as safetensors (the sharding in their headers,
  no `.metadata` pickle) and reads back what it holds. Only tensors go this way: DCP writes any other value (the
  optimizer's param_groups) with torch.save into a shard file, a pickle under a .safetensors name (torch 2.13).

Each load is checked against the state saved (every shard equal). Prints one line per way: seconds to save,
seconds to load, bytes on disk, files, and the main process's peak resident memory.

    python benchmarks/fsdp_checkpoint.py [--scale 1.0] [--out DIR]

`--scale 0.25` shrinks d_model, d_ff and the vocabulary (a quick try). Needs about 16 GB of memory at scale 1.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _build(scale: float):
    import torch
    from torch.distributed.fsdp import fully_shard

    from nmt.config import ModelConfig
    from nmt.layers import DecoderLayer, EncoderLayer
    from nmt.model import Seq2SeqLoss, Seq2SeqTransformer

    vocab = int(256206 * scale)
    cfg = ModelConfig(d_model=int(1024 * scale) // 16 * 16, n_heads=16, n_encoder_layers=12, n_decoder_layers=12,
                      d_ff=int(4096 * scale), src_vocab_size=vocab, tgt_vocab_size=vocab, share_embeddings=True,
                      dropout=0.0)
    torch.manual_seed(0)
    objective = Seq2SeqLoss(Seq2SeqTransformer(cfg), flat_state_dict=False)
    for module in objective.modules():
        if isinstance(module, (EncoderLayer, DecoderLayer)):
            fully_shard(module)
    fully_shard(objective)
    optimizer = torch.optim.AdamW(objective.parameters(), lr=1e-4)
    ids = torch.randint(4, vocab, (2, 12))
    loss, _, _ = objective(ids, ids, ids)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return objective, optimizer


def _local(objective, optimizer) -> dict:
    """This process's shards of the weights and AdamW state, copied (what a load must give back)."""
    out = {f"w.{k}": v.to_local().clone() for k, v in objective.state_dict().items()}
    for i, p in enumerate(objective.parameters()):
        for name, v in optimizer.state[p].items():
            out[f"o.{i}.{name}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def _scramble(objective, optimizer) -> None:
    import torch

    with torch.no_grad():
        for p in objective.parameters():
            p.to_local().zero_()
            for v in optimizer.state[p].values():
                (v.to_local() if hasattr(v, "to_local") else v).zero_()


def _same(before: dict, after: dict) -> bool:
    import torch

    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _once(objective) -> dict:
    """The sharded model state dict with a tied weight under one name (safetensors refuses shared tensors)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from nmt.training.fsdp import _aliases

    aliases = _aliases(objective)
    return {k: v for k, v in get_model_state_dict(objective).items() if k not in aliases}


def _worker(scale: float, root: str, way: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from nmt import checkpoint as ckpt
    from nmt.training import fsdp

    rank, path = dist.get_rank(), Path(root, way)
    objective, optimizer = _build(scale)
    saved = _local(objective, optimizer)
    dist.barrier()
    start = time.perf_counter()
    if way == "gathered":
        weights = fsdp.full_weights(objective)
        state = fsdp.full_optimizer_state(objective, optimizer)
        if rank == 0:
            path.mkdir(parents=True)
            save_file(weights, str(path / ckpt.WEIGHTS_FILE))
            tensors, meta = ckpt._optimizer_record(state)
            save_file(tensors, str(path / ckpt.OPTIMIZER_FILE), metadata=meta)
        del weights, state
    else:
        # the optimizer's tensors only: DCP writes a non-tensor value (param_groups' settings) with torch.save
        # into the shard file, a pickle inside a .safetensors name; nmt would keep those as JSON
        dcp.save({"model": _once(objective), "optim": get_optimizer_state_dict(objective, optimizer)["state"]},
                 storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=True))
    dist.barrier()
    saving = time.perf_counter() - start
    _scramble(objective, optimizer)
    dist.barrier()
    start = time.perf_counter()
    if way == "gathered":
        fsdp.load_full_weights(objective, ckpt.read_weights(path))
        fsdp.load_full_optimizer_state(objective, optimizer, ckpt._read_optimizer(path / ckpt.OPTIMIZER_FILE))
    else:
        optim = get_optimizer_state_dict(objective, optimizer)
        state = {"model": _once(objective), "optim": optim["state"]}
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)))
        set_model_state_dict(objective, state["model"], options=StateDictOptions(strict=False))
        set_optimizer_state_dict(objective, optimizer, {"state": state["optim"], "param_groups": optim["param_groups"]})
    dist.barrier()
    loading = time.perf_counter() - start
    files = [p for p in path.rglob("*") if p.is_file()]
    row = {"save_s": round(saving, 2), "load_s": round(loading, 2), "exact": _same(saved, _local(objective, optimizer)),
           "bytes": sum(p.stat().st_size for p in files), "files": sorted(str(p.relative_to(path)) for p in files),
           "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    dist.barrier()
    Path(root, f"{way}{rank}.json").write_text(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="where the checkpoints go (default: a temporary folder)")
    args = parser.parse_args()
    from nmt.launch import launch

    root = Path(args.out or tempfile.mkdtemp(prefix="fsdp_ckpt_"))
    try:
        print(f"{os.uname().nodename}: 2 gloo processes, scale {args.scale}")
        for way in ("gathered", "sharded"):
            launch(_worker, (args.scale, str(root), way), num_processes=2)
            a, b = (json.loads(Path(root, f"{way}{r}.json").read_text()) for r in (0, 1))
            print(f"{way:9s} save {a['save_s']:7.2f} s  load {a['load_s']:7.2f} s  {a['bytes'] / 2**30:6.2f} GiB  "
                  f"exact {a['exact'] and b['exact']}  peak RSS rank0 {a['peak_rss_gib']} GiB rank1 "
                  f"{b['peak_rss_gib']} GiB  files {a['files']}")
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
