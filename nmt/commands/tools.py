"""`nmt export`, `nmt import`, `nmt plot`, `nmt average`, `nmt info` and `nmt serve`: the commands around a trained model."""

from __future__ import annotations

import argparse
import os

from nmt.commands.common import no_extra
from nmt.errors import NmtError


def cmd_plot(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.tools.plot import plot_runs

    no_extra(extra)
    print(f"wrote {plot_runs(args.run_dirs, args.output)}")
    return 0


def cmd_info(args: argparse.Namespace, extra: list[str]) -> int:
    import json

    from nmt.tools.info import describe, lines

    no_extra(extra)
    info = describe(args.model_dir)
    print(json.dumps(info, indent=2) if args.json else "\n".join(lines(info)))
    return 0


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    no_extra(extra)
    if args.to == "transformers":
        from nmt.interop import export_transformers

        if args.quantization:
            raise NmtError("--quantization is for --to ctranslate2; a transformers export is float32")
        out, arch = export_transformers(args.model_dir, args.out, force=args.force)
        print(f"wrote {out} ({arch}); load it with transformers.AutoModelForSeq2SeqLM.from_pretrained('{out}')")
        return 0
    from nmt.export import export_ctranslate2

    out = export_ctranslate2(args.model_dir, args.out, quantization=args.quantization, force=args.force)
    print(f"wrote {out} (CTranslate2, {args.quantization or 'float32'}); translate with: nmt translate --ct2 {out}")
    return 0


def cmd_import(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.interop import import_hf

    no_extra(extra)
    out = import_hf(args.hf_dir, args.out, src_lang=args.src_lang, tgt_lang=args.tgt_lang, force=args.force)
    print(f"wrote {out}; translate with: nmt translate {out}, fine-tune with: nmt train --init-from {out} ...")
    return 0


def cmd_average(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.average import average_run

    no_extra(extra)
    print(f"averaged model written to {average_run(args.run_dir, args.last, args.output, force=args.force)}")
    return 0


def cmd_merge_adapter(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.adapters import merge_adapter_dir

    no_extra(extra)
    out = merge_adapter_dir(args.model_dir, args.out, force=args.force)
    print(f"wrote {out} (the adapter merged into the weights); translate with: nmt translate {out}")
    return 0


def cmd_serve(args: argparse.Namespace, extra: list[str]) -> int:
    no_extra(extra)
    try:
        from nmt.tools.serve import serve
    except ModuleNotFoundError as e:
        if e.name not in ("starlette", "uvicorn"):
            raise
        raise NmtError(f"nmt serve needs {e.name}: pip install 'nmt[serve]' (starlette and uvicorn)") from None
    from nmt.tools.info import describe
    from nmt.tools.request_batcher import API_KEY_ENV, ServeConfig
    from nmt.translate import Translator

    values = {k: getattr(args, k) for k in vars(ServeConfig())}
    if values["api_key"] is None:  # an empty variable is no key; an empty --api-key is an error
        values["api_key"] = os.environ.get(API_KEY_ENV) or None
    cfg = ServeConfig(**values)
    serve(Translator.from_pretrained(args.model_dir, device=args.device), cfg, describe(args.model_dir))
    return 0
