"""The `nmt` command: the parser of train, check, translate, evaluate, score, backtranslate, export, import, plot,
average, merge-adapter, serve and info, `main` (the dispatch; user errors print one line and exit with code 2),
then the handlers, by family: training (`nmt train`, `nmt check`: config overrides from flags, then training or
the pre-flight report), decoding (translate, evaluate, score, backtranslate: the commands that run a model over
text) and the commands around a trained model (export, import, plot, average, merge-adapter, serve, info).

Each handler imports its heavy modules inside the function, so that `nmt --help` stays cheap.
`accelerate launch run.py ...` is `nmt train ...` on as many processes as the profile says.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from nmt.errors import NmtError
from nmt.validate import Number, error_line, utf8_lines

__all__ = ["build_parser", "main", "main_entry", "overrides_from_flags"]
POSITIVE = Number(int, "[1, 1e9]")  # token budgets, counts of checkpoints
DEBUG_HELP = "on an error, print the Python traceback too (normally one line: exit 2 for bad input, 1 otherwise)"
FORCE_HELP = ("replace {} if it is a model directory or export nmt wrote (a run folder is moved aside to "
              "{}.replaced-N); a folder with other files is refused")
REVISION_HELP = "with a Hub id (ORG/NAME): its branch, tag or commit (default: main)"
CONFIG_KEYS = "{the config keys}"  # an epilog made only when help is printed (nmt.config.reference_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmt", description="Train and use neural machine translation models.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_check, _add_translate, _add_evaluate, _add_score, _add_backtranslate_parser,
                _add_export, _add_import, _add_plot, _add_average, _add_merge_adapter, _add_serve_parser, _add_info):
        add(sub)
    for p in sub.choices.values():  # also after the command (nmt train ... --debug); SUPPRESS keeps the global one
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


class _ConfigKeysHelp(argparse.RawDescriptionHelpFormatter):
    """`nmt train --help` / `nmt check --help`: after the flags, every config key with its type, default, allowed
    values and meaning, from the source of docs/configuration.md's table; computed only when the help is shown."""

    def add_text(self, text: str | None) -> None:
        if text == CONFIG_KEYS:
            from nmt.config import reference_text

            text = reference_text()
        super().add_text(text)


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model (any config key can be overridden: --model.d_model 256)",
                       epilog=CONFIG_KEYS, formatter_class=_ConfigKeysHelp)
    p.add_argument("--config", help="a YAML file from configs/ or your own")
    p.add_argument("--resume", help="'latest', 'auto' (latest if there is a checkpoint, else start fresh: what a "
                   "requeued job runs) or a checkpoint folder (output_dir/checkpoints/step_N)")
    p.add_argument("--overwrite", action="store_true", help="start fresh although output_dir holds a run: the old "
                   "run is moved aside to OUTPUT_DIR.old-<time>")
    p.add_argument("--resume-with-changes", action="store_true", help="resume although data, tokenizer, model or "
                   "optimizer settings differ from the checkpoint's (they are named)")
    p.add_argument("--allow-data-change", action="store_true", help="resume although the data files differ from "
                   "the ones the checkpoint was trained on (named); the run keeps its own tokenizer")
    p.add_argument("--init-from", metavar="DIR", help="fine-tune a trained model directory (output_dir/model) or a "
                   "Hub id (ORG/NAME, imported once): its architecture, tokenizer and weights, a fresh optimizer and "
                   "schedule")
    p.add_argument("--revision", help=REVISION_HELP.replace("a Hub id", "init_from a Hub id"))
    p.add_argument("--dry-run", action="store_true", help="check data, batches, time and memory (as nmt check); no training")
    _add_check_args(p)
    p.set_defaults(fn=cmd_train)


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="pre-flight check: data, lengths, vocabulary, batches, time, memory, problems",
                       epilog=CONFIG_KEYS, formatter_class=_ConfigKeysHelp)
    p.add_argument("--config", help="a YAML file from configs/ or your own (overrides as for train)")
    p.add_argument("--init-from", metavar="DIR", help="as for train; also reports how DIR's tokenizer fits the data")
    p.add_argument("--revision", help=REVISION_HELP.replace("a Hub id", "init_from a Hub id"))
    _add_check_args(p)
    p.set_defaults(fn=cmd_check)


def _add_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-processes", type=Number(int, "[1, 100000]"),
                   help="plan batches for this many processes (default: num_processes "
                   "of --profile, else WORLD_SIZE or ACCELERATE_NUM_PROCESSES from the environment, else 1)")
    p.add_argument("--profile", help="an accelerate config file (accelerate_configs/*.yaml) to read num_processes from")
    p.add_argument("--probe-steps", type=Number(int, "[0, 1e6]"), default=3,
                   help="timed training steps after one warm-up (0: no timing)")
    p.add_argument("--gpu-memory", type=Number(float, "(0, 1e5]"), metavar="GIB",
                   help="the memory of the GPU to train on, GiB (24, 40, 80, ...): the memory estimate is made for a "
                   "GPU, and what to change is named when it does not fit (default: the GPU here, if any)")


def _add_decoding(sub, name: str, help_: str) -> argparse.ArgumentParser:
    """The arguments `nmt translate` and `nmt evaluate` share: the model, the search, the device, --output."""
    p = sub.add_parser(name, help=help_)
    p.add_argument("model_dir", nargs="*", help="a model directory (output_dir/model of a run) or a Hub id "
                   "(ORG/NAME: a transformers model is imported once into ~/.cache/nmt); several: an ensemble (one "
                   "tokenizer); optional with --ct2")
    p.add_argument("--revision", help=REVISION_HELP)
    p.add_argument("--ct2", metavar="DIR", help="decode with CTranslate2 using a model made by nmt export "
                   "MODEL_DIR --to ctranslate2 DIR (needs pip install ctranslate2); MODEL_DIR beside it translates "
                   "the sentences that hold a --glossary term")
    _add_decoding_args(p)
    p.add_argument("--tgt-lang", help="a multilingual model's target language (one of its languages.json's)")
    p.add_argument("--src-lang", help="an imported M2M100/NLLB model's source language, a code or auto (each "
                   "sentence's told; default: the one it was imported with)")
    p.add_argument("--output", help="write here instead of stdout (evaluate: the hypotheses)")
    p.add_argument("--glossary", metavar="TSV", help="terms translated your way: source term TAB target term, one a "
                   "line; where a sentence holds a source term (whole words, case as given) its translation holds "
                   "the target term (constrained beam search; docs/serving.md)")
    _add_sampling_args(p)
    return p


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The search flags of translate, evaluate and backtranslate (search_kwargs reads them)."""
    p.add_argument("--beam", type=Number(int, "nmt.decoding:SearchConfig.beam_size"), default=4,
                   help="beam size (1: greedy)")
    p.add_argument("--alpha", type=Number(float, "nmt.decoding:SearchConfig.alpha"),
                   help="length penalty exponent (default: the model's tuned alpha, "
                   "search.json in MODEL_DIR when training had tune_alpha, else 0.6)")
    p.add_argument("--no-repeat-ngram-size", type=Number(int, "nmt.decoding:SearchConfig.no_repeat_ngram_size"),
                   default=0, help="no n-gram of N tokens twice in a translation (a cure for loops; default 0: off)")
    p.add_argument("--batch-tokens", type=POSITIVE, default=4096, help="source tokens per batch")
    _add_device_args(p)


def _add_device_args(p: argparse.ArgumentParser) -> None:
    """Where and in what precision a command decodes (`Translator.from_pretrained`'s device and dtype)."""
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default auto: the GPU when there is one)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="the weights' and the search's precision "
                   "(default fp32, TF32 products on a GPU; fp16: GPUs only; with --ct2: its compute type)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sampling", action="store_true", help="draw each translation from the model instead of beam "
                   "search (--nbest N: N samples per sentence)")
    p.add_argument("--topk", type=Number(int, "nmt.decoding:SamplingConfig.topk"), default=0,
                   help="with --sampling: draw among the k most likely tokens (0: all)")
    p.add_argument("--topp", type=Number(float, "nmt.decoding:SamplingConfig.topp"), default=1.0,
                   help="with --sampling: draw among the most likely tokens whose probabilities sum to p (nucleus)")
    p.add_argument("--temperature", type=Number(float, "nmt.decoding:SamplingConfig.temperature"), default=1.0,
                   help="with --sampling: < 1 sharper, > 1 flatter, 0 greedy")
    p.add_argument("--seed", type=Number(int, "nmt.decoding:SamplingConfig.seed"), default=0,
                   help="with --sampling: the same seed and input give the same output")


def _add_translate(sub) -> None:
    p = _add_decoding(sub, "translate", "translate stdin or --input to stdout or --output")
    p.add_argument("--input", help="read here instead of stdin")
    p.add_argument("--nbest", type=Number(int, "nmt.decoding:SearchConfig.nbest"), default=1,
                   help="hypotheses per sentence (tab-separated with scores; at most --beam)")
    p.add_argument("--scores", action="store_true", help="TSV: each translation, its mean log-probability per token "
                   "(</s> included) and a 0-1 confidence, exp of that mean (docs/serving.md)")
    p.add_argument("--guard", action="store_true", help="check each translation for loops and, where the model "
                   "names its languages, for another language than the target; decode a flagged one again (a wider "
                   "beam, no 3-gram twice for a loop); with --scores a 4th column says why one stays doubtful "
                   "(nmt.guard)")
    p.add_argument("--paragraphs", action="store_true", help="a document: each paragraph (lines up to a blank "
                   "line) split into sentences (nmt.sentences' rule), translated, and written as one line; blank "
                   "lines kept")
    p.add_argument("--format", choices=["text", "html", "xml"], default="text", help="html, xml: each line is "
                   "markup: its text is translated and its tags put back around the words they enclosed, placed by "
                   "the cross-attention (docs/serving.md); xml must be well formed, html is repaired as a browser "
                   "does; needs MODEL_DIR")
    p.add_argument("--chunk-size", type=POSITIVE, default=2000, help="lines translated and written at a time; with "
                   "--input and --output, what a killed run loses at most: run the command again to continue")
    p.add_argument("--attention", metavar="PNG", help="also draw the cross-attention alignment of the FIRST "
                   "input sentence into this image (.png/.svg/.pdf); needs MODEL_DIR, also with --ct2")
    p.add_argument("--attention-layer", type=Number(int, "[-1000, 999]"), default=-1,
                   help="decoder layer drawn by --attention, averaged over its heads (default: the last)")
    p.set_defaults(fn=cmd_translate)


def _add_evaluate(sub) -> None:
    p = _add_decoding(sub, "evaluate", "BLEU and chrF of a model on a test set")
    p.add_argument("--src", required=True, help="source sentences, one per line")
    p.add_argument("--ref", required=True, help="reference translations, one per line")
    p.set_defaults(fn=cmd_evaluate)


def _add_score(sub) -> None:
    p = sub.add_parser("score", help="log-probability of given translations (forced decoding), one line per pair")
    p.add_argument("model_dir", nargs="+", help="a model directory or a Hub id (as for translate); several: an "
                   "ensemble (one tokenizer)")
    p.add_argument("--revision", help=REVISION_HELP)
    p.add_argument("--src", required=True, help="source sentences, one per line")
    p.add_argument("--tgt", required=True, help="their translations to score, one per line")
    p.add_argument("--per-token", action="store_true", help="also print each target token's log-probability")
    p.add_argument("--tgt-lang", help="a multilingual model's target language (one of its languages.json's)")
    p.add_argument("--batch-tokens", type=POSITIVE, default=4096, help="padded tokens per batch")
    _add_device_args(p)
    p.add_argument("--output", help="write here instead of stdout")
    p.set_defaults(fn=cmd_score)


def _add_backtranslate_parser(sub) -> None:
    p = sub.add_parser("backtranslate", help="translate monolingual text into a synthetic parallel corpus "
                       "(source: the translations, target: the text) for training the reverse direction")
    p.add_argument("model_dir", help="a model trained in the reverse direction (the text's language -> the other)")
    p.add_argument("--input", required=True, help="monolingual text, one sentence per line")
    p.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.<src> (translations) and "
                   "PREFIX.<tgt> (the input lines): a data.train prefix")
    p.add_argument("--tag", nargs="?", const="<bt>", help="prepend this token to every synthetic source (tagged "
                   "back-translation; --tag alone: <bt>); keep it whole with tokenizer.reserved in the forward config")
    p.add_argument("--src-lang", help="suffix of the translations' file (default: the model's target language)")
    p.add_argument("--tgt-lang", help="suffix of the input's copy (default: the model's source language)")
    p.add_argument("--chunk-size", type=POSITIVE, default=2000, help="lines read, translated and written at a time")
    _add_decoding_args(p)
    _add_sampling_args(p)  # sampled back-translation (Edunov et al. 2018): --sampling --topk 10
    p.set_defaults(fn=cmd_backtranslate, ct2=None)


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a model directory for another runtime (CTranslate2, transformers)")
    p.add_argument("model_dir", help="a model directory (output_dir/model of a run)")
    p.add_argument("--to", required=True, choices=["ctranslate2", "transformers"], help="the target format")
    p.add_argument("out", help="the directory to write (must be empty or absent unless --force)")
    p.add_argument("--quantization", help="ctranslate2: weight type: int8, int8_float32, int16, float16, bfloat16, "
                   "... (default: float32)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP.format("OUT", "OUT"))
    p.set_defaults(fn=cmd_export)


def _add_import(sub) -> None:
    p = sub.add_parser("import", help="a transformers translation model (Marian/OPUS-MT, M2M100, NLLB) as an nmt "
                       "model directory (needs nmt[hf])")
    p.add_argument("hf_dir", help="a directory written by save_pretrained (the model and its tokenizer), or a Hub "
                   "id (ORG/NAME, e.g. Helsinki-NLP/opus-mt-en-de) read from the Hugging Face cache, downloaded "
                   "first unless HF_HUB_OFFLINE=1")
    p.add_argument("--revision", help=REVISION_HELP)
    p.add_argument("out", help="the model directory to write (must be empty or absent unless --force)")
    p.add_argument("--src-lang", help="M2M100/NLLB: the source language token (e.g. __en__ or eng_Latn)")
    p.add_argument("--tgt-lang", help="M2M100/NLLB: the target language token, forced as the first output token")
    p.add_argument("--force", action="store_true", help=FORCE_HELP.format("OUT", "OUT"))
    p.set_defaults(fn=cmd_import)


def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="draw loss, validation BLEU/chrF, learning rate and throughput of runs into a PNG")
    p.add_argument("run_dirs", nargs="+", help="run directories (output_dir of nmt train); several are overlaid")
    p.add_argument("-o", "--output", help="the image to write (.png, .svg, .pdf); default RUN_DIR/curves.png")
    p.set_defaults(fn=cmd_plot)


def _add_average(sub) -> None:
    p = sub.add_parser("average", help="average the weights of a run's last N checkpoints into a model directory")
    p.add_argument("run_dir", help="a run directory (output_dir of nmt train)")
    p.add_argument("--last", type=POSITIVE, default=5, help="how many of the newest checkpoints")
    p.add_argument("-o", "--output", required=True, help="the model directory to write (must be empty or absent "
                   "unless --force)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP.format("OUTPUT", "OUTPUT"))
    p.set_defaults(fn=cmd_average)


def _add_merge_adapter(sub) -> None:
    p = sub.add_parser("merge-adapter", help="merge a LoRA run's adapter into its base weights: a plain model "
                       "directory (needs nmt[lora])")
    p.add_argument("model_dir", help="the model/ (or best/) of a LoRA run (finetune.lora_r > 0), or its run folder")
    p.add_argument("out", help="the model directory to write (must be empty or absent unless --force)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP.format("OUT", "OUT"))
    p.set_defaults(fn=cmd_merge_adapter)


def _add_serve_parser(sub) -> None:
    from nmt.tools.request_batcher import ServeConfig  # no web framework: nmt serve's flags exist without the extra

    p = sub.add_parser("serve", help="an HTTP JSON API translating with a model directory (needs nmt[serve])")
    p.add_argument("model_dir", nargs="?", help="a model directory (output_dir/model of a run) or a Hub id (as for "
                   "translate); optional with --ct2")
    p.add_argument("--revision", help=REVISION_HELP)
    p.add_argument("--ct2", metavar="DIR", help="decode with CTranslate2 using a model made by nmt export MODEL_DIR "
                   "--to ctranslate2 DIR (plain text, n-best, scores, documents, markup and LibreTranslate's "
                   "routes); with MODEL_DIR too, sentences holding a glossary term are translated by that model")
    _add_device_args(p)
    ServeConfig.add_flags(p)
    p.set_defaults(fn=cmd_serve)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="architecture, size, vocabulary, training data and scores of a model directory")
    p.add_argument("model_dir", help="a model directory (output_dir/model or output_dir/best)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(fn=cmd_info)


# --- running a command --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("nmt").setLevel(logging.INFO if is_main() else logging.WARNING)
    args, extra = build_parser().parse_known_args(argv)
    if args.debug:
        logging.getLogger("nmt").setLevel(logging.DEBUG)
    try:
        return args.fn(args, extra)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError as e:
        if not _stdout_closed():  # another pipe broke (a socket, a child's): an error like any other
            return _report(e, args)
        # the reader of the output went away (`nmt score ... | head -1`): a normal end for a Unix filter, quiet, with
        # the status of one ended by SIGPIPE; what is still buffered goes nowhere instead of failing at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except Exception as e:  # noqa: BLE001 - the boundary: one line, exit 2 for the user's input, 1 for the rest
        return _report(e, args)


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has closed it (poll reports an error on its write end)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
    except (OSError, ValueError, AttributeError):  # no descriptor (a notebook's stream, a StringIO)
        return False
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _report(err: Exception, args: argparse.Namespace) -> int:
    """Print one line for `err` (and its traceback under --debug); an unexpected error is printed by every process,
    a user error by the main process only (all of them hit it)."""
    line, code = error_line(err)
    if code == 2 and not is_main():
        return code
    if args.debug:
        traceback.print_exception(err)
    rank = "" if is_main() else f" (rank {os.environ.get('RANK')})"
    print(f"nmt {args.command}: error{rank}: {line}", file=sys.stderr)
    return code


def main_entry() -> None:
    """The console script `nmt`."""
    sys.exit(main())


# --- training: nmt train, nmt check ------------------------------------------------------------------------------


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
    cfg = init_from_hub(load_config(args.config, overrides), args.revision)
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
    return _preflight(init_from_hub(load_config(args.config, overrides), args.revision), args)


def init_from_hub(cfg, revision: str | None):
    """`cfg` with an init_from Hub id replaced by the model directory it names (`nmt.interop.model_directory`)."""
    if not cfg.init_from:
        if revision is not None:
            raise NmtError(f"--revision {revision}: it names a revision of init_from's Hub id; give --init-from ORG/NAME")
        return cfg
    import dataclasses

    from nmt.interop import model_directory

    directory = str(model_directory(cfg.init_from, revision, "init_from"))
    return cfg if directory == cfg.init_from else dataclasses.replace(cfg, init_from=directory)


def _preflight(cfg, args: argparse.Namespace) -> int:
    """`nmt check` and `nmt train --dry-run`: print the report; exit 1 when it names a problem, else 0."""
    from nmt.tools.check import launch_processes, preflight

    if not is_main():
        return 0  # under `accelerate launch` the main process checks for all
    n, source = launch_processes(args.num_processes, args.profile)
    print(f"nmt check: {args.config or 'default config'} for {n} process{'es' if n > 1 else ''} (from {source})",
          flush=True)
    report = preflight(cfg, n, args.probe_steps, gpu_memory=args.gpu_memory and int(args.gpu_memory * 2**30))
    print("\n".join(report.lines()))
    return 1 if report.problems else 0


# --- decoding: nmt translate, evaluate, score, backtranslate -------------------------------------------------------


def search_kwargs(args: argparse.Namespace) -> dict:
    """--alpha only when given: otherwise the model directory's tuned alpha (search.json), else 0.6.
    --sampling (with --topk/--topp/--temperature/--seed) draws translations instead of beam search."""
    alpha = {} if args.alpha is None else {"alpha": args.alpha}
    sampling = None
    if args.sampling:
        from nmt.decoding import SamplingConfig

        sampling = SamplingConfig(topk=args.topk, topp=args.topp, temperature=args.temperature, seed=args.seed)
    return dict(beam_size=args.beam, batch_tokens=args.batch_tokens, sampling=sampling,
                no_repeat_ngram_size=args.no_repeat_ngram_size, **alpha)


def _glossary(args: argparse.Namespace) -> dict:
    """{"glossary": ...} read from --glossary (NmtError names its line), else {}."""
    if not args.glossary:
        return {}
    from nmt.constraints import Glossary

    return {"glossary": Glossary.read(args.glossary)}


def _translator(args: argparse.Namespace):
    """The PyTorch model of MODEL_DIR (several: an ensemble), or with --ct2 DIR the CTranslate2 export."""
    from nmt.translate import Translator

    if args.ct2:
        translator = _ct2_translator(args)
        if args.model_dir and getattr(args, "glossary", None):  # the sentences with a term: the PyTorch model's
            translator.with_pytorch(Translator.from_pretrained(args.model_dir[0], device=args.device,
                                                               dtype=args.dtype or "fp32"))
        return translator
    if not args.model_dir:
        raise NmtError("give a model directory (MODEL_DIR) or an exported CTranslate2 model (--ct2 DIR)")
    dirs = args.model_dir
    return Translator.from_pretrained(dirs if len(dirs) > 1 else dirs[0], device=args.device, dtype=args.dtype or "fp32")


def _ct2_translator(args: argparse.Namespace):
    """--ct2 DIR decoded by CTranslate2, --dtype as its compute type (default: as exported)."""
    from nmt.translate import Translator

    compute_type = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(args.dtype, "default")
    return Translator.from_ctranslate2(args.ct2, device=args.device, compute_type=compute_type)


@dataclass
class _Seen:
    """What came in: the first input sentence (for --attention), how many lines, and which could not be translated."""

    first: str | None = None
    lines: int = 0
    failed: list[int] = field(default_factory=list)

    def see(self, line: str) -> None:
        if self.first is None:
            self.first = line.rstrip("\r\n")
        self.lines += 1


def cmd_translate(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.textfiles import refuse_overwrite

    no_extra(extra)
    if args.attention and not args.model_dir:
        raise NmtError("--attention needs MODEL_DIR (the PyTorch model): CTranslate2 does not expose the weights")
    source = ("--input", args.input) if args.input else ("stdin", stdin_fd())
    resolve_models(args)
    refuse_overwrite([("--output", args.output), ("--attention", args.attention)], [source, *model_inputs(args)])
    translator = _translator(args)
    seen = _Seen()
    _translate_stream(translator, seen, args)
    if args.attention:
        _draw_first(translator, seen, args)
    if seen.failed:
        print(f"nmt translate: error: {len(seen.failed)} of {seen.lines} input lines could not be translated (line "
              f"{numbers(seen.failed)}); their output lines are empty", file=sys.stderr)
        return 1
    return 0


def _translate_stream(translator, seen: _Seen, args: argparse.Namespace) -> None:
    """--input (or stdin) to --output (or stdout, written all or nothing); a terminal or pipe is answered line by
    line; a file to a file is written in commits a killed run continues (`_translate_file`)."""
    from nmt.textfiles import atomic_file

    # bytes, decoded line by line: a line that is not UTF-8 is named by its number
    source = open(args.input, "rb") if args.input else getattr(sys.stdin, "buffer", sys.stdin)
    interactive = not _is_regular_file(source)  # a terminal or a pipe (or FIFO): answer line by line
    try:
        if args.input and args.output and not interactive and not (
                os.path.exists(args.output) and not os.path.isfile(args.output)):
            return _translate_file(translator, source, seen, args)
        with atomic_file(args.output) if args.output else nullcontext(sys.stdout) as sink:
            for line in _translations(translator, source, interactive, seen, args):
                sink.write(line + "\n")
                if interactive:
                    sink.flush()
    finally:
        if args.input:
            source.close()


def _translate_file(translator, source, seen: _Seen, args: argparse.Namespace) -> None:
    """--input FILE --output FILE: the output written --chunk-size lines at a time through a partial file and a
    record of how far it got (`nmt.textfiles.ResumableOutput`), so that a killed run loses at most the chunk in
    flight and the same command run again continues where it stopped; the input (its sha256), the model's files
    and every flag are the fingerprint that must match. With --paragraphs an output line is a paragraph's (or a
    blank line's), and a resumed run skips the paragraphs already written. On a terminal, stderr shows the lines
    done, lines a second and the time left."""
    import time

    from nmt.textfiles import ResumableOutput, count_lines, file_digest

    settings = {k: v for k, v in sorted(vars(args).items()) if k not in ("fn", "attention", "attention_layer")}
    models = [d for d in (args.model_dir or []) + ([args.ct2] if args.ct2 else []) if d]
    files = {str(p): [p.stat().st_size, p.stat().st_mtime_ns] for d in models for p in sorted(Path(d).rglob("*"))
             if p.is_file()}
    out = ResumableOutput(args.output, {"input": file_digest(args.input), "model": files,
                                        "settings": json.loads(json.dumps(settings, default=str))})
    done, said = out.start()
    if said:
        print(f"nmt translate: {said}", file=sys.stderr, flush=True)
    total = _paragraph_count(Path(args.input)) if args.paragraphs else count_lines(Path(args.input))
    show = sys.stderr.isatty()
    start, lines = time.perf_counter(), done

    def remaining():
        for n, line in enumerate(utf8_lines(source, args.input), 1):
            seen.see(line)
            if n > done:
                yield line

    if args.paragraphs:
        translations = _paragraph_translations(translator, source, False, seen, args, _translate_kwargs(args), done)
    else:
        translations = translator.translate_stream(remaining(), chunk_size=args.chunk_size, failed=seen.failed,
                                                   first_line=done + 1, **_translate_kwargs(args))
    try:
        for line in translations:
            out.write(line + "\n")
            lines += 1
            if (lines - done) % args.chunk_size == 0 or lines == total:
                out.commit(lines)
                if show:
                    rate = (lines - done) / max(time.perf_counter() - start, 1e-9)
                    left = (total - lines) / rate if rate else 0
                    print(f"\r{lines:,}/{total:,} lines, {rate:,.1f} lines/s, {left / 60:.1f} min left ",
                          end="", file=sys.stderr, flush=True)
        if show:
            print(file=sys.stderr)
        out.finish()
    finally:
        out.close()


def _translate_kwargs(args: argparse.Namespace) -> dict:
    return dict(nbest=args.nbest, tgt_lang=args.tgt_lang, src_lang=args.src_lang, scores=args.scores,
                format=args.format, guard=args.guard, **search_kwargs(args), **_glossary(args))


def _translations(translator, source, interactive: bool, seen: _Seen, args: argparse.Namespace):
    """The output lines: files batch by length; a terminal or pipe is translated as its lines arrive."""
    from nmt.translate import arrived_lines

    kwargs = _translate_kwargs(args)
    if args.format != "text" and getattr(args, "paragraphs", False):
        raise NmtError(f"--paragraphs splits plain text into sentences, which would cut tags apart: give --format "
                       f"{args.format} one sentence of markup a line, or --paragraphs with --format text")
    if args.paragraphs:
        return _paragraph_translations(translator, source, interactive, seen, args, kwargs)
    if interactive:
        def groups():
            for group in arrived_lines(source, args.input or "stdin"):
                seen.see(group[0])
                seen.lines += len(group) - 1
                yield group
        return translator.translate_batches(groups(), seen.failed, **kwargs)

    def lines():
        for line in utf8_lines(source, args.input or "stdin"):
            seen.see(line)
            yield line
    return translator.translate_stream(lines(), chunk_size=args.chunk_size, failed=seen.failed, **kwargs)


def _paragraph_count(path: Path) -> int:
    """The output lines --paragraphs writes for the file at `path`: one a paragraph, one a blank line."""
    count, inside = 0, False
    with open(path, "rb") as f:
        for line in f:
            filled = bool(line.decode("utf-8", "replace").strip())  # blank as `nmt.sentences.paragraphs` tells it
            count += not (filled and inside)
            inside = filled
    return count


def _paragraph_translations(translator, source, interactive: bool, seen: _Seen, args: argparse.Namespace,
                            kwargs: dict, skip: int = 0):
    """--paragraphs: each paragraph of the input (a run of non-blank lines) becomes one output line, its sentences
    (`nmt.sentences`) translated in batches of about --chunk-size (a terminal or pipe: each paragraph as it is complete)
    and joined by a space; each blank line stays a blank line; the first `skip` of those (a resumed run's) are
    read and not translated. A sentence that cannot be translated is reported by its paragraph's first line, and
    its translation left out."""
    import itertools

    from nmt.sentences import paragraphs

    if args.nbest > 1 or args.scores:
        flag = "--nbest" if args.nbest > 1 else "--scores"
        raise NmtError(f"--paragraphs writes one translation a paragraph: leave {flag} out (or translate sentence "
                       "by sentence without --paragraphs)")

    def lines():
        for line in utf8_lines(source, args.input or "stdin"):
            seen.see(line)
            yield line.rstrip("\r\n")

    def flush(pending: list):
        sentences = [t for _, found in pending for t in found or []]
        failed: list[int] = []
        done = iter(list(translator.translate_batches([sentences], failed, **kwargs)) if sentences else [])
        bad = set(failed)  # (numbers from 1 within `sentences`, known once all are translated)
        index = 0
        for first, found in pending:
            if found is None:
                yield ""
                continue
            out = [next(done) for _ in found]
            if bad & set(range(index + 1, index + len(found) + 1)):
                seen.failed.append(first)
            yield " ".join(t for t, n in zip(out, range(index + 1, index + len(found) + 1)) if n not in bad)
            index += len(found)

    pending, size = [], 0
    for item in itertools.islice(paragraphs(lines()), skip, None):
        pending.append(item)
        size += len(item[1] or [])
        if size >= args.chunk_size or (interactive and item[1] is not None):
            yield from flush(pending)
            pending, size = [], 0
    yield from flush(pending)


def _is_regular_file(stream) -> bool:
    """True for a file (or anything without a descriptor, e.g. a StringIO); False for a terminal, pipe or socket."""
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError):
        return True


def _draw_first(translator, seen: _Seen, args: argparse.Namespace) -> None:
    """--attention: the cross-attention of the first input sentence, drawn with the (first) PyTorch model."""
    from nmt.attention import plot_alignment
    from nmt.engines import ATTENTION
    from nmt.translate import Translator

    if seen.first is None:
        raise NmtError("--attention: the input is empty; there is no first sentence to draw")
    if not translator.engine.supports(ATTENTION):  # CTranslate2, or an ensemble: the first model alone draws
        translator = Translator.from_pretrained(args.model_dir[0], args.device, dtype=args.dtype or "fp32")
    text, alpha = seen.first, {} if args.alpha is None else {"alpha": args.alpha}
    src, tgt, weights = translator.attention(text, layer=args.attention_layer, beam_size=args.beam,
                                             tgt_lang=args.tgt_lang, src_lang=args.src_lang, **alpha)
    translation = translator.tokenizer.decode_tgt([[translator.tokenizer.tgt.token_to_id(t) for t in tgt]])[0]
    out = plot_alignment(src, tgt, weights, args.attention, title=f"{text}  \u2192  {translation}")
    print(f"wrote {out} (cross-attention of the first sentence)", file=sys.stderr)


def cmd_evaluate(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.metrics import corpus_scores
    from nmt.textfiles import atomic_file, refuse_overwrite

    no_extra(extra)
    resolve_models(args)
    refuse_overwrite([("--output", args.output)], [("--src", args.src), ("--ref", args.ref), *model_inputs(args)])
    src, ref = read_lines(args.src), read_lines(args.ref)
    if len(src) != len(ref):
        raise NmtError(f"{args.src} has {len(src)} lines but {args.ref} has {len(ref)}")
    hyps = _translator(args).translate(src, tgt_lang=args.tgt_lang, src_lang=args.src_lang, **search_kwargs(args),
                                       **_glossary(args))
    if args.output:
        with atomic_file(args.output) as sink:
            sink.write("".join(h + "\n" for h in hyps))
    scores = corpus_scores(hyps, ref)
    print(f"BLEU {scores['bleu']:.2f}  {scores['bleu_signature']}")
    print(f"chrF {scores['chrf']:.2f}  {scores['chrf_signature']}")
    return 0


def cmd_score(args: argparse.Namespace, extra: list[str]) -> int:
    """Per line: the sum and mean log-probability (nats) of the target given the source, tab-separated
    (--per-token: then each token's, space-separated)."""
    from nmt.textfiles import atomic_file, refuse_overwrite
    from nmt.translate import Translator

    no_extra(extra)
    resolve_models(args)
    refuse_overwrite([("--output", args.output)], [("--src", args.src), ("--tgt", args.tgt), *model_inputs(args)])
    src, tgt = read_lines(args.src), read_lines(args.tgt)
    if len(src) != len(tgt):
        raise NmtError(f"{args.src} has {len(src)} lines but {args.tgt} has {len(tgt)}")
    dirs = args.model_dir
    translator = Translator.from_pretrained(dirs if len(dirs) > 1 else dirs[0], device=args.device,
                                            dtype=args.dtype or "fp32")
    with atomic_file(args.output) if args.output else nullcontext(sys.stdout) as sink:
        for s in translator.score(src, tgt, batch_tokens=args.batch_tokens, tgt_lang=args.tgt_lang):
            tokens = "\t" + " ".join(f"{x:.4f}" for x in s.token_logprobs) if args.per_token else ""
            sink.write(f"{s.total:.4f}\t{s.mean:.4f}{tokens}\n")
    return 0


def cmd_backtranslate(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.tools.backtranslate import backtranslate, output_paths
    from nmt.translate import Translator

    no_extra(extra)
    if args.tag is not None and (not args.tag or any(c.isspace() for c in args.tag)):
        raise NmtError(f"--tag must be one token without spaces, e.g. <bt>; got {args.tag!r}")
    src_path, tgt_path = output_paths(args.output, args.model_dir, args.src_lang, args.tgt_lang, args.input)
    translator = Translator.from_pretrained(args.model_dir, device=args.device, dtype=args.dtype or "fp32")
    # a multilingual model translates into the language of the synthetic sources: their file's suffix
    into = src_path.suffix[1:] if len(translator.target_languages) > 1 else None
    result = backtranslate(translator, args.input, src_path, tgt_path, tag=args.tag,
                           chunk_size=args.chunk_size, tgt_lang=into, **search_kwargs(args))
    print(result.summary())
    if result.failed:
        print(f"nmt backtranslate: error: input line(s) {numbers(result.failed)} could not be translated and were "
              "left out", file=sys.stderr)
        return 1
    return 0


# --- around a trained model: nmt export, import, plot, average, merge-adapter, serve, info -------------------------


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    no_extra(extra)
    if args.to == "transformers":
        from nmt.interop import export_transformers

        if args.quantization:
            raise NmtError("--quantization is for --to ctranslate2; a transformers export is float32")
        out, arch = export_transformers(args.model_dir, args.out, force=args.force)
        print(f"wrote {out} ({arch}); load it with transformers.AutoModelForSeq2SeqLM.from_pretrained('{out}')")
        return 0
    from nmt.ct2 import export_ctranslate2

    out = export_ctranslate2(args.model_dir, args.out, quantization=args.quantization, force=args.force)
    print(f"wrote {out} (CTranslate2, {args.quantization or 'float32'}); translate with: nmt translate --ct2 {out}")
    return 0


def cmd_import(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.interop import import_hf

    no_extra(extra)
    out = import_hf(args.hf_dir, args.out, src_lang=args.src_lang, tgt_lang=args.tgt_lang, force=args.force,
                    revision=args.revision)
    print(f"wrote {out}; translate with: nmt translate {out}, fine-tune with: nmt train --init-from {out} ...")
    return 0


def cmd_plot(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.tools.plot import plot_runs

    no_extra(extra)
    print(f"wrote {plot_runs(args.run_dirs, args.output)}")
    return 0


def cmd_average(args: argparse.Namespace, extra: list[str]) -> int:
    no_extra(extra)
    from nmt.loading import average_run

    print(f"averaged model written to {average_run(args.run_dir, args.last, args.output, force=args.force)}")
    return 0


def cmd_merge_adapter(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.loading import merge_adapter_dir

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
    if args.ct2:
        from nmt.checkpoint import read_languages
        from nmt.tools.info import translates

        translator = _ct2_translator(args)
        if args.model_dir:  # what CTranslate2 cannot (a glossary) is translated by the model it was exported from
            resolve_models(args)
            translator.with_pytorch(Translator.from_pretrained(args.model_dir, device=args.device,
                                                               dtype=args.dtype or "fp32"))
            serve(translator, cfg, describe(args.model_dir))
            return 0
        serve(translator, cfg, {"translates": translates(read_languages(args.ct2), {})})
        return 0
    if not args.model_dir:
        raise NmtError("give a model directory (MODEL_DIR) or an exported CTranslate2 model (--ct2 DIR)")
    resolve_models(args)
    serve(Translator.from_pretrained(args.model_dir, device=args.device, dtype=args.dtype or "fp32"), cfg,
          describe(args.model_dir))
    return 0


def cmd_info(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.tools.info import describe, lines

    no_extra(extra)
    info = describe(args.model_dir)
    print(json.dumps(info, indent=2) if args.json else "\n".join(lines(info)))
    return 0


# --- what the handlers share: extra arguments, the main process, reading line files -------------------------------


def no_extra(extra: list[str]) -> None:
    if extra:
        raise NmtError(f"unexpected arguments: {' '.join(extra)}")


def is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def stdin_fd() -> int | None:
    """The descriptor of stdin, when it has one (a file redirected with < is an input an output must not name)."""
    try:
        return sys.stdin.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor (a notebook, a test)
        return None


def resolve_models(args: argparse.Namespace) -> None:
    """MODEL_DIR (each of an ensemble's) as the directory it names, in place: a path as it is, a Hub id's snapshot
    or its transformers model imported once (`nmt.interop.model_directory`)."""
    from nmt.interop import model_directory

    revision = getattr(args, "revision", None)
    if isinstance(args.model_dir, list):
        if revision is not None and not args.model_dir:
            raise NmtError(f"--revision {revision}: it names a revision of MODEL_DIR's Hub id; give MODEL_DIR ORG/NAME")
        args.model_dir = [str(model_directory(d, revision)) for d in args.model_dir]
    else:
        args.model_dir = str(model_directory(args.model_dir, revision))


def model_inputs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The model directories a command reads (MODEL_DIR, several for an ensemble; --ct2 DIR), for
    `nmt.textfiles.refuse_overwrite`: no output may name a file in them."""
    dirs = args.model_dir if isinstance(args.model_dir, list) else [args.model_dir]
    ct2, glossary = getattr(args, "ct2", None), getattr(args, "glossary", None)
    return [("MODEL_DIR", d) for d in dirs if d] + ([("--ct2", ct2)] if ct2 else []) + \
        ([("--glossary", glossary)] if glossary else [])


def read_lines(path: str) -> list[str]:
    try:
        with open(path, "rb") as f:
            return [line.rstrip("\r\n") for line in utf8_lines(f, path)]  # names the first line that is not UTF-8
    except FileNotFoundError:
        raise NmtError(f"file not found: {path}") from None


def numbers(lines: list[int]) -> str:
    """Line numbers for a message: the first 20, then "..."."""
    return ", ".join(map(str, lines[:20])) + (", ..." if len(lines) > 20 else "")


if __name__ == "__main__":
    main_entry()
