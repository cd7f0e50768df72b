"""nmt.translate: Translator's batching, order, n-best lists, streaming, long inputs and its model directory."""

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import one_thread  # noqa: F401  (module-wide: tiny models on shared CPUs)
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.checkpoint import SEARCH_FILE
from nmt.config import ModelConfig, TokenizerConfig
from nmt.decoding import SamplingConfig
from nmt.errors import NmtError
from nmt.model import Seq2SeqTransformer
from nmt.synthetic import generate_pairs
from nmt.tokenizer import EOS, train_pair_tokenizer
from nmt.translate import Translator, fit_length

TEXTS = [src for src, _ in generate_pairs(12, seed=3)]


def ranked(found) -> list[tuple[str, float]]:
    """A Translation's n-best list as (text, score) pairs, best first."""
    return [(t.text, t.score) for t in found.nbest]


@pytest.fixture(scope="module")
def translator() -> Translator:
    """A random tiny model (d_model 16) over a tokenizer trained on the synthetic language."""
    pairs = generate_pairs(300, seed=1)
    tok = train_pair_tokenizer(lambda: (s for s, _ in pairs), lambda: (t for _, t in pairs),
                               TokenizerConfig(vocab_size=120))
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size, d_model=16,
                             n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32, dropout=0.0)
    return Translator(Seq2SeqTransformer(cfg), tok)


def test_batches_do_not_change_translations_and_order_is_kept(translator):
    alone = [translator.translate([t], beam_size=2, max_new_tokens=8)[0] for t in TEXTS]
    assert translator.translate(TEXTS, beam_size=2, max_new_tokens=8, batch_tokens=24) == alone  # many small batches
    assert translator.translate(TEXTS[::-1], beam_size=2, max_new_tokens=8) == alone[::-1]


def test_nbest_lists_are_scored_best_first(translator):
    out = [ranked(t) for t in translator.translations(TEXTS[:3], beam_size=4, nbest=3, max_new_tokens=8)]
    assert [len(hyps) for hyps in out] == [3, 3, 3]
    for hyps in out:
        scores = [score for _, score in hyps]
        assert all(isinstance(text, str) for text, _ in hyps) and scores == sorted(scores, reverse=True)
    best = translator.translate(TEXTS[:3], beam_size=4, max_new_tokens=8)
    assert [hyps[0][0] for hyps in out] == best
    with pytest.raises(NmtError, match=r"translations\(texts, nbest=N\)"):
        translator.translate(TEXTS[:1], nbest=2)  # one string per sentence: n-best lists are translations'


def test_stream_equals_translate_in_any_chunking(translator):
    whole = translator.translate(TEXTS, beam_size=1, max_new_tokens=8)
    lines = [t + "\n" for t in TEXTS]
    assert list(translator.translate_stream(lines, chunk_size=5, beam_size=1, max_new_tokens=8)) == whole
    nbest = list(translator.translate_stream(lines[:2], chunk_size=1, beam_size=2, nbest=2, max_new_tokens=8))
    assert [len(line.split("\t")) for line in nbest] == [4, 4]  # text, score, text, score


def test_fit_length_truncates_or_splits_keeping_the_end_of_sentence():
    ids = [5, 6, 7, 8, 9, 10, EOS]
    assert fit_length(ids, 7, "truncate") == [ids]
    assert fit_length(ids, 4, "truncate") == [[5, 6, 7, EOS]]
    assert fit_length(ids, 4, "split") == [[5, 6, 7, EOS], [8, 9, 10, EOS]]
    with pytest.raises(NmtError, match="long_inputs must be"):
        fit_length(ids, 4, "drop")


def test_from_pretrained_reads_the_directory_and_its_tuned_alpha(translator, tmp_path):
    translator.model.save_pretrained(tmp_path)
    translator.tokenizer.save(tmp_path)
    loaded = Translator.from_pretrained(tmp_path)
    assert loaded.search_defaults == {} and loaded.backend == "torch"
    assert loaded.translate(TEXTS[:4], beam_size=2, max_new_tokens=8) == translator.translate(TEXTS[:4], beam_size=2,
                                                                                             max_new_tokens=8)
    (tmp_path / SEARCH_FILE).write_text(json.dumps({"alpha": 1.3}))
    assert Translator.from_pretrained(tmp_path).search_defaults == {"alpha": 1.3}


# --- one output per input: blank lines, long inputs, n-best ---------------------------------------------

BLANKS = ["", " ", "\t", " \u3000 "]  # \u3000: an ideographic space


@pytest.fixture(scope="module")
def short(translator) -> Translator:
    """The tiny model with max_positions 12: two or three synthetic sentences make a long input."""
    torch.manual_seed(0)
    cfg = replace(translator.model.cfg, max_positions=12)
    return Translator(Seq2SeqTransformer(cfg), translator.tokenizer)


def long_text(i: int) -> str:
    return " ".join(TEXTS[i: i + 3])


def test_blank_inputs_give_empty_outputs_without_running_the_model(translator, monkeypatch):
    import nmt.engines

    def no_search(*args, **kwargs):
        raise AssertionError("the model ran for blank inputs")

    monkeypatch.setattr(nmt.engines, "search_encoded", no_search)
    assert translator.translate(BLANKS) == ["", "", "", ""]
    assert [ranked(t) for t in translator.translations(BLANKS[:2], beam_size=3, nbest=3)] == [[("", 0.0)] * 3] * 2
    assert translator.translate([]) == []


def test_long_inputs_are_long_for_the_short_model(short):
    assert all(len(ids) > 12 for ids in short.tokenizer.encode_src([long_text(i) for i in range(4)]))


POOL = BLANKS + TEXTS[:4] + [long_text(i) for i in range(3)]


@settings(max_examples=25, deadline=None)
@given(picks=st.lists(st.integers(0, len(POOL) - 1), max_size=7), nbest=st.sampled_from([1, 2, 3]),
       long_inputs=st.sampled_from(["truncate", "split"]))
def test_outputs_align_one_to_one_with_inputs(short, picks, nbest, long_inputs):
    texts = [POOL[i] for i in picks]
    options = dict(beam_size=3, nbest=nbest, long_inputs=long_inputs, max_new_tokens=5)
    out = [ranked(t) for t in short.translations(texts, **options)]
    assert len(out) == len(texts)
    for text, got in zip(texts, out):
        alone = ranked(short.translations([text], **options)[0])  # output i is input i's, whatever else is in the batch
        assert len(got) == nbest and all(isinstance(t, str) and isinstance(s, float) for t, s in got)
        assert [t for t, _ in got] == [t for t, _ in alone]
        assert [s for _, s in got] == pytest.approx([s for _, s in alone], abs=1e-4)
        assert text.strip() or got == [("", 0.0)] * nbest
    if nbest == 1:  # translate: the same texts, one string a sentence
        assert short.translate(texts, beam_size=3, long_inputs=long_inputs, max_new_tokens=5) == [g[0][0] for g in out]


def test_a_split_input_joins_its_pieces_in_order_in_every_hypothesis(short):
    from nmt.decoding import SearchConfig, search_encoded

    text = long_text(0)
    pieces = fit_length(short.tokenizer.encode_src([text])[0], 12, "split")
    assert len(pieces) > 1
    found = search_encoded(short.model, pieces, SearchConfig(beam_size=3, nbest=3, max_new_tokens=5), 4096)
    each = [[(short.tokenizer.decode_tgt([h.tokens])[0], h.score) for h in found[j]] for j in range(len(pieces))]
    joined = ranked(short.translations([text], beam_size=3, nbest=3, long_inputs="split", max_new_tokens=5)[0])
    for k, (translation, score) in enumerate(joined):
        assert translation == " ".join(hyps[k][0] for hyps in each)
        assert score == pytest.approx(sum(hyps[k][1] for hyps in each), abs=1e-4)
    assert short.translate([text], beam_size=3, long_inputs="split", max_new_tokens=5) == [joined[0][0]]


def test_nbest_is_exact_even_when_the_search_finds_fewer(translator):
    # a length limit of one token leaves one hypothesis, </s>, however wide the beam
    out = [ranked(t) for t in translator.translations(TEXTS[:2] + [""], beam_size=4, nbest=4, max_new_tokens=1)]
    assert [len(hyps) for hyps in out] == [4, 4, 4]
    assert all(len(set(hyps)) == 1 for hyps in out)


def test_sampled_nbest_gives_nbest_per_input(short):
    out = [ranked(t) for t in short.translations(["", long_text(1), TEXTS[0], " "], nbest=3, long_inputs="split",
                                                max_new_tokens=5, sampling=SamplingConfig(topk=5, seed=1))]
    assert [len(hyps) for hyps in out] == [3, 3, 3, 3]
    assert out[0] == out[3] == [("", 0.0)] * 3


def test_cli_keeps_blank_lines_aligned(short, tmp_path):
    """nmt translate (file and stdin) and nmt evaluate: one output line per input line, blank for blank."""
    from nmt.cli import main

    short.model.save_pretrained(tmp_path / "m")
    short.tokenizer.save(tmp_path / "m")
    lines = ["", TEXTS[0], "  ", long_text(2), "\t", TEXTS[1]]
    src = tmp_path / "in.txt"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    expected = short.translate(lines, beam_size=2)
    assert main(["translate", str(tmp_path / "m"), "--input", str(src), "--output", str(tmp_path / "out.txt"),
                 "--beam", "2"]) == 0
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n") == expected + [""]
    assert main(["translate", str(tmp_path / "m"), "--input", str(src), "--output", str(tmp_path / "nbest.txt"),
                 "--beam", "2", "--nbest", "2"]) == 0
    nbest = (tmp_path / "nbest.txt").read_text(encoding="utf-8").splitlines()
    assert [len(line.split("\t")) for line in nbest] == [4] * len(lines)
    assert [line.split("\t")[::2] for line in nbest][0] == ["", ""]
    ref = tmp_path / "ref.txt"
    ref.write_text("".join(f"ref {i}\n" for i in range(len(lines))), encoding="utf-8")
    assert main(["evaluate", str(tmp_path / "m"), "--src", str(src), "--ref", str(ref), "--beam", "2",
                 "--output", str(tmp_path / "hyp.txt")]) == 0
    assert (tmp_path / "hyp.txt").read_text(encoding="utf-8").split("\n") == expected + [""]
    piped = subprocess.run([sys.executable, "-m", "nmt.cli", "translate", str(tmp_path / "m"), "--beam", "2"],
                           input=src.read_text(encoding="utf-8"), capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.split("\n") == expected + [""]


def test_a_line_of_megabytes_is_cut_before_it_is_tokenised(short, tmp_path, monkeypatch, capsys, caplog):
    """nmt translate, from a file and from a pipe: a line of megabytes reaches the tokenizer cut to
    CHARS_PER_POSITION characters per model position (768 for max_positions 12), and the cut is said once."""
    import threading

    from nmt.cli import main
    from nmt.tokenizer import PairTokenizer
    from nmt.translate import CHARS_PER_POSITION

    short.model.save_pretrained(tmp_path / "m")
    short.tokenizer.save(tmp_path / "m")
    seen: list[int] = []
    encode_src = PairTokenizer.encode_src
    monkeypatch.setattr(PairTokenizer, "encode_src", lambda self, texts, **kw: seen.extend(map(len, texts)) or
                        encode_src(self, texts, **kw))
    huge = " ".join([TEXTS[0]] * 100_000)  # megabytes: tokenising the whole line took seconds per MB
    data = f"{huge}\n{TEXTS[1]}\n{huge}\n".encode()
    (tmp_path / "in.txt").write_bytes(data)
    argv = ["translate", str(tmp_path / "m"), "--beam", "1"]
    assert main([*argv, "--input", str(tmp_path / "in.txt")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert max(seen) == 12 * CHARS_PER_POSITION and len(seen) == 3
    assert caplog.text.count("before tokenising") == 1
    seen.clear()
    read, write = os.pipe()

    def feed():
        with open(write, "wb") as pipe:
            for start in range(0, len(data), 1 << 16):
                pipe.write(data[start: start + (1 << 16)])

    writer = threading.Thread(target=feed)
    writer.start()
    with open(read, "rb") as pipe:
        monkeypatch.setattr(sys, "stdin", pipe)
        assert main(argv) == 0  # a pipe: translated as its lines arrive
    writer.join()
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert max(seen) == 12 * CHARS_PER_POSITION and len(seen) == 3


def test_a_markup_line_of_megabytes_is_cut_before_it_is_parsed(short, monkeypatch, caplog):
    """The second audit (issue 47, row 6): --format html and xml lines were never cut (256 KB of <br> took 89 s, a
    4 MB line a gigabyte). They are cut as plain lines are, before parsing; what stays open is closed at the cut
    and a tag cut in two is left out, so well-formed XML stays well-formed."""
    import nmt.markup
    from nmt.translate import CHARS_PER_POSITION

    parse, seen = nmt.markup.parse, []
    monkeypatch.setattr(nmt.markup, "parse", lambda sentence, *a, **kw: seen.append(len(sentence)) or
                        parse(sentence, *a, **kw))
    most = 12 * CHARS_PER_POSITION
    lines = {"html": "<br>" * 65_536, "xml": "<p>" + "the <b>dog</b> sleeps . " * 40_000 + "</p>"}
    for format, line in lines.items():
        out = short.translate([line, "the <i>cat</i> ."], beam_size=1, format=format)
        assert len(out) == 2 and "<i>" in out[1]
        assert max(seen) <= most
        seen.clear()
    cut = short.parse_markup(lines["xml"][: most + 300], "xml")
    assert cut.text.startswith("the dog sleeps") and len(cut.text) < most
    assert [e.start_tag for e in cut.elements] == ["<p>"] and cut.elements[0].end == len(cut.text)  # closed at the cut
    assert caplog.text.count("before tokenising") == 1


@pytest.mark.slow  # a whole file translated, killed and resumed in subprocesses
@pytest.mark.parametrize("paragraphs", [False, True])
def test_a_big_file_killed_midway_continues_where_it_stopped_to_the_same_bytes(translator, tmp_path, paragraphs):
    """Issue 45, part 5: nmt translate --input F --output O killed with SIGKILL at a random point keeps what it had
    written (at most the chunk in flight is lost), and the same command run again continues there and ends with
    the bytes an uninterrupted run writes; a changed input starts over and says so. With --paragraphs alike (an
    output line a paragraph or a blank line)."""
    import random
    import signal
    import time

    translator.model.save_pretrained(tmp_path / "m")
    translator.tokenizer.save(tmp_path / "m")
    lines = [src for src, _ in generate_pairs(1200, seed=7)]
    if paragraphs:  # paragraphs of 1 to 3 lines, a blank line after each
        lines = [line + ("\n" if i % 5 in (0, 2) else "") for i, line in enumerate(lines)]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}

    def nmt_translate(output: str, **kw) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "nmt.cli", "translate", str(tmp_path / "m"), "--input",
                                 str(tmp_path / "in.txt"), "--output", str(tmp_path / output), "--chunk-size", "40",
                                 "--beam", "2", *(["--paragraphs"] if paragraphs else [])],
                                env=env, stderr=subprocess.PIPE, text=True, **kw)

    whole = nmt_translate("whole.txt")
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    written = (tmp_path / "whole.txt").read_text(encoding="utf-8").count("\n")
    assert written == (481 + 480 if paragraphs else 1200)  # paragraphs: 481 of them, 480 blank lines
    record = tmp_path / ".out.txt.nmt-resume.json"
    stop_after = random.randrange(40, written - 40, 40)  # lines committed before the kill
    run = nmt_translate("out.txt")
    while not (record.is_file() and json.loads(record.read_text() or "{}").get("lines", 0) >= stop_after):
        assert run.poll() is None, f"ended before line {stop_after}: {run.stderr.read()}"
        time.sleep(0.005)
    os.kill(run.pid, signal.SIGKILL)
    run.wait(timeout=60)
    assert not (tmp_path / "out.txt").exists()  # never half an output under the output's name
    done = json.loads(record.read_text())["lines"]
    again = nmt_translate("out.txt")
    assert again.wait(timeout=300) == 0
    said = again.stderr.read()
    assert f"continuing {tmp_path / 'out.txt'} after line {done:,}" in said and "lines/s" not in said, stop_after
    assert (tmp_path / "out.txt").read_bytes() == (tmp_path / "whole.txt").read_bytes(), stop_after
    assert not record.exists() and not (tmp_path / ".out.txt.nmt-partial").exists()
    run = nmt_translate("new.txt")  # killed again, then the input changes: the rest would not match
    while not (tmp_path / ".new.txt.nmt-resume.json").is_file():
        assert run.poll() is None, run.stderr.read()
        time.sleep(0.005)
    os.kill(run.pid, signal.SIGKILL)
    run.wait(timeout=60)
    apart = "\n\n" if paragraphs else "\n"  # the input's lines, or its paragraphs, in reverse order
    (tmp_path / "in.txt").write_text(apart.join("\n".join(lines).split(apart)[::-1]) + "\n", encoding="utf-8")
    changed = nmt_translate("new.txt")
    assert changed.wait(timeout=300) == 0 and "starting" in changed.stderr.read()
    assert (tmp_path / "new.txt").read_text().splitlines() == (tmp_path / "whole.txt").read_text().splitlines()[::-1]
    import pty  # on a terminal, stderr shows how far it is

    screen, terminal = pty.openpty()
    shown = subprocess.run([sys.executable, "-m", "nmt.cli", "translate", str(tmp_path / "m"), "--input",
                            str(tmp_path / "in.txt"), "--output", str(tmp_path / "seen.txt"), "--chunk-size", "400",
                            *(["--paragraphs"] if paragraphs else [])], env=env, stderr=terminal, timeout=300)
    os.close(terminal)
    progress = os.read(screen, 1 << 16).decode()
    os.close(screen)
    assert shown.returncode == 0 and f"{written:,}/{written:,} lines" in progress and "min left" in progress, progress


def test_decoding_goes_to_the_gpu_when_there_is_one_in_the_precision_asked(translator, monkeypatch):
    """Issue 46, part 1 (decoding): --device defaults to the GPU when torch sees one (faked here), fp32 products
    run in TF32 there, --dtype bf16 decodes with bf16 weights, and fp16 on a CPU is refused with what to use."""
    from nmt.translate import decoding_device, decoding_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert decoding_device() == decoding_device("auto") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert decoding_device() == torch.device("cpu") and decoding_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(NmtError, match="--device 'gpu0' is no device torch knows"):
        decoding_device("gpu0")
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert decoding_dtype("fp32", torch.device("cuda")) == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    with pytest.raises(NmtError, match="--dtype fp16 is for GPUs; on a CPU decode in bf16"):
        decoding_dtype("fp16", torch.device("cpu"))
    import copy

    half = Translator(copy.deepcopy(translator.model), translator.tokenizer, "cpu", dtype="bf16")
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    out = half.translations(TEXTS[:4], beam_size=2)
    assert len(out) == 4 and all(math.isfinite(o.mean_logprob) for o in out)


def test_control_strings_typed_in_a_source_are_text_to_the_model():
    """"the dog <2fr> sees </s> ...": the model sees the characters, with one </s> at the end, never a tag or an
    end of sentence mid-source."""
    pairs = generate_pairs(300, seed=1)
    texts = [s for s, _ in pairs] + ["a <b> c/d", "pads unk 2 fr"]
    tok = train_pair_tokenizer(lambda: iter(texts), lambda: (t for _, t in pairs),
                               TokenizerConfig(vocab_size=160, reserved=["<2fr>"]))
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size, d_model=16,
                             n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32, dropout=0.0)
    text = "the dog <2fr> sees </s> a <pad> cat <unk>"
    src_tokens, _, _ = Translator(Seq2SeqTransformer(cfg), tok).attention(text, beam_size=1)
    assert src_tokens[-1] == "</s>" and not {"<2fr>", "</s>", "<pad>", "<unk>"} & set(src_tokens[:-1])
    assert "".join(src_tokens[:-1]).replace("\u2581", " ").strip() == text


# --- confidence: translations' scores and nmt translate --scores ----------------------------------------------------


@pytest.mark.parametrize("options", [dict(beam_size=1), dict(beam_size=3), dict(sampling=SamplingConfig(topk=5, seed=1))],
                         ids=["greedy", "beam", "sampling"])
def test_scores_are_the_mean_log_probability_of_each_translation(translator, options):
    """translations: the same translations as translate, each with the mean log-probability per token (</s>
    included) that forced decoding gives the tokens it was decoded from (a </s> forced at the length limit counts 0,
    as the search scores it), and its exp as the confidence; a blank source: "", mean 0, confidence 1. (Forced
    decoding of the text would tokenise it anew: a random model's subwords do not always come back the same.)"""
    from nmt.decoding import SearchConfig, score_encoded, search_encoded
    from nmt.translate import Translation

    texts = TEXTS[:6] + [" "]
    plain = translator.translate(texts, max_new_tokens=8, **options)
    scored = translator.translations(texts, max_new_tokens=8, **options)
    assert [s.text for s in scored] == plain
    src_ids = translator.tokenizer.encode_src(texts[:-1], leading_tags=False)
    search = SearchConfig(beam_size=max(options.get("beam_size", 1), 1), max_new_tokens=8)
    found = search_encoded(translator.model, src_ids, search, 4096, sampling=options.get("sampling"))
    tokens = [found[i][0].tokens for i in range(len(src_ids))]
    assert translator.tokenizer.decode_tgt(tokens) == plain[:-1] and all(t[-1] == EOS for t in tokens)
    forced = score_encoded(translator.model, src_ids, [t[:-1] for t in tokens], 4096)
    means = [(f.total - f.token_logprobs[-1] * (len(t) == 8)) / len(t) for f, t in zip(forced, tokens)]
    assert [s.mean_logprob for s in scored[:-1]] == pytest.approx(means, abs=1e-4)
    assert all(0 < s.confidence < 1 and s.confidence == pytest.approx(math.exp(s.mean_logprob)) for s in scored[:-1])
    assert scored[-1] == Translation("", 0.0, 0.0) and scored[-1].confidence == 1.0
    unread = translator.translations(texts, max_new_tokens=8, confidence=False, **options)  # the fields not picked
    assert [t.text for t in unread] == plain and all(math.isnan(t.mean_logprob) for t in unread)


def test_scored_nbest_and_split_sentences(short):
    """n-best with scores: the n-best list's texts and ranking scores, each with its own hypothesis' mean
    log-probability; a split sentence's mean is over all its pieces' tokens."""
    from nmt.decoding import SearchConfig, search_encoded

    scored = [t.nbest for t in short.translations(TEXTS[:3], beam_size=3, nbest=2, max_new_tokens=5)]
    assert [len(hyps) for hyps in scored] == [2, 2, 2]
    assert [hyps[0].text for hyps in scored] == short.translate(TEXTS[:3], beam_size=3, max_new_tokens=5)
    src_ids = [fit_length(ids, 12, "truncate")[0] for ids in short.tokenizer.encode_src(TEXTS[:3])]
    found = search_encoded(short.model, src_ids, SearchConfig(beam_size=3, nbest=2, max_new_tokens=5), 4096)
    assert [s.mean_logprob for hyps in scored for s in hyps] == pytest.approx(
        [h.logprob / len(h.tokens) for i in range(3) for h in found[i]], abs=1e-5)
    text = long_text(0)
    pieces = fit_length(short.tokenizer.encode_src([text])[0], 12, "split")
    found = [search_encoded(short.model, pieces, SearchConfig(beam_size=3, max_new_tokens=5), 4096)[j][0]
             for j in range(len(pieces))]
    split = short.translations([text], beam_size=3, long_inputs="split", max_new_tokens=5)[0]
    assert len(pieces) > 1 and split.mean_logprob == pytest.approx(
        sum(h.logprob for h in found) / sum(len(h.tokens) for h in found), abs=1e-5)


def test_cli_scores_write_translation_mean_logprob_and_confidence(translator, tmp_path):
    """nmt translate --scores: TSV of the translation, its mean log-probability and its confidence, one line per
    input line (a blank one too)."""
    from nmt.cli import main

    translator.model.save_pretrained(tmp_path / "m")
    translator.tokenizer.save(tmp_path / "m")
    lines = [TEXTS[0], "", TEXTS[1]]
    src = tmp_path / "in.txt"
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    assert main(["translate", str(tmp_path / "m"), "--input", str(src), "--output", str(tmp_path / "out.tsv"),
                 "--beam", "2", "--scores"]) == 0
    rows = [line.split("\t") for line in (tmp_path / "out.tsv").read_text(encoding="utf-8").splitlines()]
    expected = translator.translations(lines, beam_size=2)
    assert [r[0] for r in rows] == [s.text for s in expected] and [len(r) for r in rows] == [3, 3, 3]
    assert [float(x) for r in rows for x in r[1:]] == pytest.approx(
        [x for s in expected for x in (s.mean_logprob, s.confidence)], abs=1e-4)  # 4 decimals
    assert rows[1] == ["", "0.0000", "1.0000"]
    assert main(["translate", str(tmp_path / "m"), "--input", str(src), "--output", str(tmp_path / "nbest.tsv"),
                 "--beam", "2", "--nbest", "2", "--scores"]) == 0
    nbest = [line.split("\t") for line in (tmp_path / "nbest.tsv").read_text(encoding="utf-8").splitlines()]
    expected = translator.translations(lines, beam_size=2, nbest=2)
    assert [r[::3] for r in nbest] == [[s.text for s in t.nbest] for t in expected]  # text, mean, confidence, ...


def test_ctranslate2_scores_are_its_forced_decoding_of_each_translation(translator, tmp_path):
    """Translator.from_ctranslate2(...).translations() and nmt translate --ct2 --scores: the float32
    export's greedy translations are ours, each with the mean log-probability forced decoding gives its tokens,
    </s> included at its probability (also where the length limit ended it)."""
    pytest.importorskip("ctranslate2")
    from nmt.cli import main
    from nmt.decoding import SearchConfig, score_encoded, search_encoded

    translator.model.save_pretrained(tmp_path / "m")
    translator.tokenizer.save(tmp_path / "m")
    assert main(["export", str(tmp_path / "m"), "--to", "ctranslate2", str(tmp_path / "ct2")]) == 0
    exported = Translator.from_ctranslate2(tmp_path / "ct2")
    scored = exported.translations(TEXTS[:4], beam_size=1, max_new_tokens=8)
    src_ids = translator.tokenizer.encode_src(TEXTS[:4], leading_tags=False)
    found = search_encoded(translator.model, src_ids, SearchConfig(beam_size=1, max_new_tokens=8), 4096)
    tokens = [found[i][0].tokens for i in range(4)]
    assert [s.text for s in scored] == translator.tokenizer.decode_tgt(tokens)
    forced = score_encoded(translator.model, src_ids, [t[:-1] for t in tokens], 4096)
    assert [s.mean_logprob for s in scored] == pytest.approx([f.mean for f in forced], abs=1e-4)
    (tmp_path / "in.txt").write_text(TEXTS[0] + "\n", encoding="utf-8")
    assert main(["translate", "--ct2", str(tmp_path / "ct2"), "--input", str(tmp_path / "in.txt"), "--beam", "1",
                 "--scores", "--output", str(tmp_path / "out.tsv")]) == 0
    text, mean, confidence = (tmp_path / "out.tsv").read_text(encoding="utf-8").rstrip("\n").split("\t")
    expected = exported.translations(TEXTS[:1], beam_size=1)[0]
    assert (text, float(mean), float(confidence)) == (expected.text, pytest.approx(expected.mean_logprob, abs=1e-4),
                                                      pytest.approx(expected.confidence, abs=1e-4))


def test_a_glossary_puts_its_terms_in_the_translations_and_leaves_other_sentences_alone(translator):
    """Translator.translate(glossary=): where a source holds a source term (whole words, case as given) the
    translation holds its target term as a whole word, two in one sentence too; every other sentence of the same
    call is translated exactly as without a glossary."""
    glossary = {"frogs": "dorzari", "white": "kozika", "cat": "bobisa zamo", "farmer": "puvu"}
    texts = [*TEXTS, "A white cat sees ten frogs.", "The Farmer sleeps.", "A catalogue of cats."]
    plain = translator.translate(texts, beam_size=3)
    glossed = translator.translate(texts, beam_size=3, glossary=glossary)
    held = []
    for text, without, out in zip(texts, plain, glossed):
        wanted = [t for s, t in glossary.items() if re.search(rf"(?<!\w){s}(?!\w)", text)]
        held.append(len(wanted))
        for target in wanted:
            assert re.search(rf"(?<!\w){target}(?!\w)", out), (text, out, target)
        if not wanted:  # "Farmer", "catalogue" and "cats" hold no term
            assert out == without, text
    assert sum(held) >= 6 and max(held) == 3
    with pytest.raises(NmtError, match="glossary needs nmt's own beam search"):
        translator.translate(texts[:1], glossary=glossary, sampling=SamplingConfig(seed=1))
    with pytest.raises(NmtError, match="glossary item 1: the target term is empty"):
        translator.translate(texts[:1], glossary=[("frogs", "dorzari"), ("cat", " ")])


def test_glossary_terms_are_those_the_model_reads_and_fit_the_output(short):
    """The second audit (issue 47, row 11): a source term only in the truncated tail of a long sentence was still
    forced, and target terms longer than the output limit came out cut, silently. A term counts where the model
    reads it; terms that cannot fit the translation are refused, naming the sentence."""
    text = long_text(0)
    head = short.tokenizer.src.decode(short.tokenizer.encode_src([text])[0][:11])  # what the model reads of it
    tail = next(w for w in text.split()[::-1] if w not in head.split())  # a word it never reads
    options = dict(beam_size=2, max_new_tokens=8, long_inputs="truncate")
    assert short.translate([text], glossary={tail: "dorzari"}, **options) == short.translate([text], **options)
    first = head.split()[0]
    with pytest.raises(NmtError, match="sentence 2: its glossary target terms are .* tokens, more than the 7"):
        short.translate([TEXTS[1], text], glossary={first: "dorzari kozika bobisa zamo puvu"}, **options)


def test_a_control_token_typed_in_a_glossary_target_term_is_text():
    """With a Unigram tokenizer (imported Marian and NLLB models have one) a typed "</s>" segments into the piece
    </s>; in a glossary target term it was that control id, a term the search could never write (issue 47, row 8).
    It is text, as in sources and labels: "<", "/", "s", ">" where the vocabulary has them."""
    pairs = [(s + " <i> a/b </i>", t + " <i> a/b </i>") for s, t in generate_pairs(300, seed=1)]
    tok = train_pair_tokenizer(lambda: (s for s, _ in pairs), lambda: (t for _, t in pairs),
                               TokenizerConfig(kind="unigram", vocab_size=150, split_punctuation=False))  # as SentencePiece
    cfg = ModelConfig.preset("tiny", src_vocab_size=tok.src_vocab_size, tgt_vocab_size=tok.tgt_vocab_size, d_model=16,
                             n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32, dropout=0.0)
    translator = Translator(Seq2SeqTransformer(cfg), tok)
    controls = set(tok.tgt.get_added_tokens_decoder())
    assert tok.tgt.encode("</s>", add_special_tokens=False).ids[-1] in controls  # what the term used to be
    for term in ["</s>", "x <s> y", "<pad>"]:
        ids = translator.term_ids([term])[0]
        assert controls.isdisjoint(ids) and tok.tgt.decode(ids).replace(" ", "") == term.replace(" ", "")


def test_cli_glossary_for_translate_and_evaluate_and_its_file_errors_naming_the_line(translator, tmp_path, capsys):
    """nmt translate and nmt evaluate --glossary terms.tsv: the terms in the output; a file that is wrong is refused
    in one line naming the file and line: wrong column count, an empty term, a source term with two targets, not
    UTF-8."""
    from nmt.cli import main

    translator.model.save_pretrained(tmp_path / "m")
    translator.tokenizer.save(tmp_path / "m")
    src, ref, terms = tmp_path / "in.txt", tmp_path / "ref.txt", tmp_path / "terms.tsv"
    src.write_text("Ten frogs were not good.\nWho closed this letter?\n", encoding="utf-8")
    ref.write_text("Dorzari lopanda.\nKimo nunoza.\n", encoding="utf-8")
    terms.write_text("\ufefffrogs\tdorzari\n\nletter\tvoputu\n", encoding="utf-8")  # a BOM and a blank line are fine
    assert main(["translate", str(tmp_path / "m"), "--input", str(src), "--output", str(tmp_path / "out.txt"),
                 "--glossary", str(terms)]) == 0
    out = (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()
    assert re.search(r"(?<!\w)dorzari(?!\w)", out[0]) and re.search(r"(?<!\w)voputu(?!\w)", out[1]), out
    assert main(["evaluate", str(tmp_path / "m"), "--src", str(src), "--ref", str(ref), "--glossary", str(terms),
                 "--output", str(tmp_path / "hyp.txt")]) == 0
    assert (tmp_path / "hyp.txt").read_text(encoding="utf-8").splitlines() == out
    capsys.readouterr()
    for body, line, message in [(b"frogs\tdorzari\nletter voputu\n", 2, "has 1 tab-separated column"),
                                (b"frogs\tdorzari\tx\n", 1, "has 3 tab-separated columns"),
                                (b"frogs\tdorzari\n\t voputu\n", 2, "the source term is empty"),
                                (b"frogs\t\n", 1, "the target term is empty"),
                                (b"frogs\tdorzari\ncat\tbobisa\nfrogs\tlopanda\n", 3, "given twice with different"),
                                (b"frogs\tdorzari\nk\xe4se\tkesa\n", 2, "not valid UTF-8")]:
        terms.write_bytes(body)
        assert main(["translate", str(tmp_path / "m"), "--input", str(src), "--glossary", str(terms)]) == 2
        err = capsys.readouterr().err
        assert f"{terms}:{line}: " in err and message in err and len(err.strip().splitlines()) == 1, err
