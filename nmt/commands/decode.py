"""`nmt translate`, `nmt evaluate`, `nmt score` and `nmt backtranslate`: the commands that run a model over text."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field

from nmt.commands.common import model_inputs, no_extra, numbers, read_lines, stdin_fd
from nmt.errors import NmtError
from nmt.validate import utf8_lines


def search_kwargs(args: argparse.Namespace) -> dict:
    """--alpha only when given: otherwise the model directory's tuned alpha (search.json), else 0.6.
    --sampling (with --topk/--topp/--temperature/--seed) draws translations instead of beam search."""
    alpha = {} if args.alpha is None else {"alpha": args.alpha}
    sampling = None
    if args.sampling:
        from nmt.sampling import SamplingConfig

        sampling = SamplingConfig(topk=args.topk, topp=args.topp, temperature=args.temperature, seed=args.seed)
    return dict(beam_size=args.beam, batch_tokens=args.batch_tokens, sampling=sampling, **alpha)


def _translator(args: argparse.Namespace):
    """The PyTorch model of MODEL_DIR (several: an ensemble), or with --ct2 DIR the CTranslate2 export."""
    from nmt.translate import Translator

    if args.ct2:
        return Translator.from_ctranslate2(args.ct2, device=args.device)
    if not args.model_dir:
        raise NmtError("give a model directory (MODEL_DIR) or an exported CTranslate2 model (--ct2 DIR)")
    dirs = args.model_dir
    return Translator.from_pretrained(dirs if len(dirs) > 1 else dirs[0], device=args.device)


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
    line."""
    from nmt.textfiles import atomic_file

    # bytes, decoded line by line: a line that is not UTF-8 is named by its number
    source = open(args.input, "rb") if args.input else getattr(sys.stdin, "buffer", sys.stdin)
    interactive = not _is_regular_file(source)  # a terminal or a pipe (or FIFO): answer line by line
    try:
        with atomic_file(args.output) if args.output else nullcontext(sys.stdout) as sink:
            for line in _translations(translator, source, interactive, seen, args):
                sink.write(line + "\n")
                if interactive:
                    sink.flush()
    finally:
        if args.input:
            source.close()


def _translations(translator, source, interactive: bool, seen: _Seen, args: argparse.Namespace):
    """The output lines: files batch by length; a terminal or pipe is translated as its lines arrive."""
    from nmt.translate import arrived_lines

    kwargs = dict(nbest=args.nbest, tgt_lang=args.tgt_lang, **search_kwargs(args))
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
    return translator.translate_stream(lines(), failed=seen.failed, **kwargs)


def _is_regular_file(stream) -> bool:
    """True for a file (or anything without a descriptor, e.g. a StringIO); False for a terminal, pipe or socket."""
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (OSError, ValueError):
        return True


def _draw_first(translator, seen: _Seen, args: argparse.Namespace) -> None:
    """--attention: the cross-attention of the first input sentence, drawn with the (first) PyTorch model."""
    from nmt.attention import plot_alignment
    from nmt.translate import Translator

    if seen.first is None:
        raise NmtError("--attention: the input is empty; there is no first sentence to draw")
    if translator.backend != "torch" or len(args.model_dir) != 1:
        translator = Translator.from_pretrained(args.model_dir[0], args.device)
    text, alpha = seen.first, {} if args.alpha is None else {"alpha": args.alpha}
    src, tgt, weights = translator.attention(text, layer=args.attention_layer, beam_size=args.beam,
                                             tgt_lang=args.tgt_lang, **alpha)
    translation = translator.tokenizer.decode_tgt([[translator.tokenizer.tgt.token_to_id(t) for t in tgt]])[0]
    out = plot_alignment(src, tgt, weights, args.attention, title=f"{text}  \u2192  {translation}")
    print(f"wrote {out} (cross-attention of the first sentence)", file=sys.stderr)


def cmd_evaluate(args: argparse.Namespace, extra: list[str]) -> int:
    from nmt.metrics import corpus_scores
    from nmt.textfiles import atomic_file, refuse_overwrite

    no_extra(extra)
    refuse_overwrite([("--output", args.output)], [("--src", args.src), ("--ref", args.ref), *model_inputs(args)])
    src, ref = read_lines(args.src), read_lines(args.ref)
    if len(src) != len(ref):
        raise NmtError(f"{args.src} has {len(src)} lines but {args.ref} has {len(ref)}")
    hyps = _translator(args).translate(src, tgt_lang=args.tgt_lang, **search_kwargs(args))
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
    refuse_overwrite([("--output", args.output)], [("--src", args.src), ("--tgt", args.tgt), *model_inputs(args)])
    src, tgt = read_lines(args.src), read_lines(args.tgt)
    if len(src) != len(tgt):
        raise NmtError(f"{args.src} has {len(src)} lines but {args.tgt} has {len(tgt)}")
    dirs = args.model_dir
    translator = Translator.from_pretrained(dirs if len(dirs) > 1 else dirs[0], device=args.device)
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
    translator = Translator.from_pretrained(args.model_dir, device=args.device)
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
