"""Back-translation (Sennrich et al. 2016): target-language monolingual text -> a synthetic parallel corpus.

A reverse model (trained tgt -> src) translates each monolingual line; the translation becomes the synthetic
source, the monolingual line its target. Both files are written line by line, a chunk at a time (memory stays
flat), as a `data.train` prefix: PREFIX.<src> and PREFIX.<tgt>, each under a temporary name renamed into place
when the input is done (a failed run leaves older files as they were). A tag (Caswell et al. 2019) marks the
synthetic sources so that a forward model trained on the mix can tell them from real ones.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nmt.checkpoint import SUMMARY_FILE, read_summary
from nmt.config import check_lang_code
from nmt.errors import NmtError
from nmt.textfiles import atomic_file, refuse_overwrite, utf8_lines

log = logging.getLogger(__name__)

DEFAULT_TAG = "<bt>"  # keep it whole with tokenizer.reserved: ["<bt>"] in the forward model's config


@dataclass
class BacktranslateResult:
    src_path: Path  # the synthetic sources (the model's translations, tagged when asked)
    tgt_path: Path  # the monolingual lines they translate
    pairs: int = 0  # lines written to each file
    empty: int = 0  # blank monolingual lines, skipped
    failed: list[int] = field(default_factory=list)  # input line numbers that could not be translated, skipped

    def summary(self) -> str:
        skipped = f"; skipped {self.empty} blank line(s)" if self.empty else ""
        failed = f" and {len(self.failed)} line(s) that failed to translate" if self.failed else ""
        return f"wrote {self.pairs} pairs: {self.src_path} (synthetic source) and {self.tgt_path} (target){skipped}{failed}"


def model_languages(model_dir: str | Path) -> tuple[str, str] | None:
    """(source, target) language codes the model was trained with (training.json), if it says; a value there that
    is not a language code (`nmt.config.check_lang_code`) is an NmtError, since it becomes a file name."""
    path = Path(model_dir) / SUMMARY_FILE
    try:
        data = read_summary(model_dir)["config"]["data"]
        langs = data["src_lang"], data["tgt_lang"]
    except (KeyError, TypeError):
        return None
    return tuple(check_lang_code(lang, f"{path}: config.data.{side}") for lang, side in zip(langs, ("src_lang", "tgt_lang")))


def output_paths(prefix: str | Path, model_dir: str | Path, src_lang: str | None, tgt_lang: str | None,
                 input_path: str | Path) -> tuple[Path, Path]:
    """PREFIX.<src> for the translations and PREFIX.<tgt> for the monolingual copy, in PREFIX's folder.

    The reverse model translates its source language (the forward model's target) into its target language
    (the forward model's source); codes not given come from the model's training.json. Both files must resolve
    (links followed) into the folder PREFIX names.
    """
    src_lang = src_lang and check_lang_code(src_lang, "--src-lang")
    tgt_lang = tgt_lang and check_lang_code(tgt_lang, "--tgt-lang")
    langs = None if src_lang and tgt_lang else model_languages(model_dir)
    src_lang = src_lang or (langs[1] if langs else None)
    tgt_lang = tgt_lang or (langs[0] if langs else None)
    if not src_lang or not tgt_lang:
        raise NmtError(f"{model_dir}: training.json does not name its languages; give --src-lang (the language "
                       "the model translates into) and --tgt-lang (the language of the monolingual input)")
    if src_lang == tgt_lang:
        raise NmtError(f"--src-lang and --tgt-lang are both {src_lang!r}: the two files would be one")
    src_path, tgt_path = Path(f"{prefix}.{src_lang}"), Path(f"{prefix}.{tgt_lang}")
    folder = Path(os.path.realpath(Path(prefix).parent))
    for path in (src_path, tgt_path):
        if Path(os.path.realpath(path)).parent != folder:
            raise NmtError(f"--output {path} resolves to {os.path.realpath(path)}, outside {folder}; backtranslate "
                           "writes only into the folder --output names: remove the link or choose another prefix")
    refuse_overwrite([("--output", src_path), ("--output", tgt_path)],
                     [("--input", input_path), ("MODEL_DIR", model_dir)])
    return src_path, tgt_path


def read_lines(path: str | Path) -> Iterator[str]:
    """The lines of a UTF-8 file, streamed, without line ends (`nmt.textfiles.utf8_lines`); a bad byte names its
    line."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise NmtError(f"file not found: {path}") from None
    with f:
        yield from utf8_lines(f, path, keep_ends=False)


def backtranslate(translator, input_path: str | Path, src_path: Path, tgt_path: Path, tag: str | None = None,
                  chunk_size: int = 2000, **decode) -> BacktranslateResult:
    """Translate `input_path` line by line into `src_path`, copying each line to `tgt_path`.

    `decode` goes to `Translator.translate` as is (beam_size, alpha, batch_tokens, sampling options, ...).
    Blank lines and lines that fail to translate are left out of both files, so they stay aligned.
    """
    if decode.get("nbest", 1) != 1:
        raise NmtError("back-translation writes one translation per line: nbest must be 1")
    result = BacktranslateResult(src_path, tgt_path)
    to_model, to_files = itertools.tee(_non_blank(input_path, result))  # tee holds at most the chunk in the model
    failed: list[int] = []  # positions among the non-blank lines, ascending
    outputs = translator.translate_stream((line for _, line in to_model), chunk_size=chunk_size, failed=failed,
                                          **decode)
    src_path.parent.mkdir(parents=True, exist_ok=True)
    next_failed = 0
    with atomic_file(src_path) as src, atomic_file(tgt_path) as tgt:  # a failure midway replaces neither
        for i, (translation, (n, line)) in enumerate(zip(outputs, to_files), 1):
            while next_failed < len(failed) and failed[next_failed] < i:
                next_failed += 1
            if next_failed < len(failed) and failed[next_failed] == i:
                result.failed.append(n)  # the file's line number
                continue
            src.write(f"{tag} {translation}\n" if tag else translation + "\n")
            tgt.write(line + "\n")
            result.pairs += 1
    return result


def _non_blank(path: str | Path, result: BacktranslateResult) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines that hold text; blank ones are counted in `result.empty`."""
    for n, line in enumerate(read_lines(path), 1):
        if line.strip():
            yield n, line
        else:
            result.empty += 1
