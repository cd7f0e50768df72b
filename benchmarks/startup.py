"""Start-up time of the `nmt` command: the minimum wall time over fresh processes of `import nmt`, `nmt --help`,
`nmt train --help` and `nmt info MODEL_DIR`, and which heavy libraries each one loaded.

    python benchmarks/startup.py [--runs 10] [--model-dir DIR] [--venv .venv] [--venv /path/to/other/.venv]

Several --venv compare checkouts side by side (each venv's own `python` and `nmt`), e.g. before and after a
change. Without --model-dir a tiny model directory is written to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numpy", "accelerate", "datasets", "evaluate", "matplotlib", "tokenizers", "safetensors", "yaml")
CLI = ("import runpy, sys\nsys.argv = {argv!r}\ntry:\n    runpy.run_module('nmt.cli', run_name='__main__')\n"
       "except SystemExit:\n    pass")


def tiny_model_dir(out: Path) -> Path:
    """A 1+1-layer model and a tokenizer trained on the synthetic corpus: all `nmt info` reads."""
    import torch

    from nmt.config import ModelConfig, TokenizerConfig
    from nmt.model import Seq2SeqTransformer
    from nmt.synthetic import generate_pairs
    from nmt.tokenizer import train_pair_tokenizer

    pairs = generate_pairs(200, seed=1)
    tok = train_pair_tokenizer(lambda: (s for s, _ in pairs), lambda: (t for _, t in pairs), TokenizerConfig(vocab_size=100))
    torch.manual_seed(0)
    Seq2SeqTransformer(ModelConfig.preset("tiny", src_vocab_size=tok.src_vocab_size,
                                          tgt_vocab_size=tok.tgt_vocab_size)).save_pretrained(out)
    tok.save(out)
    return out


def fastest(cmd: list[str], runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True, cwd=tempfile.gettempdir())  # not this checkout's nmt/
        best = min(best, time.perf_counter() - start)
    return best


def loaded(python: str, code: str) -> list[str]:
    """The HEAVY libraries in sys.modules after `code` ran in a fresh interpreter."""
    report = (f"\nimport json, sys\nprint('LOADED', json.dumps(sorted({{m.split('.')[0] for m in sys.modules}}"
              f" & {set(HEAVY)!r})))")
    out = subprocess.run([python, "-c", code + report], capture_output=True, text=True, check=True,
                         cwd=tempfile.gettempdir()).stdout
    return json.loads(out.rsplit("LOADED ", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="fresh processes per command; the minimum is shown")
    parser.add_argument("--model-dir", help="a model directory for `nmt info` (default: a tiny one, made here)")
    parser.add_argument("--venv", action="append", help="a virtual environment with nmt installed (repeatable; "
                        "default: .venv of this checkout)")
    args = parser.parse_args()
    model_dir = args.model_dir or str(tiny_model_dir(Path(tempfile.mkdtemp(prefix="nmt-startup-"))))
    for venv in [str(Path(v).resolve()) for v in args.venv or [ROOT / ".venv"]]:
        python, nmt = str(Path(venv) / "bin" / "python"), str(Path(venv) / "bin" / "nmt")
        print(f"{venv}: minimum of {args.runs} runs (s), and the heavy libraries loaded")
        print(f"  {'python -c pass':22s} {fastest([python, '-c', 'pass'], args.runs):6.3f}")
        print(f"  {'import nmt':22s} {fastest([python, '-c', 'import nmt'], args.runs):6.3f}  "
              f"{loaded(python, 'import nmt')}")
        for argv in (["--help"], ["train", "--help"], ["info", model_dir]):
            name = "nmt " + " ".join("MODEL_DIR" if a == model_dir else a for a in argv)
            print(f"  {name:22s} {fastest([nmt, *argv], args.runs):6.3f}  {loaded(python, CLI.format(argv=['nmt', *argv]))}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
