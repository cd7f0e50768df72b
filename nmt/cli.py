"""The `nmt` command: the parser of train, check, translate, evaluate, score, backtranslate, export, import, plot,
average, merge-adapter, serve and info, and the dispatch to their handlers (nmt.commands). User errors print one
line and exit with code 2.

`accelerate launch run.py ...` is `nmt train ...` on as many processes as the profile says.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from nmt.commands.common import is_main
from nmt.commands.decode import cmd_backtranslate, cmd_evaluate, cmd_score, cmd_translate
from nmt.commands.tools import cmd_average, cmd_export, cmd_import, cmd_info, cmd_merge_adapter, cmd_plot, cmd_serve
from nmt.commands.train import cmd_check, cmd_train, overrides_from_flags
from nmt.validate import Number, error_line

__all__ = ["build_parser", "main", "main_entry", "overrides_from_flags"]
POSITIVE = Number(int, "[1, 1e9]")  # token budgets, counts of checkpoints


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


CONFIG_KEYS = "{the config keys}"  # an epilog made only when help is printed (nmt.config_reference.reference_text)


class _ConfigKeysHelp(argparse.RawDescriptionHelpFormatter):
    """`nmt train --help` / `nmt check --help`: after the flags, every config key with its type, default, allowed
    values and meaning, from the source of docs/configuration.md's table; computed only when the help is shown."""

    def add_text(self, text: str | None) -> None:
        if text == CONFIG_KEYS:
            from nmt.config_reference import reference_text

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
    p.add_argument("--init-from", metavar="DIR", help="fine-tune a trained model directory (output_dir/model): its "
                   "architecture, tokenizer and weights, a fresh optimizer and schedule")
    p.add_argument("--dry-run", action="store_true", help="check data, batches, time and memory (as nmt check); no training")
    _add_check_args(p)
    p.set_defaults(fn=cmd_train)


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="pre-flight check: data, lengths, vocabulary, batches, time, memory, problems",
                       epilog=CONFIG_KEYS, formatter_class=_ConfigKeysHelp)
    p.add_argument("--config", help="a YAML file from configs/ or your own (overrides as for train)")
    p.add_argument("--init-from", metavar="DIR", help="as for train; also reports how DIR's tokenizer fits the data")
    _add_check_args(p)
    p.set_defaults(fn=cmd_check)


def _add_decoding(sub, name: str, help_: str) -> argparse.ArgumentParser:
    """The arguments `nmt translate` and `nmt evaluate` share: the model, the search, the device, --output."""
    p = sub.add_parser(name, help=help_)
    p.add_argument("model_dir", nargs="*", help="a model directory (output_dir/model of a run); several: "
                   "an ensemble (one tokenizer); optional with --ct2")
    p.add_argument("--ct2", metavar="DIR", help="decode with CTranslate2 using a model made by nmt export "
                   "MODEL_DIR --to ctranslate2 DIR (needs pip install ctranslate2)")
    _add_decoding_args(p)
    p.add_argument("--tgt-lang", help="a multilingual model's target language (one of its languages.json's)")
    p.add_argument("--output", help="write here instead of stdout (evaluate: the hypotheses)")
    _add_sampling_args(p)
    return p


def _add_translate(sub) -> None:
    p = _add_decoding(sub, "translate", "translate stdin or --input to stdout or --output")
    p.add_argument("--input", help="read here instead of stdin")
    p.add_argument("--nbest", type=Number(int, "nmt.search:SearchConfig.nbest"), default=1,
                   help="hypotheses per sentence (tab-separated with scores; at most --beam)")
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
    p.add_argument("model_dir", nargs="+", help="a model directory; several: an ensemble (one tokenizer)")
    p.add_argument("--src", required=True, help="source sentences, one per line")
    p.add_argument("--tgt", required=True, help="their translations to score, one per line")
    p.add_argument("--per-token", action="store_true", help="also print each target token's log-probability")
    p.add_argument("--tgt-lang", help="a multilingual model's target language (one of its languages.json's)")
    p.add_argument("--batch-tokens", type=POSITIVE, default=4096, help="padded tokens per batch")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--output", help="write here instead of stdout")
    p.set_defaults(fn=cmd_score)


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a model directory for another runtime (CTranslate2, transformers)")
    p.add_argument("model_dir", help="a model directory (output_dir/model of a run)")
    p.add_argument("--to", required=True, choices=["ctranslate2", "transformers"], help="the target format")
    p.add_argument("out", help="the directory to write (must be empty or absent unless --force)")
    p.add_argument("--quantization", help="ctranslate2: weight type: int8, int8_float32, int16, float16, bfloat16, "
                   "... (default: float32)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(fn=cmd_export)


def _add_import(sub) -> None:
    p = sub.add_parser("import", help="a transformers translation model (Marian/OPUS-MT, M2M100, NLLB) as an nmt "
                       "model directory (needs nmt[hf])")
    p.add_argument("hf_dir", help="a directory written by save_pretrained: the model and its tokenizer")
    p.add_argument("out", help="the model directory to write (must be empty or absent unless --force)")
    p.add_argument("--src-lang", help="M2M100/NLLB: the source language token (e.g. __en__ or eng_Latn)")
    p.add_argument("--tgt-lang", help="M2M100/NLLB: the target language token, forced as the first output token")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
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
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    p.set_defaults(fn=cmd_average)


def _add_merge_adapter(sub) -> None:
    p = sub.add_parser("merge-adapter", help="merge a LoRA run's adapter into its base weights: a plain model "
                       "directory (needs nmt[lora])")
    p.add_argument("model_dir", help="the model/ (or best/) of a LoRA run (finetune.lora_r > 0), or its run folder")
    p.add_argument("out", help="the model directory to write (must be empty or absent unless --force)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(fn=cmd_merge_adapter)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="architecture, size, vocabulary, training data and scores of a model directory")
    p.add_argument("model_dir", help="a model directory (output_dir/model or output_dir/best)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(fn=cmd_info)


DEBUG_HELP = "on an error, print the Python traceback too (normally one line: exit 2 for bad input, 1 otherwise)"


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sampling", action="store_true", help="draw each translation from the model instead of beam "
                   "search (--nbest N: N samples per sentence)")
    p.add_argument("--topk", type=Number(int, "nmt.sampling:SamplingConfig.topk"), default=0,
                   help="with --sampling: draw among the k most likely tokens (0: all)")
    p.add_argument("--topp", type=Number(float, "nmt.sampling:SamplingConfig.topp"), default=1.0,
                   help="with --sampling: draw among the most likely tokens whose probabilities sum to p (nucleus)")
    p.add_argument("--temperature", type=Number(float, "nmt.sampling:SamplingConfig.temperature"), default=1.0,
                   help="with --sampling: < 1 sharper, > 1 flatter, 0 greedy")
    p.add_argument("--seed", type=Number(int, "nmt.sampling:SamplingConfig.seed"), default=0,
                   help="with --sampling: the same seed and input give the same output")


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


def _add_serve_parser(sub) -> None:
    from nmt.tools.request_batcher import ServeConfig  # no web framework: nmt serve's flags exist without the extra

    p = sub.add_parser("serve", help="an HTTP JSON API translating with a model directory (needs nmt[serve])")
    p.add_argument("model_dir", help="a model directory (output_dir/model of a run)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    ServeConfig.add_flags(p)
    p.set_defaults(fn=cmd_serve, ct2=None)


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The search flags of translate, evaluate and backtranslate (nmt.commands.decode.search_kwargs reads them)."""
    p.add_argument("--beam", type=Number(int, "nmt.search:SearchConfig.beam_size"), default=4,
                   help="beam size (1: greedy)")
    p.add_argument("--alpha", type=Number(float, "nmt.search:SearchConfig.alpha"),
                   help="length penalty exponent (default: the model's tuned alpha, "
                   "search.json in MODEL_DIR when training had tune_alpha, else 0.6)")
    p.add_argument("--batch-tokens", type=POSITIVE, default=4096, help="source tokens per batch")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")


def _add_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-processes", type=Number(int, "[1, 100000]"),
                   help="plan batches for this many processes (default: num_processes "
                   "of --profile, else WORLD_SIZE or ACCELERATE_NUM_PROCESSES from the environment, else 1)")
    p.add_argument("--profile", help="an accelerate config file (accelerate_configs/*.yaml) to read num_processes from")
    p.add_argument("--probe-steps", type=Number(int, "[0, 1e6]"), default=3,
                   help="timed training steps after one warm-up (0: no timing)")


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
    except Exception as e:  # noqa: BLE001 - the boundary: one line, exit 2 for the user's input, 1 for the rest
        return _report(e, args)


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


if __name__ == "__main__":
    main_entry()
