"""Results do not depend on the number of processes: real 2-process gloo runs on CPU.

- DDP on 2 processes == 1 process with the same global batch == 1 process with accumulation.
- Every training pair once per epoch over both processes; validation identical on 1 and 2 processes.
- `accelerate launch` with the 2-process profile really trains on 2 ranks, saves, resumes, translates.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from nmt.compat import reset_accelerate_state
from nmt.launch import launch
from tests.conftest import multilingual_config, tiny_config
from tests.helpers import adamw_tolerance, possible_movement, run_launcher, run_training, sum_error

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).parent.parent


def final_params(cfg) -> dict[str, torch.Tensor]:
    return load_file(Path(cfg.output_dir) / "checkpoints" / f"step_{cfg.max_steps}" / "model.safetensors")


@pytest.mark.parametrize("multilingual", [False, True], ids=["one-pair", "two-pairs-temperature-5"])
def test_ddp_equals_one_process_equals_accumulation(corpus_dir, tmp_path, multilingual):
    common = dict(max_steps=4, save_every=4, eval_every=100, eval_max_sentences=4)
    g = 800  # global padded tokens per optimizer step in all three runs
    make = (lambda *a, **k: multilingual_config(*a, temperature=5.0, reverse_weight=0.5, **k)) if multilingual \
        else tiny_config  # two pairs: each epoch draws a new sample of each corpus
    one = make(corpus_dir, tmp_path / "one", max_tokens=g, **common)
    two = make(corpus_dir, tmp_path / "two", max_tokens=g // 2, **common)
    acc = make(corpus_dir, tmp_path / "acc", max_tokens=g // 2, accum_steps=2, **common)
    for cfg in (one, two, acc):
        cfg.model.dropout = 0.0
    run_training(one)
    reset_accelerate_state()
    run_training(acc)
    reset_accelerate_state()
    launch(run_training, (two,), num_processes=2)
    a, b, c = final_params(one), final_params(two), final_params(acc)
    worst = {"ddp": 0.0, "accum": 0.0}
    for name, p in a.items():
        worst["ddp"] = max(worst["ddp"], float((p - b[name]).abs().max()))
        worst["accum"] = max(worst["accum"], float((p - c[name]).abs().max()))
    tolerance = adamw_tolerance(one, one.max_steps)  # float32 rounding only, on any CPU
    print(f"largest parameter difference vs 1 process: {worst} (tolerance {tolerance:.2e})")
    assert worst["ddp"] <= tolerance and worst["accum"] <= tolerance
    initial = _initial(one)
    moved = max(float((a[name] - initial[name]).abs().max()) for name in a)
    assert moved > possible_movement(one, one.max_steps) / 2  # the steps really moved the parameters


def _initial(cfg) -> dict[str, torch.Tensor]:
    """The parameters before training: train() seeds, then builds the model from the same config."""
    from accelerate.utils import set_seed

    from nmt.checkpoint import load_model_config
    from nmt.model import Seq2SeqTransformer

    set_seed(cfg.seed)
    state = Seq2SeqTransformer(load_model_config(Path(cfg.output_dir) / "model")).state_dict()
    state.pop("src_embed.weight", None)
    return state


def record_epoch_and_validation(cfg, out: str) -> None:
    """Each process: its share of one epoch's indices, and validation metrics of a fixed model."""
    from accelerate import Accelerator

    from nmt.batching import TokenBatchSampler
    from nmt.data import prepare
    from nmt.model import Seq2SeqLoss, Seq2SeqTransformer
    from nmt.training.evaluation import validate
    from nmt.training.state import Run

    accelerator = Accelerator(cpu=True)
    corpus = prepare(cfg.data, cfg.tokenizer, accelerator.main_process_first)
    sampler = TokenBatchSampler(corpus.splits["train"]["cost"], cfg.max_tokens, accelerator.process_index,
                                accelerator.num_processes, 1, cfg.seed)
    seen = [i for batch in sampler for i in batch]
    torch.manual_seed(0)
    from dataclasses import replace
    model = Seq2SeqTransformer(replace(cfg.model, src_vocab_size=corpus.tokenizer.src_vocab_size,
                                       tgt_vocab_size=corpus.tokenizer.tgt_vocab_size))
    metrics = validate(Run(accelerator, cfg, corpus, Seq2SeqLoss(model)))
    everything = accelerator.gather_for_metrics([seen], use_gather_object=True)
    if accelerator.is_main_process:
        Path(out).write_text(json.dumps({"indices": everything, "metrics": metrics, "n": len(corpus.splits["train"]),
                                         "world": accelerator.num_processes}))


@pytest.mark.parametrize("multilingual", [False, True], ids=["one-pair", "two-pairs"])
def test_every_pair_once_and_same_validation(corpus_dir, tmp_path, multilingual):
    make = multilingual_config if multilingual else tiny_config  # two pairs: en->xx and xx->en, tagged
    cfg = make(corpus_dir, tmp_path, eval_max_sentences=None, max_tokens=300)
    launch(record_epoch_and_validation, (cfg, str(tmp_path / "two.json")), num_processes=2)
    record_epoch_and_validation(cfg, str(tmp_path / "one.json"))
    reset_accelerate_state()
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["world"] == 2 and one["world"] == 1
    flat = [i for part in two["indices"] for i in part]
    assert len(two["indices"]) == 2 and all(two["indices"])  # both ranks got work
    assert sorted(flat) == list(range(two["n"]))  # every pair exactly once, none dropped or repeated
    scores = [k for k in one["metrics"] if k.startswith(("bleu", "chrf")) and k != "bleu_signature"]
    assert len(scores) == (6 if multilingual else 2)  # per pair and their means
    assert all(one["metrics"][k] == two["metrics"][k] for k in scores)
    assert one["metrics"]["valid_nll"] == pytest.approx(two["metrics"]["valid_nll"], rel=1e-9)


def accelerate_launch(*args, cwd) -> subprocess.CompletedProcess:
    """`accelerate launch` of run.py on the 2-process profile; a collective that waits a minute fails the run, a
    launch that hangs fails the test with its processes' stacks (`run_launcher`)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "cpu_2proc.yaml"), str(ROOT / "run.py"), *map(str, args),
           "--dist_timeout_minutes", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return run_launcher(cmd, cwd, env, timeout=200)  # ~10 s each; two and a hung one's stacks fit pytest's 600 s


def test_accelerate_launch_two_processes_train_resume_translate(corpus_dir, tmp_path):
    args = ["--data.train", corpus_dir / "train", "--data.valid", corpus_dir / "valid", "--data.test",
            corpus_dir / "test", "--data.cache_dir", tmp_path / "cache", "--output_dir", tmp_path / "run",
            "--model.preset", "tiny", "--tokenizer.vocab_size", "300", "--max_tokens", "300",
            "--eval_every", "4", "--save_every", "4", "--eval_max_sentences", "8"]
    first = accelerate_launch(*args, "--max_steps", "4", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count("valid @ step 4:") == 1  # the main process reports; rank 1 stays quiet
    step4 = tmp_path / "run" / "checkpoints" / "step_4"
    assert json.loads((step4 / "nmt_checkpoint.json").read_text())["num_processes"] == 2
    assert (step4 / "random_states_1.safetensors").is_file()  # rank 1 existed and saved its RNG
    second = accelerate_launch(*args, "--max_steps", "8", "--resume", "latest", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [4, 8]  # resumed at step 4, not from 0
    summary = json.loads((tmp_path / "run" / "model" / "training.json").read_text())
    assert summary["num_processes"] == 2
    from nmt import Translator
    out = Translator.from_pretrained(tmp_path / "run" / "model").translate(["The dog sleeps."], beam_size=2)
    assert len(out) == 1 and isinstance(out[0], str)


def test_accelerate_notebook_launcher_trains_as_one_group(corpus_dir, tmp_path):
    """The notebook recipe of the README: accelerate.notebook_launcher(train, (cfg,), num_processes=2).

    On a CPU-only machine notebook_launcher's processes each believe they are rank 0 of 1 unless the
    Accelerator is told it runs on CPU; train() does that, so the two form one gloo group."""
    from accelerate import notebook_launcher

    cfg = tiny_config(corpus_dir, tmp_path, max_steps=4, eval_every=4, save_every=4)
    notebook_launcher(run_training, (cfg,), num_processes=2)
    summary = json.loads((Path(cfg.output_dir) / "model" / "training.json").read_text())
    assert summary["num_processes"] == 2
    assert (Path(cfg.output_dir) / "checkpoints" / "step_4" / "random_states_1.safetensors").is_file()


def test_bpe_dropout_and_alpha_tuning_on_two_processes_equal_one(corpus_dir, tmp_path):
    """BPE-dropout segments each pair the same way whichever process loads it, and the length penalty tuned
    on sharded validation decoding is the one a single process finds. The one process accumulates two micro-batches
    of the two processes' size, so the sums run over the same chunks (one chunk of twice the size differs by
    summation order, 7.5e-6 in 4 steps)."""
    from nmt.config import TokenizerConfig

    common = dict(max_steps=4, save_every=4, eval_every=100, eval_max_sentences=8, eval_beam=2,
                  tune_alpha=[0.0, 1.5], tokenizer=TokenizerConfig(vocab_size=300, dropout=0.1))
    one = tiny_config(corpus_dir, tmp_path / "one", max_tokens=400, accum_steps=2, **common)
    two = tiny_config(corpus_dir, tmp_path / "two", max_tokens=400, **common)
    for cfg in (one, two):
        cfg.model.dropout = 0.0
    run_training(one)
    reset_accelerate_state()
    launch(run_training, (two,), num_processes=2)
    a, b = final_params(one), final_params(two)
    assert max(float((p - b[name]).abs().max()) for name, p in a.items()) <= adamw_tolerance(one, one.max_steps)
    tuned = [json.loads((Path(cfg.output_dir) / "model" / "search.json").read_text()) for cfg in (one, two)]
    assert tuned[0]["alpha"] == tuned[1]["alpha"] and tuned[0]["bleu"] == pytest.approx(tuned[1]["bleu"])
    assert json.loads((Path(two.output_dir) / "model" / "training.json").read_text())["num_processes"] == 2


def _prepare_slowly(rank: int, cfg, port: int, wait: str, out: Path) -> None:  # one of 2 processes
    import datetime
    import functools
    import time

    from accelerate import PartialState

    import nmt.data
    from nmt.compat import reset_accelerate_state
    from nmt.launch import main_process_first

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", ACCELERATE_USE_CPU="1")
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    reset_accelerate_state()
    state = PartialState(cpu=True)  # joins the group above
    if rank == 0:  # a preparation far longer than the process group timeout
        read = nmt.data._read_splits
        nmt.data._read_splits = lambda *a: (time.sleep(8), read(*a))[1]
    first = functools.partial(main_process_first, local=False) if wait == "nmt" else state.main_process_first
    corpus = nmt.data.prepare(cfg.data, cfg.tokenizer, first)
    total = torch.tensor([len(corpus.splits["train"])])
    torch.distributed.all_reduce(total)  # a collective after the wait still works
    (out / f"rank{rank}").write_text(f"{int(total)} {corpus.stats.cache}")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("wait", ["nmt", "accelerate"])
def test_a_preparation_longer_than_the_process_group_timeout(corpus_dir, tmp_path, wait):
    """nmt's main_process_first waits outside collectives: the run survives a preparation of 8 s under a 3 s
    timeout. Accelerator.main_process_first (a barrier) does not: the control that the timeout is real."""
    from torch.multiprocessing import start_processes

    from nmt.launch import free_port
    from tests.conftest import tiny_config

    cfg = tiny_config(corpus_dir, tmp_path)
    args = (cfg, free_port(), wait, tmp_path)
    if wait == "accelerate":
        with pytest.raises(Exception, match="(?i)time"):
            start_processes(_prepare_slowly, args=args, nprocs=2, start_method="fork")
        return
    start_processes(_prepare_slowly, args=args, nprocs=2, start_method="fork")
    results = [(tmp_path / f"rank{r}").read_text().split() for r in range(2)]
    assert results[0] == results[1] and int(results[0][0]) == 2 * 600  # one cache, read by both


def _enter_times(rank: int, port: int, local: bool, out: Path) -> None:  # 2 "nodes" of 1 process each
    import time

    from accelerate import PartialState

    from nmt.compat import reset_accelerate_state
    from nmt.launch import main_process_first

    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", ACCELERATE_USE_CPU="1")
    reset_accelerate_state()
    PartialState(cpu=True)
    torch.distributed.barrier()
    start = time.monotonic()
    with main_process_first(local=local):
        (out / f"entered{rank}").write_text(str(time.monotonic() - start))
        time.sleep(3 if rank == 0 else 0)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("local", [True, False])
def test_node_local_cache_lets_each_node_prepare_and_a_shared_one_only_the_first(tmp_path, local):
    from torch.multiprocessing import start_processes

    from nmt.launch import free_port

    start_processes(_enter_times, args=(free_port(), local, tmp_path), nprocs=2, start_method="fork")
    waited = float((tmp_path / "entered1").read_text())
    assert waited < 2 if local else waited >= 3  # node 1's main: its own cache at once, or after node 0's


def _train_on_own_disk(cfg, elsewhere: str, out: str) -> None:
    """One process of a run whose rank 1 has an output_dir of its own, as a second node whose path is a local
    folder rather than the shared one: what each process is told goes to out/rank{rank}.txt."""
    import dataclasses

    from nmt.errors import NmtError
    from nmt.train import train

    rank = int(os.environ.get("RANK", 0))
    try:
        train(dataclasses.replace(cfg, output_dir=elsewhere) if rank == 1 else cfg)
        told = "trained"
    except NmtError as e:
        told = str(e)
    Path(out, f"rank{rank}.txt").write_text(told)


def test_a_process_that_cannot_see_the_run_directory_stops_every_process_before_training(corpus_dir, tmp_path):
    """Multi-node without a shared output_dir: each process checks that it reads what the main process writes
    there, and every process stops with one message naming the blind process and the fix."""
    cfg = tiny_config(corpus_dir, tmp_path / "shared", max_steps=2, dist_timeout_minutes=0.2)
    launch(_train_on_own_disk, (cfg, str(tmp_path / "node1" / "run"), str(tmp_path)), num_processes=2)
    told = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert [t.split(": ", 1)[1] for t in told] == [told[1].split(": ", 1)[1]] * 2  # each names its own path
    assert "process 1 on " in told[0] and "--output_dir on a file system all nodes share" in told[0]
    assert not (tmp_path / "shared" / "run" / "checkpoints").exists()


# --- no path one rank takes alone ends in a collective the others skip ----------------------------------------------

def _train_signalled(cfg, stop: tuple[int, int] | None, out: str) -> None:
    """One process of a run: with `stop` (rank, k) that rank's k-th model encode inside the training loop
    (a training step, the validation loss, or validation decoding) sends this process SIGTERM."""
    import signal

    from nmt.model import Seq2SeqTransformer
    from nmt.train import train

    rank = int(os.environ.get("RANK", 0))
    if stop is not None and stop[0] == rank:
        encode, calls = Seq2SeqTransformer.encode, [0]

        def counting(self, *args, **kwargs):
            looping = getattr(signal.getsignal(signal.SIGTERM), "__self__", None).__class__.__name__ == "StopSignals"
            calls[0] += looping
            if looping and calls[0] == stop[1]:
                os.kill(os.getpid(), signal.SIGTERM)
            return encode(self, *args, **kwargs)

        Seq2SeqTransformer.encode = counting
    result = train(cfg)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"stopped_by": result.stopped_by, "test": result.test,
                                                          "best": result.best}, default=str))


def _validated_alone(cfg, model_dir: Path) -> dict:
    """Validation metrics of `model_dir`'s model on one process, as the run computes them."""
    from accelerate import Accelerator

    from nmt.data import prepare
    from nmt.loading import open_model
    from nmt.model import Seq2SeqLoss
    from nmt.training.evaluation import validate
    from nmt.training.state import Run

    accelerator = Accelerator(cpu=True)
    corpus = prepare(cfg.data, cfg.tokenizer, accelerator.main_process_first)
    model = open_model(model_dir).model
    return validate(Run(accelerator, cfg, corpus, Seq2SeqLoss(model)))


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(world=st.sampled_from([2, 3, 4]), n_valid=st.sampled_from([1, 2, 3, 40]), n_test=st.sampled_from([1, 3, 40]),
       stop_rank=st.integers(0, 3), stop_at=st.integers(0, 6))
def test_every_run_ends_whatever_the_shares_and_signals(corpus_dir, world, n_valid, n_test, stop_rank, stop_at):
    """2-4 processes, validation and test sets from 1 pair (shares left empty) to several batches, and SIGTERM
    on one rank at a point of the loop: every run ends (a collective waits 30 s at most, so a hang fails; 6 s
    failed once on CI's slower machine, its message cut off by another test's hang), all
    ranks agree, and a run that finished scored validation and test as one process does."""
    import tempfile

    from nmt.metrics import corpus_scores
    from nmt.synthetic import generate_pairs
    from nmt.translate import Translator
    from tests.conftest import write_pairs

    stop = (stop_rank % world, stop_at) if stop_at else None  # that rank's stop_at-th encode in the loop
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pairs = generate_pairs(n_valid + n_test, seed=11)
        write_pairs(tmp / "valid", pairs[:n_valid])
        write_pairs(tmp / "test", pairs[n_valid:])
        cfg = tiny_config(corpus_dir, tmp, max_steps=3, eval_every=1, save_every=3, eval_max_sentences=None,
                          max_tokens=200, dist_timeout_minutes=0.5)  # 40 pairs: several batches
        cfg.data.valid, cfg.data.test = str(tmp / "valid"), str(tmp / "test")
        launch(_train_signalled, (cfg, stop, str(tmp)), num_processes=world)
        ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
        assert all(r == ranks[0] for r in ranks[1:]), ranks  # one outcome on every rank
        if ranks[0]["stopped_by"]:
            assert stop is not None and ranks[0]["stopped_by"] == "SIGTERM"
            return
        alone = _validated_alone(cfg, Path(cfg.output_dir) / "model")
        reset_accelerate_state()
        assert all(alone[k] == ranks[0]["best"][k] for k in ("bleu", "chrf"))
        # a mean of positive token losses summed in another order: at most a token a character, and an end each
        tokens = sum(len(b) + 1 for _, b in pairs[:n_valid])
        assert alone["valid_nll"] == pytest.approx(ranks[0]["best"]["valid_nll"], rel=sum_error(tokens))
        hyps = Translator.from_pretrained(Path(cfg.output_dir) / "model").translate(
            [a for a, _ in pairs[n_valid:]], beam_size=4)
        scores = corpus_scores(hyps, [b for _, b in pairs[n_valid:]])
        assert ranks[0]["test"] == {"bleu": scores["bleu"], "chrf": scores["chrf"], "pairs": n_test}


def _train_noting_what_is_compiled(cfg, out: str) -> None:
    """A run of `cfg` that notes, per process, the prepared objective's type, whether it is compiled, and whether
    the module inside it is."""
    import nmt.training.run as training_run
    from nmt.train import train

    prepare = training_run.prepare_objective

    def noting(accelerator, cfg, model):
        objective, optim = prepare(accelerator, cfg, model)
        inner = accelerator.unwrap_model(objective, keep_torch_compile=False)
        Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps(
            [type(objective).__name__, type(getattr(objective, "_orig_mod", None)).__name__,
             inner._compiled_call_impl is not None]))
        return objective, optim

    training_run.prepare_objective = noting
    train(cfg)


@pytest.mark.slow
def test_compile_true_on_two_processes_trains_and_validates_as_eager(corpus_dir, tmp_path):
    """`compile: true` on 2 processes: the prepared objective is compiled with DDP's wrapper inside the graph
    (so DDP's gradient all-reduce can overlap the backward), validation decodes through the compiled decoder
    step on uneven shares, and the weights after 3 steps are the eager run's."""
    runs = {}
    for compiled in (False, True):
        cfg = tiny_config(corpus_dir, tmp_path / str(compiled), max_steps=3, eval_every=1, save_every=3,
                          eval_max_sentences=5, compile=compiled, dist_timeout_minutes=1.0)
        cfg.model.dropout = 0.0
        launch(_train_noting_what_is_compiled, (cfg, str(tmp_path)), num_processes=2)
        runs[compiled] = final_params(cfg)
    noted = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert noted == [["OptimizedModule", "DistributedDataParallel", False]] * 2  # DDP compiled, not inside it
    worst = max(float((p - runs[True][name]).abs().max()) for name, p in runs[False].items())
    assert worst <= adamw_tolerance(cfg, cfg.max_steps)  # compiled kernels add in their own order


# --- out of memory on one process ---------------------------------------------------------------------------------

def _train_short_of_memory(cfg, on_rank1: dict, out: str) -> None:
    """One process of a run whose rank 1 runs out of memory where `on_rank1` says (tests.conftest.ShortOfMemory):
    what each process was told, and the sum of its final weights, go to out/rank{rank}.json."""
    from nmt.errors import NmtError
    from nmt.train import train
    from tests.conftest import ShortOfMemory

    rank = int(os.environ.get("RANK", 0))
    with ShortOfMemory(**(on_rank1 if rank == 1 else {})) as short:
        try:
            train(cfg)
            told = "trained"
        except NmtError as e:
            told = str(e)
        except RuntimeError as e:  # the others, once one process has left (gloo: its connection closed)
            told = type(e).__name__
    weights = sum(float(p.double().sum()) for p in short.model.parameters())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"told": told, "weights": weights}))


def test_a_micro_batch_out_of_memory_on_one_process_is_skipped_on_every_process(corpus_dir, tmp_path):
    """Rank 1 runs out of memory in a forward and at the start of a backward: each time every process skips the
    update (the weights stay the same on both), the step is counted, and the run goes on."""
    cfg = tiny_config(corpus_dir, tmp_path, max_steps=8, save_every=8, eval_every=8, log_every=8,
                      dist_timeout_minutes=0.2)
    launch(_train_short_of_memory, (cfg, {"forward": {3}, "backward": {5}}, str(tmp_path)), num_processes=2)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["told"] for r in ranks] == ["trained", "trained"]
    assert ranks[0]["weights"] == pytest.approx(ranks[1]["weights"], rel=1e-9)
    rows = [json.loads(x) for x in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert next(r for r in rows if "loss" in r)["oom_steps"] == 2
    adam = load_file(Path(cfg.output_dir) / "checkpoints" / "step_8" / "optimizer.safetensors")
    assert adam["state.0.step"].item() == 6


def test_out_of_memory_after_gradients_began_to_be_shared_ends_the_run_on_every_process(corpus_dir, tmp_path):
    """Rank 1 runs out of memory in a backward once DDP has begun all-reducing its gradients, which cannot be
    taken back: it stops with one line naming max_tokens, and the other process ends too (no wait in a
    collective until the timeout)."""
    cfg = tiny_config(corpus_dir, tmp_path, max_steps=6, dist_timeout_minutes=0.2)
    launch(_train_short_of_memory, (cfg, {"late": {2}}, str(tmp_path)), num_processes=2)
    told = [json.loads((tmp_path / f"rank{rank}.json").read_text())["told"] for rank in (0, 1)]
    assert "cannot rejoin them" in told[1] and "lower max_tokens" in told[1]
    assert told[0] != "trained"
