"""The sentences chapter (nmt.sentences): documents split into paragraphs and sentences by a documented rule, and
`nmt translate --paragraphs` translating a whole document sentence by sentence with its paragraph breaks kept."""

from __future__ import annotations

import pytest
from helpers import model_dir as saved_model_dir
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.cli import main
from nmt.sentences import paragraphs, split_sentences


@pytest.mark.parametrize("text, sentences", [
    ("Hello world. How are you? I am fine!", ["Hello world.", "How are you?", "I am fine!"]),
    ("Dr. Smith met Mr. Jones. They talked.", ["Dr. Smith met Mr. Jones.", "They talked."]),
    ("J. R. R. Tolkien wrote it. Really.", ["J. R. R. Tolkien wrote it.", "Really."]),
    ("Er kam z.B. spät. Dann ging er.", ["Er kam z.B. spät.", "Dann ging er."]),
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("It costs 3.50 euros. OK.", ["It costs 3.50 euros.", "OK."]),
    ("Wait... What?! No.", ["Wait...", "What?!", "No."]),
    ("see e.g. this and that", ["see e.g. this and that"]),
    ("我很好。你呢？谢谢", ["我很好。", "你呢？", "谢谢"]),
    ("one\nparagraph   wrapped", ["one paragraph wrapped"]),
    (" \t ", []),
])
def test_the_splitter_follows_its_documented_rule(text, sentences):
    assert split_sentences(text) == sentences


def test_a_megabyte_of_end_marks_is_split_in_one_pass():
    """Runs of end marks (the second audit, issue 47 row 5: 16k dots took 12 s, 32k 23 s, a megabyte hours) are
    read once: a run is matched whole where it starts, and the splitter never copies the text at a mark. The alarm
    only turns a hang into a failure; the splits are what is checked."""
    import signal

    def hung(*_):
        raise TimeoutError("split_sentences backtracks on runs of end marks")

    signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        assert split_sentences("." * 1_000_000) == ["." * 1_000_000]
        assert split_sentences("Wait?!" * 200_000 + " No.") == ["Wait?!" * 200_000, "No."]
        assert split_sentences("Hi there. " * 100_000) == ["Hi there."] * 100_000
    finally:
        signal.alarm(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40), max_size=12))
def test_sentences_lose_no_word_and_paragraphs_keep_every_blank_line(lines):
    lines = [line.replace("\n", " ").replace("\r", " ") for line in lines]
    found = list(paragraphs(lines))
    assert [n for n, s in found if s is None] == [i for i, line in enumerate(lines, 1) if not line.strip()]
    words = [w for _, s in found if s for sentence in s for w in sentence.split()]
    assert words == [w for line in lines for w in line.split()]


def test_translate_paragraphs_writes_a_line_a_paragraph_with_blank_lines_kept(tmp_path, capsys):
    from nmt import Translator

    directory = saved_model_dir(tmp_path / "m")
    doc = tmp_path / "doc.txt"
    doc.write_text("The dog sees a cat. A cat\nsees the dog!\n\n\nThe cat sleeps.\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    assert main(["translate", str(directory), "--input", str(doc), "--output", str(out), "--paragraphs",
                 "--beam", "2"]) == 0
    sentences = ["The dog sees a cat.", "A cat sees the dog!", "The cat sleeps."]
    each = Translator.from_pretrained(directory).translate(sentences, beam_size=2)
    assert out.read_text(encoding="utf-8") == f"{each[0]} {each[1]}\n\n\n{each[2]}\n"
    assert main(["translate", str(directory), "--input", str(doc), "--paragraphs", "--nbest", "2", "--beam", "2"]) == 2
    assert "--paragraphs writes one translation a paragraph: leave --nbest out" in capsys.readouterr().err
