"""Builders shared by the model, search and DataParallel tests: tiny models, padded id batches, a CPU scatter."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

from nmt.config import DataConfig, ModelConfig, TokenizerConfig
from nmt.model import Seq2SeqTransformer

PAD, UNK, BOS, EOS = 0, 1, 2, 3
FIRST_WORD = 4  # ids below this are special
ATOL = 1e-5  # float32 logits are O(1): differences above this mean a real change, not rounding


def tiny_model(seed: int = 0, vocab: int = 24, tgt_vocab: int | None = None, d_model: int = 16, layers: int = 1,
               pre_norm: bool = True, share: bool = True, activation: str = "relu", dropout: float = 0.0,
               dtype: torch.dtype = torch.float32, **model: float) -> Seq2SeqTransformer:
    """A 1-2 layer model with d_model 16 in eval mode, initialised from `seed`."""
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny", src_vocab_size=vocab, tgt_vocab_size=tgt_vocab or vocab, d_model=d_model,
                             n_heads=2, n_encoder_layers=layers, n_decoder_layers=layers, d_ff=2 * d_model,
                             dropout=dropout, pre_norm=pre_norm, share_embeddings=share, activation=activation,
                             max_positions=128, **model)
    return Seq2SeqTransformer(cfg).to(dtype).eval()


def src_batch(gen: torch.Generator, lengths: list[int], vocab: int, width: int | None = None) -> torch.Tensor:
    """(B, S) source ids: `lengths[i] - 1` random words, then </s>, then padding up to `width`."""
    width = width or max(lengths)
    out = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, : n - 1] = torch.randint(FIRST_WORD, vocab, (n - 1,), generator=gen)
        out[i, n - 1] = EOS
    return out


def tgt_in_batch(gen: torch.Generator, lengths: list[int], vocab: int, width: int | None = None) -> torch.Tensor:
    """(B, T) decoder inputs: <s>, then `lengths[i] - 1` random words, then padding up to `width`."""
    width = width or max(lengths)
    out = torch.full((len(lengths), width), PAD, dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, 0] = BOS
        out[i, 1:n] = torch.randint(FIRST_WORD, vocab, (n - 1,), generator=gen)
    return out


def chunks_at(n: int, cuts: list[int]) -> list[slice]:
    """Row slices of a batch of n rows cut before each index in `cuts`."""
    bounds = [0, *sorted(set(cuts)), n]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def scatter_like(obj, n: int) -> list:
    """What nn.DataParallel's scatter does to call arguments, on CPU: every tensor is cut into up to n
    chunks along dim 0 with `torch.chunk` (as `torch.cuda.comm.scatter` does); tuples, lists and dicts
    are scattered element-wise; anything else is repeated. Returns one argument set per replica."""
    if isinstance(obj, torch.Tensor):
        return list(obj.chunk(n, dim=0))
    if isinstance(obj, (tuple, list)) and obj:
        parts = [scatter_like(x, n) for x in obj]
        return [type(obj)(p) for p in zip(*parts)]
    if isinstance(obj, dict) and obj:
        parts = [scatter_like(v, n) for v in obj.values()]
        return [dict(zip(obj.keys(), p)) for p in zip(*parts)]
    return [obj] * n


def run_scattered(module: torch.nn.Module, n: int, *args) -> torch.Tensor:
    """DataParallel's forward on n devices, simulated on CPU: scatter, run each replica, gather on dim 0."""
    return torch.cat([module(*replica_args) for replica_args in scatter_like(tuple(args), n)], dim=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads and lose a lot to contention on shared CPUs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def model_dir(path, seed: int = 0, vocab: int = 60, layers: int = 1, mirrored: bool = False):
    """A model directory (random tiny model + a BPE tokenizer trained on synthetic pairs), as train writes one;
    `mirrored`: the tokenizer is trained on the text spelled backwards (another tokenizer of the same size)."""
    from pathlib import Path

    from nmt.config import TokenizerConfig
    from nmt.synthetic import generate_pairs
    from nmt.tokenizer import PairTokenizer, train_tokenizer

    texts = [t[::-1] if mirrored else t for pair in generate_pairs(200, seed=7) for t in pair]
    tok = train_tokenizer(texts, TokenizerConfig(vocab_size=vocab, min_frequency=1))
    model = tiny_model(seed=seed, vocab=tok.get_vocab_size(), layers=layers)
    path = Path(path)
    model.save_pretrained(path)
    PairTokenizer(tok).save(path)
    return path


# --- transformers models built offline (nmt import / export) ---------------------------------------------------------


def randomize(hf) -> None:
    """Non-zero biases, LayerNorm affines and logits bias, so no tensor can be mapped wrongly unnoticed."""
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        if getattr(hf, "final_logits_bias", None) is not None:
            hf.final_logits_bias.normal_()


def marian_model(vocab: int = 60, d_model: int = 16, layers: int = 1, tied: bool = True, **kw):
    import transformers

    config = transformers.MarianConfig(
        vocab_size=vocab, decoder_vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model, max_position_embeddings=256, pad_token_id=vocab - 1, eos_token_id=0,
        decoder_start_token_id=vocab - 1, share_encoder_decoder_embeddings=tied, **kw)
    hf = transformers.MarianMTModel(config).eval()
    randomize(hf)
    return hf


def marian_directory(d, pairs, vocab_size: int = 80, d_model: int = 32):
    """A Marian directory as OPUS-MT ships one, in folder `d`: source.spm and target.spm (unigram SentencePiece
    models trained on the two sides of `pairs`), one joint vocab.json (</s> 0, <unk> 1, <pad> last), a random model."""
    import json

    import transformers

    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")  # transformers' converter reads the .spm files with it
    vocab: dict[str, int] = {}
    for side, i in (("source", 0), ("target", 1)):
        spm.SentencePieceTrainer.train(sentence_iterator=iter([p[i] for p in pairs]), model_prefix=str(d / side),
                                       vocab_size=vocab_size, model_type="unigram", eos_id=0, unk_id=1, bos_id=-1,
                                       pad_id=-1, minloglevel=2)
        (d / f"{side}.model").rename(d / f"{side}.spm")
        processor = spm.SentencePieceProcessor(model_file=str(d / f"{side}.spm"))
        for piece in map(processor.id_to_piece, range(processor.get_piece_size())):
            vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tok = transformers.MarianTokenizer(source_spm=str(d / "source.spm"), target_spm=str(d / "target.spm"),
                                       vocab=str(d / "vocab.json"))
    tok.save_pretrained(d)
    marian_model(vocab=len(vocab), d_model=d_model, activation_function="swish", scale_embedding=True).save_pretrained(d)
    return d


def hub_cache_entry(cache, repo_id: str, files_from, ref: str = "main", commit: str | None = None) -> str:
    """The files of folder `files_from` as huggingface_hub lays out a download in the cache folder `cache`:
    models--ORG--NAME/blobs/<sha256>, snapshots/<commit>/<name> (a relative link to its blob) and refs/<ref> naming
    the commit. Returns the commit (40 hex digits, from the files unless given)."""
    import hashlib
    import os
    from pathlib import Path

    files = sorted(p for p in Path(files_from).iterdir() if p.is_file())
    commit = commit or hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        blob = hashlib.sha256(p.read_bytes()).hexdigest()
        (repo / "blobs" / blob).write_bytes(p.read_bytes())
        (snapshot / p.name).symlink_to(os.path.join("..", "..", "blobs", blob))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return commit


class HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the calls that make the host wait for the device (on a GPU each stalls until its queue drains), seen
    on any device: reading a value (`bool`, `int`, `float`, `item`, `tolist`, `numpy`; a copy to the host from a
    device), data-dependent shapes
    (`nonzero`, `masked_select`, `unique`, boolean-mask indexing) and `torch.equal`. `calls` names each one."""

    READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "nonzero",
             "masked_select", "unique", "equal", "argwhere"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in self.READS:
            self.calls.append(name)
        elif name in ("__getitem__", "__setitem__") and _has_bool_index(args[1]):
            self.calls.append(f"{name}[bool]")
        elif name in ("cpu", "to") and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu" and (
                name == "cpu" or any(str(a) == "cpu" for a in [*args[1:], kwargs.get("device")])):
            self.calls.append("to(cpu)")  # a copy to the host (on a CPU there is none)
        return func(*args, **kwargs)


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def in_fresh_interpreter(module: str, function: str) -> None:
    """Run `function` of tests/`module`.py in a new Python process and fail if it fails. For torch.compile: its
    worker pools and threads would stay in this process, and the multi-process tests fork it later."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    path = os.pathsep.join(p for p in (str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", f"import {module}; {module}.{function}()"], cwd=tests,
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


class OffHost(torch.overrides.TorchFunctionMode):
    """Runs code on a device that is not the host, as a GPU would run it, and records what would stall or break
    there: `reads` (a value read on the host: `HostSyncs.READS`, each answered with `value` in the tensor's shape, or
    True for a truth value, so that the code goes on without values: on `meta` nothing has one), `copies` (a
    tensor built or copied from host memory onto the device: `torch.tensor(..., device=D)`, `.to(D)` of a host
    tensor; a blocking copy unless it is page-locked and non_blocking) and `mixes` (an op given tensors of two
    devices, beyond the 0-dim host scalars every device accepts; a GPU raises on them, `meta` not always)."""

    def __init__(self, device: str = "meta", value: int = 0):
        super().__init__()
        self.device, self.value = torch.device(device), value
        self.reads: list[str] = []
        self.copies: list[str] = []
        self.mixes: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in HostSyncs.READS and tensors and tensors[0].device == self.device:
            self.reads.append(name)
            return self._answer(name, tensors[0])
        devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            self.mixes.append(f"{name}: {sorted(map(str, devices))}")
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        if target is not None and torch.device(target).type == self.device.type and (
                name in ("tensor", "as_tensor") or (name == "to" and tensors and tensors[0].device.type == "cpu")):
            self.copies.append(name)
        return func(*args, **kwargs)

    def _answer(self, name: str, tensor: torch.Tensor):
        if name == "__bool__" or tensor.dtype == torch.bool:
            filled = torch.ones(tensor.shape, dtype=torch.bool)
        else:
            filled = torch.full(tensor.shape, self.value, dtype=tensor.dtype)
        return filled.tolist() if name == "tolist" else getattr(filled, name)() if name != "numpy" else filled.numpy()


def signal_tree(pid: int, sig: int) -> None:
    """`sig` to process `pid` and every process under it, the deepest first. A launcher's process group is not
    enough: torchrun starts each rank in a session of its own, and a rank outlives a launcher killed alone."""
    import os

    import psutil

    try:
        tree = psutil.Process(pid).children(recursive=True)[::-1] + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            pass


def run_launcher(cmd: list, cwd, env: dict, timeout: float):
    """`cmd` (a launcher: `accelerate launch`, torchrun) run to its end, as `subprocess.run(capture_output=True,
    text=True)` does. Still running after `timeout` s: every Python process under it prints its threads' stacks
    (faulthandler on SIGABRT), and the test fails with them. No process is left behind either way."""
    import signal
    import subprocess

    env = {**env, "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env) as proc:
        hung = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            signal_tree(proc.pid, signal.SIGABRT)
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                signal_tree(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
        finally:
            signal_tree(proc.pid, signal.SIGKILL)  # a rank that outlived its launcher
    if hung:
        pytest.fail(f"{' '.join(map(str, cmd[:4]))} ... still ran after {timeout} s; its processes were at:\n"
                    f"{err[-12000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@dataclasses.dataclass(frozen=True)
class Ran:
    """What a command left: its exit status and what it wrote (the fields of subprocess.CompletedProcess)."""

    returncode: int
    stdout: str
    stderr: str


def nmt_command(*args, stdin: str | bytes = b"", cwd=None) -> Ran:
    """`nmt ARGS` as a shell runs it (its entry point `nmt.cli.main` given the words; `stdin` as its input,
    stdout and stderr caught, argparse's exits as exit statuses), in this process: without a new interpreter's
    two seconds of imports. Log records of nmt go to the caught stderr as `nmt`'s console handler writes them."""
    import contextlib
    import io
    import logging
    import sys

    from nmt.cli import main
    from nmt.compat import reset_accelerate_state

    data = stdin.encode() if isinstance(stdin, str) else stdin
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("nmt")
    level = logger.level
    logger.addHandler(handler)
    saved_stdin = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                contextlib.chdir(cwd) if cwd else contextlib.nullcontext():
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse: --help, or a flag it refuses
                code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = saved_stdin
        logger.removeHandler(handler)
        logger.setLevel(level)
        reset_accelerate_state()  # what a training's Accelerator left in this process
    return Ran(code, out.getvalue(), err.getvalue())


# --- small corpora of the data tests (tests/test_data.py, test_readers, test_cleaning, test_tables, test_mixing) ---

PAIRS = [(f"the cat {i} sees a dog .", f"le chat {i} voit un chien .") for i in range(60)]


def cfg_for(tmp_path, train, **kw) -> DataConfig:
    return DataConfig(train=str(train), src_lang="en", tgt_lang="fr", cache_dir=str(tmp_path / "cache"), **kw)


TOK = TokenizerConfig(vocab_size=120, min_frequency=1)


def read_all(tmp_path, train, **kw):
    from nmt.data import prepare

    corpus = prepare(cfg_for(tmp_path, train, valid_ratio=0.1, test_ratio=0.1, **kw), TOK)
    return corpus


def texts(corpus) -> set:
    splits = [corpus.splits[name] for name in ("train", "valid", "test")]
    return {(s, t) for ds in splits for s, t in zip(ds["src"], ds["tgt"])}


# --- a user's bad inputs: the catalogue (test_bad_input) and the run's checks (test_validate) ---------------------

GOOD = [(f"sentence number {i} is here .", f"satz nummer {i} ist hier .") for i in range(40)]


def good_bytes(side: int) -> bytes:
    """GOOD's source (0) or target (1) side as a file's bytes."""
    return "".join(p[side] + "\n" for p in GOOD).encode()


def pair_files(tmp_path, src: bytes, tgt: bytes, name="train") -> Path:
    """`name`.en and `name`.de under tmp_path holding these bytes; returns the corpus prefix."""
    (tmp_path / f"{name}.en").write_bytes(src)
    (tmp_path / f"{name}.de").write_bytes(tgt)
    return tmp_path / name


def nmt_train(tmp_path, train_spec, capsys, *extra) -> tuple[int, str]:
    """`nmt train` of one step of a tiny model on `train_spec`: (exit code, stderr)."""
    from nmt.cli import main

    code = main(["train", "--data.train", str(train_spec), "--data.src_lang", "en", "--data.tgt_lang", "de",
                 "--data.cache_dir", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "run"),
                 "--model.preset", "tiny", "--tokenizer.vocab_size", "150", "--tokenizer.min_frequency", "1",
                 "--max_steps", "1", "--data.valid_ratio", "0.1", "--data.test_ratio", "0.1", *map(str, extra)])
    err = capsys.readouterr().err
    return code, err


def assert_error(code: int, err: str, *needles: str) -> None:
    """A user's error as the CLI says it: exit 2, one `error:` line holding each needle, no traceback."""
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# --- nmt serve as a client meets it (test_serve, test_libretranslate, test_serve_page, ...) --------------------------

ROOT = Path(__file__).parent.parent


class Server:
    """`nmt serve MODEL_DIR --port 0 FLAGS` in a subprocess; `port` is the one it printed."""

    def __init__(self, model_dir: Path | None, *flags: str, env: dict | None = None):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        model = [str(model_dir)] if model_dir else []  # None: the flags name the model (--ct2 DIR)
        self.proc = subprocess.Popen([sys.executable, "-m", "nmt.cli", "serve", *model, "--port", "0", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()  # blocks until it listens (or dies)
        assert "listening on http://127.0.0.1:" in line, (line, self.proc.stderr.read())
        self.port = int(line.split("127.0.0.1:")[1].split()[0])

    def call(self, method: str, path: str, body: dict | bytes | None = None, timeout: float = 120,
             headers: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body).encode() if isinstance(body, dict) else body
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def stop(self) -> tuple[int, str]:
        """SIGTERM; (exit code, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err


@contextlib.contextmanager
def serving(model_dir: Path, *flags: str, env: dict | None = None):
    server = Server(model_dir, *flags, env=env)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


def nmt_translate(model_dir: Path, lines: list[str], *flags: str) -> list[str]:
    ran = nmt_command("translate", model_dir, *flags, stdin="\n".join(lines) + "\n")
    assert ran.returncode == 0, ran.stderr
    return ran.stdout.splitlines()


def asgi_requests(app, *requests: tuple) -> list[tuple[int, dict]]:
    """(status, JSON answer) of each (method, path, body, headers) request, in turn, through the ASGI app in this
    process (one lifespan), as uvicorn hands them over; headers add to a loopback Host and a JSON body's."""
    import asyncio

    async def one(method: str, path: str, body: dict | None = None, headers: dict | None = None):
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
        headers = {"host": "127.0.0.1:8080", "content-type": "application/json", "content-length": str(len(data)),
                   **(headers or {})}
        sent, parts, hang = [False], [], asyncio.Event()

        async def receive():
            if sent[0]:
                await hang.wait()  # the client stays connected
            sent[0] = True
            return {"type": "http.request", "body": data, "more_body": False}

        async def send(message):
            parts.append(message)

        scope = {"type": "http", "method": method, "path": path, "query_string": b"", "root_path": "",
                 "headers": [(k.encode(), v.encode()) for k, v in headers.items()], "http_version": "1.1",
                 "scheme": "http", "server": ("127.0.0.1", 8080), "client": ("127.0.0.1", 1)}
        await app(scope, receive, send)
        status = next(m["status"] for m in parts if m["type"] == "http.response.start")
        return status, json.loads(b"".join(m.get("body", b"") for m in parts if m["type"] == "http.response.body"))

    async def run() -> list[tuple[int, dict]]:
        async with app.state.api.lifespan(app):
            return [await one(*request) for request in requests]

    return asyncio.run(run())


MULTIPART = {"Content-Type": "multipart/form-data; boundary=nmt-boundary"}


def multipart(fields: dict, file: bool = False) -> bytes:
    """A multipart/form-data body as a browser's FormData sends it (with `file`, also a file field)."""
    parts = [f'--nmt-boundary\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in fields.items()]
    if file:
        parts.append('--nmt-boundary\r\nContent-Disposition: form-data; name="f"; filename="a.txt"\r\n'
                     'Content-Type: text/plain\r\n\r\nx\r\n')
    return ("".join(parts) + "--nmt-boundary--\r\n").encode()


# --- trainings on several processes (test_parallel, test_training_fsdp) ----------------------------------------------

U32 = 2.0 ** -24  # float32's unit roundoff: one rounding changes a value by at most this fraction of it


def sum_error(n: int) -> float:
    """The relative error bound of a float32 sum of `n` terms of one sign (no cancellation): (n - 1) u, whatever the
    order the terms are added in."""
    return max(n - 1, 1) * U32


def possible_movement(cfg, steps: int) -> float:
    """The farthest `steps` AdamW steps of `cfg` can move a parameter: about lr_t a step whatever the gradient's
    size (m / sqrt(v) stays within 1 for betas with beta1^2 <= beta2), so the sum of the rates."""
    from nmt.training.loop import Schedule

    schedule = Schedule(cfg.optim)
    return sum(cfg.optim.lr * schedule(step) for step in range(steps))


def adamw_tolerance(cfg, steps: int) -> float:
    """How far the parameters of two trainings of `cfg` may part after `steps` AdamW steps when the runs differ only
    in the order of their float32 sums (other micro-batches, gloo's all-reduce, another CPU's matrix kernels).

    From the arithmetic, not from a machine. A gradient summed in another order changes its update by the
    gradient's relative rounding error: N u for N float32 summands (`sum_error`; 5e-5 for the 800 tokens of these
    tests' batches), more where the sum cancels (softmax ignores a shift of the scores, so part of the key
    projection's gradient is zero but for rounding, and AdamW scales that noise up to a visible step). We allow a
    hundredth of the possible movement (`possible_movement`), a relative error of 200 N u, plus one float32 ulp of a
    parameter near 1 per step (each step rounds the stored value). A training that differs in anything but rounding
    (a pair lost or seen twice, a gradient averaged over the wrong count) changes its updates by order 1."""
    return possible_movement(cfg, steps) / 100 + steps * 2 * U32


def run_training(cfg) -> None:  # top level: launched processes import it by name
    """`train(cfg)` in this process, and nothing of the run left holding a process group."""
    import gc

    from nmt.train import train

    train(cfg)
    # nothing of the run holds a process group once train() returns: one freed at the interpreter's exit can abort
    # the process there (gloo's threads cannot take the GIL; CI saw SIGABRT after a finished 2-process run)
    assert not any(isinstance(o, torch.nn.parallel.DistributedDataParallel) for o in gc.get_objects())


# --- the search on tiny float64 models (test_decoding, test_constraints) ------------------------------------------

SEARCH_VOCAB = V = 20  # the search tests' vocabulary (test_decoding, test_constraints)
SEARCH_PROPERTY = settings(max_examples=25, deadline=None)


@st.composite
def search_cases(draw, max_rows: int = 4):
    """(model, src_ids (B,S)): a random tiny float64 model (so near-ties cannot flip between two ways of
    computing the same logits) and a padded source batch."""
    model = tiny_model(seed=draw(st.integers(0, 2**16)), vocab=V, layers=draw(st.integers(1, 2)),
                       pre_norm=draw(st.booleans()), dtype=torch.float64)
    B = draw(st.integers(1, max_rows))
    lengths = draw(st.lists(st.integers(1, 6), min_size=B, max_size=B))
    return model, src_batch(torch.Generator().manual_seed(draw(st.integers(0, 2**16))), lengths, V)


def forced_logprob(model, src_row: torch.Tensor, tokens: list[int]) -> float:
    """Log-probability of `tokens` for source (1, S) by one teacher-forced forward pass."""
    tgt_in = torch.tensor([[BOS, *tokens[:-1]]])
    lp = torch.log_softmax(model(src_row, tgt_in)[0].float(), dim=-1)  # (T, V)
    return float(lp[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


# --- `nmt train` in a subprocess, watched (test_reliability, test_checkpoint, test_training_state) ------------------

def train_args(corpus_dir: Path, tmp: Path, run: str, steps: int) -> list[str]:
    """`nmt train` flags for a tiny run of `steps` steps into tmp/run, a checkpoint every 2 steps."""
    return ["--data.train", corpus_dir / "train", "--data.valid", corpus_dir / "valid", "--data.test",
            corpus_dir / "test", "--data.cache_dir", tmp / "cache", "--output_dir", tmp / run, "--model.preset",
            "tiny", "--model.dropout", "0.1", "--tokenizer.vocab_size", "300", "--max_tokens", "300",
            "--max_steps", steps, "--save_every", "2", "--eval_every", "1000", "--log_every", "1",
            "--eval_max_sentences", "4", "--optim.lr", "0.003", "--optim.warmup_steps", "10", "--keep_last", "2",
            "--average_last", "0"]  # nothing left to the budget plan: runs of other lengths train alike


def start(cmd: list, tmp: Path) -> subprocess.Popen:
    """`python CMD` in tmp, one thread, this checkout's nmt, its output piped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *map(str, cmd)], cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def nmt_cmd(*args) -> list:
    """`start`'s command for `nmt train ARGS`."""
    return ["-m", "nmt.cli", "train", *args]


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until the run's metrics.jsonl logs `step` (AssertionError if the process dies first or time runs out)."""
    metrics = run / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.is_file() and any(json.loads(x)["step"] >= step for x in metrics.read_text().splitlines() if x):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def losses(run: Path) -> dict[int, float]:
    """step -> training loss, as the run's metrics.jsonl logged them."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
