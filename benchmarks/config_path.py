"""How far the run's config travels: `nmt.train` of a tiny model on the synthetic corpus, traced in each given
checkout side by side (issue 44's figure: the modules a config passes through, and the calls back up the import
order).

    python benchmarks/config_path.py [--repo .] [--repo /path/to/an/older/checkout] [--steps 4]

The trace (`sys.setprofile` over the whole `train` call) counts every call of an nmt function that is handed a
config (`TrainConfig`, or with `--sub-configs` also its data, model, optim and tokenizer parts) as an argument, or
an object that carries one as `.cfg` or `.resolved` (a `Run`, a `Setup`; properties are not evaluated), and the
modules those calls enter. Beside them, every call that goes back up the import order, whatever it carries: from
a module to one of a higher layer of that checkout's `tests/test_imports.py` (a callback, a lambda or a generator
handed to a lower layer, which then calls into the code that called it), counted and listed by call site. Each
checkout runs in a process of its own with its own `nmt` on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "@@config-path@@"


def trace(repo: Path, steps: int, sub_configs: bool) -> dict:
    """Train in this process with `repo`'s nmt and return what the config passed through."""
    sys.path[:0] = [str(repo), str(repo / "tests")]
    import test_imports  # the checkout's layers

    from nmt import config as nmt_config
    from nmt.synthetic import generate_pairs

    layer = test_imports.LAYER
    kinds = tuple(getattr(nmt_config, name) for name in
                  (["TrainConfig", "DataConfig", "ModelConfig", "OptimConfig", "TokenizerConfig"] if sub_configs
                   else ["TrainConfig"]))

    def carries(value) -> bool:
        if isinstance(value, kinds):
            return True
        fields = getattr(value, "__dict__", None)
        return isinstance(fields, dict) and any(isinstance(fields.get(k), kinds) for k in ("cfg", "resolved"))

    def module(frame) -> str | None:
        name = frame.f_globals.get("__name__", "")
        return name[4:] if name.startswith("nmt.") and name[4:] in layer else None

    calls, modules, up = 0, set(), []

    def profile(frame, event, arg):
        nonlocal calls
        if event != "call" or (entered := module(frame)) is None:
            return
        code = frame.f_code
        caller = module(frame.f_back) if frame.f_back else None
        if caller is not None and layer[entered] > layer[caller]:  # any call back up: a callback, a lambda
            up.append(f"{caller}.{frame.f_back.f_code.co_name} -> {entered}.{code.co_name}")
        if any(carries(frame.f_locals.get(n)) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]):
            calls += 1
            modules.add(entered)

    work = Path(tempfile.mkdtemp(prefix="config-path-"))
    pairs = generate_pairs(680, seed=7)
    for split, rows in (("train", pairs[:600]), ("valid", pairs[600:640]), ("test", pairs[640:])):
        for side, lang in ((0, "en"), (1, "xx")):
            (work / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in rows), encoding="utf-8")
    cfg = nmt_config.TrainConfig(
        data=nmt_config.DataConfig(train=str(work / "train"), valid=str(work / "valid"), test=str(work / "test"),
                                   cache_dir=str(work / "cache")),
        tokenizer=nmt_config.TokenizerConfig(vocab_size=300), model=nmt_config.ModelConfig.preset("tiny"),
        output_dir=str(work / "run"), max_tokens=400, max_steps=steps, eval_every=steps, save_every=steps,
        log_every=steps, eval_max_sentences=16)
    from nmt import train

    sys.setprofile(profile)
    try:
        train(cfg)
    finally:
        sys.setprofile(None)
    return {"modules": sorted(modules), "calls": calls, "up": len(up), "up_distinct": sorted(set(up))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", action="append", type=Path, help="a checkout to trace (repeatable; default: this one)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of the traced training")
    parser.add_argument("--sub-configs", action="store_true", help="count the data/model/optim/tokenizer parts too")
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)  # one checkout, in this process
    args = parser.parse_args()
    if args.trace:
        print(MARK + json.dumps(trace(args.trace.resolve(), args.steps, args.sub_configs)))
        return
    rows = []
    for repo in args.repo or [ROOT]:
        repo = repo.resolve()
        argv = [sys.executable, __file__, "--trace", str(repo), "--steps", str(args.steps)]
        env = {**os.environ, "PYTHONPATH": str(repo), "ACCELERATE_MIXED_PRECISION": "no"}
        proc = subprocess.run(argv + (["--sub-configs"] if args.sub_configs else []), capture_output=True, text=True,
                              env=env, cwd=repo)
        found = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
        if proc.returncode != 0 or not found:
            raise SystemExit(f"tracing {repo} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows.append((repo, json.loads(found[0][len(MARK):])))
    what = "a config (TrainConfig or a part of it)" if args.sub_configs else "the TrainConfig"
    print(f"calls handed {what}, or an object carrying it, while `train` runs {args.steps} steps:")
    print(f"{'checkout':<40} {'modules':>8} {'calls':>8} {'calls up':>9} {'sites up':>9}")
    for repo, found in rows:
        print(f"{str(repo)[-40:]:<40} {len(found['modules']):>8} {found['calls']:>8} {found['up']:>9} "
              f"{len(found['up_distinct']):>9}")
    for repo, found in rows:
        print(f"\n{repo}: {', '.join(found['modules'])}")
        for call in found["up_distinct"]:
            print(f"  up: {call}")


if __name__ == "__main__":
    main()
