"""FSDP2 (nmt.training.fsdp): a run sharded over 2 CPU processes (weights, gradients and AdamW state) trains as DDP
and one process do, writes the files a DDP run writes (safetensors and JSON: no pickle), and resumes bit-exactly
after SIGKILL."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nmt.compat import reset_accelerate_state
from nmt.launch import launch
from tests.conftest import tiny_config
from tests.helpers import adamw_tolerance, run_training, sum_error

pytestmark = pytest.mark.multiprocess


def _fsdp2(make_accelerator):
    """nmt's `make_accelerator` under FSDP2 as accelerate_configs/fsdp.yaml asks for it (every Encoder/DecoderLayer
    and the root its own unit): accelerate shards only on GPUs, so on these CPU processes the plugin is set as
    accelerate's own state sets it there."""
    def made(cfg, precision):
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        accelerator = make_accelerator(cfg, precision)
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True,
            transformer_cls_names_to_wrap=["EncoderLayer", "DecoderLayer"], state_dict_type="SHARDED_STATE_DICT")
        accelerator.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        return accelerator
    return made


def _train_fsdp2(cfg, kill_at: int | None = None) -> None:
    """One process of an FSDP2 run; with `kill_at`, every process SIGKILLs itself once step `kill_at` is logged.
    How much of the model each process holds goes to sharded{rank}.json beside the run."""
    import signal

    from torch.distributed.tensor import DTensor

    from nmt.train import train
    from nmt.training import loop, run

    run.make_accelerator, prepare = _fsdp2(run.make_accelerator), run.prepare_objective

    def prepared(accelerator, cfg, model):
        objective, optim = prepare(accelerator, cfg, model)
        params = list(objective.parameters())
        held = {"sharded": all(isinstance(p, DTensor) for p in params), "numel": sum(p.numel() for p in params),
                "local": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)}
        Path(cfg.output_dir).parent.joinpath(f"sharded{accelerator.process_index}.json").write_text(json.dumps(held))
        return objective, optim

    run.prepare_objective = prepared
    if kill_at is not None:
        log_metrics = loop.log_metrics

        def logged(r, metrics):
            log_metrics(r, metrics)
            if r.state.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        loop.log_metrics = logged
    train(cfg)


def _losses(cfg) -> dict[int, float]:
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_fsdp2_trains_as_ddp_and_one_process_and_resumes_exactly_after_kill_9(corpus_dir, tmp_path):
    """20 steps of FSDP2 on 2 processes (weights, gradients and AdamW state sharded) equal DDP on 2 processes
    and one process accumulating 2 micro-batches; its checkpoints and final model are the files a DDP run writes
    (safetensors and JSON: no pickle), the tied embedding once; killed with SIGKILL after step 13 and resumed, it
    ends bit-identical to the uninterrupted run. Validation (loss and BLEU) runs on every process, each on its
    own plain copy of the model."""
    common = dict(max_steps=20, save_every=10, eval_every=10, log_every=1, eval_max_sentences=8,
                  dist_timeout_minutes=0.3)
    g = 800  # global padded tokens per optimizer step in every run
    fsdp = tiny_config(corpus_dir, tmp_path / "fsdp", max_tokens=g // 2, **common)
    killed = tiny_config(corpus_dir, tmp_path / "killed", max_tokens=g // 2, **common)
    ddp = tiny_config(corpus_dir, tmp_path / "ddp", max_tokens=g // 2, **common)
    acc = tiny_config(corpus_dir, tmp_path / "acc", max_tokens=g // 2, accum_steps=2, **common)
    for cfg in (fsdp, killed, ddp, acc):
        cfg.model.dropout = 0.0
    launch(_train_fsdp2, (fsdp,), num_processes=2)
    held = [json.loads((tmp_path / "fsdp" / f"sharded{rank}.json").read_text()) for rank in (0, 1)]
    assert all(h["sharded"] and h["local"] < 0.6 * h["numel"] for h in held)  # each process holds about half
    launch(run_training, (ddp,), num_processes=2)
    reset_accelerate_state()
    run_training(acc)
    reset_accelerate_state()
    a, b, c = _losses(fsdp), _losses(ddp), _losses(acc)
    assert sorted(a) == sorted(b) == sorted(c) == list(range(1, 21))
    # a logged loss is a mean of positive terms over the step's tokens (no cancellation), from parameters that
    # parted by rounding in the steps before
    assert all(a[s] == pytest.approx(b[s], rel=s * sum_error(g)) and a[s] == pytest.approx(c[s], rel=s * sum_error(g))
               for s in a)
    tolerance = adamw_tolerance(ddp, ddp.max_steps)
    for name in ("checkpoints/step_20", "model"):
        sharded, whole = Path(fsdp.output_dir, name), Path(ddp.output_dir, name)
        assert sorted(p.name for p in sharded.iterdir()) == sorted(p.name for p in whole.iterdir())
        assert all(p.suffix in (".safetensors", ".json") for p in sharded.iterdir())
        for file in (sharded / "model.safetensors", sharded / "optimizer.safetensors"):
            if not file.exists():
                continue  # (a model directory holds no optimizer)
            x, y = load_file(file), load_file(whole / file.name)
            assert x.keys() == y.keys(), file.name  # the tied embedding once; AdamW's state by parameter index
            for k in x:  # the weights within the tolerance; AdamW's moments (averages of the gradients and of their
                # squares) within the relative error allowed their updates, a hundredth of their largest entry
                bound = tolerance if file.name == "model.safetensors" else float(y[k].double().abs().max()) / 100
                assert float((x[k].double() - y[k].double()).abs().max()) <= bound, (file.name, k)
    rows = [json.loads(x) for x in (Path(fsdp.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "bleu" in r] == [10, 20]

    with pytest.raises(Exception):  # noqa: B017 (torch's launcher reports the killed processes)
        launch(_train_fsdp2, (killed, 13), num_processes=2)
    assert [p.name for p in (Path(killed.output_dir) / "checkpoints").iterdir() if p.name.startswith("step_")] \
        == ["step_10"]
    killed.resume = "latest"
    launch(_train_fsdp2, (killed,), num_processes=2)
    assert _losses(killed) == a  # steps 11-13 trained again, from the same state on the same batches
    for file in ("model.safetensors", "optimizer.safetensors"):
        x, y = (load_file(Path(cfg.output_dir, "checkpoints", "step_20", file)) for cfg in (fsdp, killed))
        assert all(torch.equal(x[k], y[k]) for k in x), file
