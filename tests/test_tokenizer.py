"""Tokenizers: the saved tokenizer is deterministic; BPE-dropout is seeded and equals plain BPE at p = 0."""

import json
import random
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.config import TokenizerConfig
from nmt.errors import NmtError
from nmt.synthetic import generate_pairs
from nmt.tokenizer import EOS, DropoutSegmenter, PairTokenizer, train_pair_tokenizer, train_tokenizer

PAIRS = generate_pairs(400, seed=11)
TEXTS = [s for pair in PAIRS for s in pair] + ["Ünïcödé ﬁ  doubled  spaces", "", "  ", "x"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, TokenizerConfig(vocab_size=300, dropout=0.1))


def test_the_trained_tokenizer_has_no_dropout_even_when_asked_for_it(tok):
    assert json.loads(tok.to_str())["model"]["dropout"] is None
    assert all(tok.encode(t).ids == tok.encode(t).ids for t in TEXTS[:50])  # deterministic


def test_dropout_zero_is_the_tokenizers_own_segmentation(tok):
    plain, pair = DropoutSegmenter(tok, 0.0), PairTokenizer(tok)
    for text in TEXTS + ["unknown ☃ char", "a literal <unk> and </s>"]:
        assert plain.encode(text, random.Random(0)) == pair.encode_tgt([text])[0], text


def test_dropout_is_seeded_and_varies_with_the_seed(tok):
    seg = DropoutSegmenter(tok, 0.1)
    runs = {seed: [seg.encode(t, random.Random(f"{seed}")) for t in TEXTS] for seed in ("a", "b")}
    assert runs["a"] == [seg.encode(t, random.Random("a")) for t in TEXTS]  # same seed, same segmentation
    assert runs["a"] != runs["b"]
    plain = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
    longer = sum(len(x) for x in runs["a"]) / sum(len(x) for x in plain)
    assert 1.05 < longer < 2.0  # skipped merges leave more, shorter pieces


def test_leading_tags_stay_whole_and_the_words_after_them_get_dropout():
    """A multilingual source "<2de><bt> ...": its tags are the tokenizer's own ids, its words are segmented with
    dropout as without the tags (not the tokenizer's deterministic encoding, which any special would fall back to)."""
    tagged = train_tokenizer(TEXTS, TokenizerConfig(vocab_size=300, reserved=["<2de>", "<bt>"]))
    seg, text = DropoutSegmenter(tagged, 0.5), PAIRS[0][0] + " " + PAIRS[1][0]
    ids = seg.encode(f"<2de><bt> {text}", random.Random(3))
    assert ids[:2] == [tagged.token_to_id("<2de>"), tagged.token_to_id("<bt>")]
    assert ids[2:] == seg.encode(text, random.Random(3)) != tagged.encode(text, add_special_tokens=False).ids
    assert DropoutSegmenter(tagged, 0.0).encode(f"<2de>{text}", random.Random(0)) == \
        tagged.encode(f"<2de>{text}", add_special_tokens=False).ids  # p = 0: as the tokenizer encodes it


def test_every_dropout_segmentation_decodes_to_the_same_text(tok):
    seg = DropoutSegmenter(tok, 0.5)
    for i, text in enumerate(TEXTS):
        ids = seg.encode(text, random.Random(i))
        assert tok.decode(ids) == tok.decode(tok.encode(text, add_special_tokens=False).ids)


def test_dropout_needs_bpe():
    unigram = train_tokenizer(TEXTS, TokenizerConfig(kind="unigram", vocab_size=200))
    with pytest.raises(NmtError, match="plain BPE"):
        DropoutSegmenter(unigram, 0.1)


def test_loading_clears_an_older_tokenizers_dropout(tok, tmp_path):
    data = json.loads(tok.to_str())
    data["model"]["dropout"] = 0.3  # as nmt saved it before dropout moved out of the tokenizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    loaded = PairTokenizer.load(tmp_path)
    assert json.loads(loaded.src.to_str())["model"]["dropout"] is None
    text = ["the quick brown fox jumps over the lazy dog"] * 20
    assert len({tuple(ids) for ids in loaded.encode_src(text)}) == 1  # deterministic: every encoding the same


def test_unknown_rate_counts_unk_among_subwords_but_not_the_final_eos():
    from nmt.tokenizer import EOS, UNK, unknown_rate

    assert unknown_rate([[UNK, 5, EOS], [6, UNK, UNK, 7]]) == 3 / 6
    assert unknown_rate(iter([[5, EOS]])) == 0.0 and unknown_rate([]) == 0.0


# --- only the pipeline nmt writes is loaded ----------------------------------------------------------------

def _edited(tok, tmp_path, edit) -> Path:
    data = json.loads(tok.to_str())
    edit(data)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return tmp_path


REDOS = {"type": "Replace", "pattern": {"Regex": "(a+)+$"}, "content": ""}  # catastrophic backtracking


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(normalizer={"type": "Sequence", "normalizers": [d["normalizer"], REDOS]}),
     'unexpected normalizer {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Replace"'),
    (lambda d: d.update(normalizer=REDOS), 'unexpected normalizer {"type": "Replace", "pattern": {"Regex": "(a+)+$"}'),
    (lambda d: d.update(pre_tokenizer={"type": "Split", "pattern": {"Regex": "(x+x+)+y"}, "behavior": "Isolated",
                                       "invert": False}), 'unexpected pre_tokenizer {"type": "Split"'),
    (lambda d: d.update(post_processor={"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A",
                        "type_id": 0}}], "pair": [], "special_tokens": {}}), "unexpected post_processor"),
    (lambda d: d.update(decoder={"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                 "use_regex": True}), "unexpected decoder"),
    (lambda d: d["model"].update(fuse_unk=True), "unexpected model options"),
    (lambda d: d["model"].update(continuing_subword_prefix="##"), "not a readable tokenizer file"),  # a Rust panic
    (lambda d: d["added_tokens"][3].update(normalized=True, lstrip=True), "unexpected added token 3"),
])
def test_a_tokenizer_with_a_pipeline_nmt_does_not_write_is_refused(tok, tmp_path, edit, needle):
    directory = _edited(tok, tmp_path, edit)
    with pytest.raises(NmtError) as refused:
        PairTokenizer.load(directory)
    message = str(refused.value)
    assert message.startswith(f"{directory / 'tokenizer.json'}: ") and needle in message, message


def test_every_tokenizer_nmt_trains_loads(tmp_path):
    for i, cfg in enumerate([TokenizerConfig(vocab_size=200, reserved=["<bt>", "<2de>"]),
                             TokenizerConfig(kind="unigram", vocab_size=200, joint=False),
                             TokenizerConfig(vocab_size=200, split_punctuation=False)]):
        pair = train_pair_tokenizer(lambda: (s for s, _ in PAIRS), lambda: (t for _, t in PAIRS), cfg)
        pair.save(tmp_path / str(i))
        loaded = PairTokenizer.load(tmp_path / str(i))
        assert loaded.encode_src(TEXTS[:20]) == pair.encode_src(TEXTS[:20])
        assert loaded.encode_tgt(TEXTS[:20]) == pair.encode_tgt(TEXTS[:20])
    # 9d7aac3's split_punctuation: every mark its own pre-token, the "▁" of a space before it one too
    path = tmp_path / "0" / "tokenizer.json"
    data = json.loads(path.read_text())
    data["pre_tokenizer"]["pretokenizers"][1] = {"type": "Punctuation", "behavior": "Isolated"}
    path.write_text(json.dumps(data))
    split = PairTokenizer.load(tmp_path / "0").src.pre_tokenizer.pre_tokenize_str("Yes (twice) .")
    assert [piece for piece, _ in split] == ["▁Yes", "▁", "(", "twice", ")", "▁", "."]


PUNCTUATED = ["Hello, world!", '"Yes," she said (twice).', "It's 3.5 km -- isn't it?", "Wait... what?!",
              "l'homme, « bonjour » ; ça va ?", "U.S.A. 1,000,000 e-mail"]


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_punctuation_is_its_own_pre_token_and_decodes_back(kind):
    """No subword holds a letter and a punctuation mark together (a word's pieces are the same with or without
    the comma after it), and every sentence decodes back as it was written (the default). split_punctuation
    false (as tokenizers before it): marks join the words beside them."""
    texts = PUNCTUATED * 30 + TEXTS
    tok = train_tokenizer(texts, TokenizerConfig(kind=kind, vocab_size=300))
    for text in PUNCTUATED:
        encoded = tok.encode(text)
        assert tok.decode(encoded.ids) == text
        for piece in encoded.tokens:
            marks = [c for c in piece if unicodedata.category(c).startswith("P")]
            assert not marks or len(marks) == len(piece.removeprefix("\u2581")), piece  # a mark, "▁" before it
    joined = train_tokenizer(texts, TokenizerConfig(kind=kind, vocab_size=300, split_punctuation=False))
    assert any(c.isalpha() and any(unicodedata.category(m).startswith("P") for m in piece)
               for text in PUNCTUATED for piece in joined.encode(text).tokens for c in piece)


# --- the dropout segmenter's algorithm: the same draws as the textbook loop, in n log n ----------------------

def textbook_merge(seg: DropoutSegmenter, symbols: list[str], draw) -> list[str]:
    """BPE-dropout as written in the paper: each round sorts the applicable merges (rank, then position) and
    makes the first one not skipped; quadratic in the word length."""
    while len(symbols) > 1:
        candidates = sorted((rank, i) for i, pair in enumerate(zip(symbols, symbols[1:]))
                            if (rank := seg.ranks.get(pair)) is not None)
        for _, i in candidates:
            if draw() >= seg.p:
                symbols[i: i + 2] = [symbols[i] + symbols[i + 1]]
                break
        else:
            break
    return symbols


ALPHABET = sorted({c for text in TEXTS for c in text if not c.isspace()}) + ["☃"]


@settings(max_examples=200, deadline=None)
@given(word=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=40).map("".join),
       p=st.sampled_from([0.0, 0.1, 0.5, 0.9]), seed=st.integers(0, 2**32))
def test_segmenter_makes_the_textbook_draws(tok, word, p, seed):
    seg = DropoutSegmenter(tok, p)
    ours, textbook = random.Random(seed), random.Random(seed)
    assert seg._merge(list(word), ours.random) == textbook_merge(seg, list(word), textbook.random)
    assert ours.random() == textbook.random()  # the same number of draws: later words see the same stream
    if p == 0:
        assert seg.encode(word, random.Random(0)) == tok.encode(word, add_special_tokens=False).ids


def test_long_words_are_segmented_in_n_log_n(tok):
    import time

    letters = "".join(c for pair in PAIRS for text in pair for c in text if not c.isspace())
    seg = DropoutSegmenter(tok, 0.1)

    def seconds(n: int) -> float:  # CPU time, the best of five: the least disturbed by other work on the machine
        runs = []
        for seed in range(5):
            start = time.process_time()
            seg.encode(letters[:n], random.Random(seed))
            runs.append(time.process_time() - start)
        return min(runs)

    assert len(letters) >= 10_000
    short, long = seconds(5_000), seconds(10_000)
    assert short < 0.5  # the sort-per-merge loop takes seconds here
    assert long < 3 * short  # n log n: 2.2x; quadratic: 4x


CONTROL = "the dog <2fr> sees </s> a <pad> cat <unk> <s> <bt>"


@pytest.fixture(scope="module")
def tagged_pair():
    """A joint tokenizer with a language tag and a back-translation tag reserved, trained on text that has < / >."""
    texts = TEXTS + ["a <b> c/d", "unknown pads 2 fr bt"]
    return PairTokenizer(train_tokenizer(texts, TokenizerConfig(vocab_size=300, reserved=["<2fr>", "<bt>"])))


def test_control_strings_in_a_source_are_text(tagged_pair):
    """</s>, <pad>, <unk>, <s> and reserved tags typed in a source are the characters they are made of: the ids hold
    no control id but the final </s>, and decode back to the text."""
    tok = tagged_pair
    for ids in (tok.encode_src([CONTROL, "</s> <2fr> at the start"]),
                tok.encode_src([CONTROL, "<2fr> at the start"], leading_tags=False)):
        controls = set(range(4)) | {tok.src.token_to_id("<2fr>"), tok.src.token_to_id("<bt>")}
        assert [i[-1] for i in ids] == [EOS, EOS] and not controls & {x for row in ids for x in row[:-1]}
        assert tok.src.decode_batch([row[:-1] for row in ids])[0] == CONTROL
        assert tok.src.decode_batch([row[:-1] for row in ids])[1].endswith("<2fr> at the start")
    assert tok.src_tokens(CONTROL)[-1] == "</s>" and "</s>" not in tok.src_tokens(CONTROL)[:-1]


def test_tags_that_lead_a_training_source_are_their_ids_and_the_rest_is_text(tagged_pair):
    tok, text = tagged_pair, "the dog <2fr> sees"
    tag, bt = tok.src.token_to_id("<2fr>"), tok.src.token_to_id("<bt>")
    assert tok.encode_src([f"<2fr><bt> {text}"]) == [[tag, bt, *tok.encode_src([text])[0]]]
    assert tok.encode_src([f"<2fr>{text}"], leading_tags=False)[0][0] != tag
    seg = DropoutSegmenter(tok.src, 0.0)
    assert seg.encode(f"<2fr><bt> {text}", random.Random(0)) + [EOS] == tok.encode_src([f"<2fr><bt> {text}"])[0]


def test_a_training_target_with_an_end_of_sentence_inside_keeps_its_later_words(tagged_pair):
    target = "the dog </s> sees <pad> a cat"
    ids = tagged_pair.encode_tgt([target])[0]
    assert EOS not in ids and 0 not in ids
    assert tagged_pair.decode_tgt([ids + [EOS]]) == [target]
