"""`nmt train` and `nmt check` (also `nmt train --dry-run`): config overrides from flags, then training or the
pre-flight report."""

from __future__ import annotations

import argparse

from nmt.commands.common import is_main
from nmt.errors import NmtError


def overrides_from_flags(extra: list[str]) -> list[str]:
    """`--model.d_model 256`, `--max-steps=10` or `model.d_model=256` -> ["model.d_model=256", ...]."""
    out, i = [], 0
    while i < len(extra):
        token = extra[i]
        if token.startswith("--"):
            key = token[2:]
            if "=" not in key:
                if i + 1 >= len(extra):
                    raise NmtError(f"flag {token} needs a value, e.g. {token} 100")
                key, i = f"{key}={extra[i + 1]}", i + 1
            name, _, value = key.partition("=")
            out.append(f"{name.replace('-', '_')}={value}")
        elif "=" in token:
            out.append(token)
        else:
            raise NmtError(f"unexpected argument {token!r}; config overrides look like --model.d_model 256 or key=value")
        i += 1
    return out


def cmd_train(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.config import load_config

    overrides = overrides_from_flags(extra)
    if args.resume:
        overrides.append(f"resume={args.resume}")
    if args.init_from:
        overrides.append(f"init_from={args.init_from}")
    overrides += [f"{key}=true" for key in ("overwrite", "resume_with_changes", "allow_data_change") if getattr(args, key)]
    cfg = load_config(args.config, overrides)
    if args.dry_run:
        return _preflight(cfg, args)
    from nmt.train import train

    result = train(cfg)
    if is_main():
        print(result.summary())
    return 0


def cmd_check(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.config import load_config

    overrides = overrides_from_flags(extra) + ([f"init_from={args.init_from}"] if args.init_from else [])
    return _preflight(load_config(args.config, overrides), args)


def _preflight(cfg, args: argparse.Namespace) -> int:
    """`nmt check` and `nmt train --dry-run`: print the report; exit 1 when it names a problem, else 0."""
    from nmt.tools.check import launch_processes, preflight

    if not is_main():
        return 0  # under `accelerate launch` the main process checks for all
    n, source = launch_processes(args.num_processes, args.profile)
    print(f"nmt check: {args.config or 'default config'} for {n} process{'es' if n > 1 else ''} (from {source})",
          flush=True)
    report = preflight(cfg, n, args.probe_steps)
    print("\n".join(report.lines()))
    return 1 if report.problems else 0
