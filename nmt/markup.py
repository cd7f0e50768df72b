"""Markup kept through translation (`nmt translate --format html|xml`, the server's "format" field).

A tagged sentence is taken apart into the plain text the model translates and a tree of elements over that
text's character offsets (`parse`); after translation, each element is put back around the target words that the
model's cross-attention aligns with the source words it enclosed (`insert`). The translation's text is never
changed: only tags are inserted (at word boundaries), and its characters are escaped.

Placement, for a translation aligned to its source (weights (T, S) over target and source tokens):
  - each target token is aligned to its most attended source token (the argmax of its row);
  - an element spans, in the target, the whole words from the first to the last target token aligned to a
    source token inside it; where none is, the target tokens that attend most to its source tokens (the argmax of
    their columns) stand in;
  - an empty element (<br>, <img/>, <b></b>, a comment; one holding only spaces) goes after the target word aligned to
    the source token before it; before the word aligned to the token after it where it is written against that
    word with a space before it, or nothing before it;
  - nesting is kept from the top down: a child is cut to its parent's words, and siblings, ordered by where their
    words fall, are cut where they would overlap (one left with no words is kept empty, at its place). Siblings
    follow their words, so their order can change with the word order.

Kept verbatim: start tags with their attributes, self-closing and void elements (<br>, <img ...>), comments,
declarations, processing instructions, raw-text elements (<script>, <style>, <textarea>, ...) with their content.
Entities and character references are decoded for the model and the translation is written escaped (&amp; &lt;
&gt;; other characters as themselves). Comments and raw text end where HTML5 ends them, so the translation is never
more active than its source (no element a browser builds from it that it does not build from the source).

xml is strict: a sentence that is not well-formed XML content (mismatched or unclosed tags, an undefined entity)
is an NmtError naming the sentence and the column. In either format, elements nested more than MAX_DEPTH deep are
an error. Otherwise html is parsed as a browser would, best effort, never an error:
void elements need no end tag, an end tag closes the nearest open element of its name (and those opened inside
it), an end tag that closes nothing is dropped, and elements left open are closed at the end of the sentence.

Standard library only (html.parser, xml.parsers.expat).
"""

from __future__ import annotations

import bisect
import html
import re
import xml.parsers.expat
from dataclasses import dataclass, field
from html.parser import HTMLParser

from nmt.errors import NmtError

FORMATS = ("text", "html", "xml")
# HTML elements that never have content or an end tag
VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
# elements whose content HTML5 reads as raw text (code, or text no tag can enter): kept verbatim, up to the end tag
# where HTML5 ends them ("</script" and a space, "/" or ">"); <plaintext> runs to the end
RAW = frozenset("script style textarea title xmp iframe noembed noframes noscript plaintext".split())
_NAME = re.compile(r"<\s*([^\s/>]+)")
_TAG = re.compile(rb"<[^<>\"']*(?:(?:\"[^\"]*\"|'[^']*')[^<>\"']*)*>")  # a tag, quoted '>' allowed in attributes
_COMMENT_END = re.compile(r"--!?>")  # where HTML5 ends a comment
_WRAP = "nmt-markup"  # the element an XML sentence is parsed inside (XML content may have several roots)
MAX_DEPTH = 256  # elements open inside one another in a sentence; a deeper one is a MarkupError


class MarkupError(NmtError):
    """A sentence that is not well-formed markup; `index` is its position in the call (0-based)."""

    def __init__(self, index: int, reason: str):
        super().__init__(f"sentence {index + 1}: {reason}")
        self.index, self.reason = index, reason


@dataclass
class Element:
    """A tag pair (or an empty item) as written in the source, over plain-text characters [start, end)."""

    start_tag: str  # verbatim: '<a href="x">', '<br/>', '<!-- note -->'
    end_tag: str  # '</a>'; "" for a void, self-closing or opaque item
    start: int
    end: int
    children: list[Element] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.start == self.end


@dataclass
class Marked:
    """A sentence taken apart: the plain text the model reads and the elements over it (top level first)."""

    text: str
    elements: list[Element]


def check_format(format: str) -> str:
    if format not in FORMATS:
        raise NmtError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    return format


def needs_parsing(sentence: str) -> bool:
    """Whether `sentence` holds anything of markup (a tag or an entity); one that does not is translated as text."""
    return "<" in sentence or "&" in sentence


def parse(sentence: str, format: str, index: int = 0, cut: bool = False) -> Marked:
    """The plain text of `sentence` and its elements (`format` "html" or "xml"; MarkupError for bad xml). `cut`:
    the sentence is the head of a longer one (`Translator.parse_markup`): what it leaves open is closed at its end,
    a tag or entity cut in two left out."""
    builder = _Builder(index)
    if format == "xml":
        _parse_xml(sentence, builder, index, whole=not cut)
    elif format == "html":
        _HtmlEvents(builder).run(sentence)
    else:
        raise NmtError(f"markup format must be html or xml, got {format!r}")
    return builder.done()


class _Builder:
    """Collects parse events into plain text and an element tree."""

    def __init__(self, index: int = 0):
        self.index = index
        self.parts: list[str] = []
        self.length = 0
        self.root = Element("", "", 0, 0)
        self.open: list[tuple[Element, str]] = [(self.root, "")]  # (element, name) from the outside in

    def text(self, data: str) -> None:
        self.parts.append(data)
        self.length += len(data)

    def start(self, start_tag: str, name: str) -> None:
        if len(self.open) > MAX_DEPTH:  # placing and writing the tags back recurse once per level
            raise MarkupError(self.index, f"elements nested more than {MAX_DEPTH} deep (html: tags left open stay "
                              "open to the end of the sentence): close the elements the sentence opens")
        element = Element(start_tag, f"</{_NAME.match(start_tag).group(1)}>", self.length, self.length)
        self.open[-1][0].children.append(element)
        self.open.append((element, name))

    def item(self, verbatim: str) -> None:
        """An empty item: a void or self-closing element, a comment, a processing instruction."""
        self.open[-1][0].children.append(Element(verbatim, "", self.length, self.length))

    def end(self, name: str) -> bool:
        """Closes the innermost open element called `name` and those inside it; False when none is open."""
        for depth in range(len(self.open) - 1, 0, -1):
            if self.open[depth][1] == name:
                while len(self.open) > depth:
                    self.open.pop()[0].end = self.length
                return True
        return False

    def done(self) -> Marked:
        while len(self.open) > 1:
            self.open.pop()[0].end = self.length
        return Marked("".join(self.parts), self.root.children)


class _HtmlEvents(HTMLParser):
    CDATA_CONTENT_ELEMENTS = tuple(sorted(RAW))  # html.parser reads their content as raw text (set_cdata_mode)

    def __init__(self, builder: _Builder):
        super().__init__(convert_charrefs=True)
        self.b = builder
        self.raw: list[str] | None = None  # inside <script>/<style>: its verbatim text so far
        self.declared = False  # parse_html_declaration's declaration or marked section was reported

    def run(self, sentence: str) -> None:
        if (cut := _unclosed_start_tag(sentence)) is not None:
            sentence = sentence[:cut]  # the rest is inside that tag: a browser shows none of it
        self.feed(sentence)
        self.close()
        if self.raw is not None:  # an unclosed <script>: kept as written (html.parser leaves its text unread), closed
            self.b.item("".join(self.raw) + self.rawdata + f"</{self.cdata_elem}>")

    def set_cdata_mode(self, elem):
        """Raw text up to where HTML5 ends it (html.parser 3.11 also ends it at "</ script>", which HTML5 does not)."""
        super().set_cdata_mode(elem)
        self.interesting = re.compile(r"(?!)" if self.cdata_elem == "plaintext" else
                                      rf"</{self.cdata_elem}(?=[\t\n\f\r />])", re.I)

    def handle_starttag(self, tag, attrs):
        text = self.get_starttag_text()
        if self.raw is not None:
            self.raw.append(text)
        elif tag in RAW:
            self.raw = [text]
        elif tag in VOID:
            self.b.item(text)
        else:
            self.b.start(text, tag)

    def handle_startendtag(self, tag, attrs):
        if self.raw is not None:
            self.raw.append(self.get_starttag_text())
        else:
            self.b.item(self.get_starttag_text())

    def handle_endtag(self, tag):
        if self.raw is not None:
            if tag in RAW:
                self.b.item("".join(self.raw) + f"</{tag}>")
                self.raw = None
            else:
                self.raw.append(f"</{tag}>")
        elif tag not in VOID:
            self.b.end(tag)  # one that closes nothing is dropped, as browsers do

    def handle_data(self, data):
        if self.raw is not None:
            self.raw.append(data)
        else:
            self.b.text(data)

    # Comments, declarations, marked sections and processing instructions are written back as the source's own
    # characters (html.parser's data rebuilt with new delimiters could end elsewhere than the source's did), and a
    # comment ends where HTML5 ends it: at the first "-->" or "--!>" ("<!-->" and "<!--->" end at once), never at
    # Python 3.11's "-- >"; an unclosed one runs to the end of the sentence and is closed there. What a browser
    # reads as comment in the source (a tag in it included) is comment in the translation.

    def parse_comment(self, i, report=1):
        data = self.rawdata
        if data.startswith((">", "->"), i + 4):
            j, close = data.index(">", i + 4) + 1, ""
        elif (end := _COMMENT_END.search(data, i + 4)) is not None:
            j, close = end.end(), ""
        else:
            j, close = len(data), "-->"
        if report:
            self._verbatim(data[i:j] + close)
        return j

    def parse_bogus_comment(self, i, report=1):  # "<!x ...>", "</ x>": up to the first ">"
        j = super().parse_bogus_comment(i, report=0)
        if j > i and report:
            self._verbatim(self.rawdata[i:j])
        return j

    def parse_html_declaration(self, i):  # a doctype or a marked section (a comment and a bogus one write themselves)
        self.declared = False
        j = super().parse_html_declaration(i)
        if j > i and self.declared:
            self._verbatim(self.rawdata[i:j])
        return j

    def parse_pi(self, i):
        j = super().parse_pi(i)
        if j > i:
            self._verbatim(self.rawdata[i:j])
        return j

    def handle_decl(self, decl):
        self.declared = True

    def unknown_decl(self, data):
        self.declared = True

    def _verbatim(self, text: str) -> None:
        if self.raw is not None:
            self.raw.append(text)
        else:
            self.b.item(text)


_START_TAG = re.compile(r"<[A-Za-z]")
_IN_TAG = re.compile(r"""=\s*(?:"[^"]*("?)|'[^']*('?))|>""")  # a quoted attribute value (closed or not), or the end


def _unclosed_start_tag(sentence: str) -> int | None:
    """Where the first start tag that never ends begins (no ">" outside its quoted attribute values; None: there is
    none), in one pass. html.parser looks for the end of such a tag again at each later "<", to the end of the
    sentence each time ('<a x="' * 682 is quadratic there); HTML5 drops it and everything after it (all of it is
    inside the tag: no element, no text)."""
    at = 0
    while (tag := _START_TAG.search(sentence, at)) is not None:
        at = tag.end()
        while (part := _IN_TAG.search(sentence, at)) is not None:
            at = part.end()
            if part.group() == ">":
                break
            if not (part.group(1) or part.group(2)):  # the value runs to the end of the sentence
                return tag.start()
        else:
            return tag.start()
    return None


def _parse_xml(sentence: str, b: _Builder, index: int, whole: bool = True) -> None:
    head = f"<{_WRAP}>".encode()
    source = head + sentence.encode("utf-8") + (f"</{_WRAP}>".encode() if whole else b"")
    parser = xml.parsers.expat.ParserCreate()
    depth = [0]
    empty: list[bool] = []  # per element expat has open, from the outside in: written self-closing (<x/>)

    def start(name, attrs):
        depth[0] += 1
        if depth[0] == 1:
            return
        at = parser.CurrentByteIndex
        tag = _TAG.match(source, at).group().decode("utf-8")
        empty.append(tag.endswith("/>"))
        b.item(tag) if empty[-1] else b.start(tag, name)

    def end(name):
        depth[0] -= 1
        if depth[0] >= 1 and not empty.pop():  # expat ends <x/> too: it is no open element to close
            b.end(name)

    parser.StartElementHandler, parser.EndElementHandler = start, end
    parser.CharacterDataHandler = lambda data: b.text(data) if depth[0] else None
    parser.CommentHandler = lambda data: b.item(f"<!--{data}-->")
    parser.ProcessingInstructionHandler = lambda target, data: b.item(f"<?{target} {data}?>" if data else f"<?{target}?>")
    try:
        parser.Parse(source, whole)  # a head (not whole) ends where it was cut: expat keeps a tag cut in two unread
    except xml.parsers.expat.ExpatError as e:
        at = len(source[: e.offset].decode("utf-8", "ignore")) - len(head)  # expat counts bytes of the line
        where = "at the end" if at >= len(sentence) else f"at column {max(at, 0) + 1}"
        raise MarkupError(index, f"not well-formed XML ({xml.parsers.expat.ErrorString(e.code)} {where}): close "
                          "every tag in the sentence it opens in and write & < > in text as &amp; &lt; &gt; (or use "
                          "format html, which repairs markup as a browser does)") from None


def escape(text: str) -> str:
    """Text as markup: & < > escaped, everything else as it is."""
    return html.escape(text, quote=False)


# --- putting the tags back -------------------------------------------------------------------------------------------


def words(text: str) -> list[tuple[int, int]]:
    """The character ranges of `text`'s words (runs of non-space characters)."""
    return [m.span() for m in re.finditer(r"\S+", text)]


def insert(marked: Marked, translation: str, src_spans: list[tuple[int, int]], tgt_spans: list[tuple[int, int]],
           weights) -> str:
    """`translation` as markup, `marked`'s elements placed through the alignment (see the module's docstring).

    src_spans: the character ranges in `marked.text` of the S source tokens; tgt_spans: those in `translation` of
    the T target tokens; weights: (T, S) nested sequences (or anything with `.tolist()`), row t how target token t
    attended over the source tokens. Tokens the model reads but the text lacks (</s>, tags) are left out of all three.
    """
    rows = weights.tolist() if hasattr(weights, "tolist") else [list(r) for r in weights]
    if len(rows) != len(tgt_spans) or any(len(r) != len(src_spans) for r in rows):
        raise NmtError(f"an alignment of {len(rows)} rows does not fit {len(tgt_spans)} target and {len(src_spans)} "
                       "source tokens")
    src_spans = [_trimmed(marked.text, span) for span in src_spans]  # a subword's span may hold the space before it
    tgt_spans = [_trimmed(translation, span) for span in tgt_spans]
    tgt_words = words(translation)
    word_of = [_word_at(tgt_words, span) for span in tgt_spans]  # target token -> word (None: no word)
    row_best = [max(range(len(r)), key=r.__getitem__) if r else None for r in rows]  # target token -> source token
    col_best = [max(range(len(rows)), key=lambda t: rows[t][s]) if rows else None for s in range(len(src_spans))]
    placer = _Placer(marked.text, src_spans, word_of, row_best, col_best)
    root = Element("", "", 0, len(marked.text), marked.elements)
    placed = placer.place(root, (0, len(tgt_words)))
    starts = [a for a, _ in tgt_words] + [len(translation)]
    ends = [0] + [z for _, z in tgt_words]
    return _render(placed, translation, starts, ends, 0, len(translation))


def _trimmed(text: str, span: tuple[int, int]) -> tuple[int, int]:
    a, z = span
    while a < z and text[a].isspace():
        a += 1
    while z > a and text[z - 1].isspace():
        z -= 1
    return a, z


def _word_at(tgt_words: list[tuple[int, int]], span: tuple[int, int]) -> int | None:
    a, z = span
    for w, (wa, wz) in enumerate(tgt_words):
        if wa < max(z, a + 1) and a < wz:
            return w
    return None


@dataclass
class _Placed:
    element: Element
    gaps: tuple[int, int]  # from the gap before target word a to the gap after word z - 1 (a == z: empty)
    children: list[_Placed]
    forward: bool = False  # an empty one: written against the word after its gap (else the word before)


class _Placer:
    """Lookups by bisection and per-source-token lists, so placing E elements over S source and T target tokens
    costs about (E + S + T) log S, not E x (S + T): a line of 64k <br> is placed in a pass."""

    def __init__(self, text: str, src_spans, word_of, row_best, col_best):
        self.text, self.src_spans, self.word_of = text, src_spans, word_of
        self.col_best = col_best
        self.starts = [a for a, _ in src_spans]  # ascending: tokens come in text order
        self.ends = [z for _, z in src_spans]
        self.rows_of: list[list[int]] = [[] for _ in src_spans]  # source token -> target tokens aligned to it
        for t, s in enumerate(row_best):
            if s is not None:
                self.rows_of[s].append(t)

    def tokens_in(self, element: Element) -> range:
        """The source tokens that overlap the element's text (sa < end and start < sz)."""
        return range(bisect.bisect_right(self.ends, element.start), bisect.bisect_left(self.starts, element.end))

    def words_of(self, sources) -> list[int]:
        """The target words aligned to these source tokens (by row argmax; else by column argmax)."""
        found = [w for s in sources for t in self.rows_of[s] if (w := self.word_of[t]) is not None]
        if not found:
            found = [self.word_of[t] for s in sources if (t := self.col_best[s]) is not None
                     and self.word_of[t] is not None]
        return found

    def wanted(self, element: Element) -> tuple[int, int, bool] | None:
        """The gaps an element would take, before its parent and siblings are heeded, and whether an empty one is
        written against the next word (else against the word before)."""
        if not element.empty and (found := self.words_of(self.tokens_in(element))):
            return min(found), max(found) + 1, False
        p = element.start  # empty, or only spaces: placed as its neighbours are
        before = bisect.bisect_right(self.ends, p) - 1  # the last token that ends by p
        after = bisect.bisect_left(self.starts, p)  # the first that starts at or after p
        after = after if after < len(self.starts) else None
        glued = after is not None and self.starts[after] == p and (p == 0 or self.text[p - 1].isspace())
        if before >= 0 and not glued and (found := self.words_of([before])):
            return max(found) + 1, max(found) + 1, False
        if after is not None and (found := self.words_of([after])):
            return min(found), min(found), True
        return None

    def place(self, element: Element, gaps: tuple[int, int], forward: bool = False) -> _Placed:
        lo, hi = gaps
        wants = []
        for order, child in enumerate(element.children):
            want = self.wanted(child) or (lo, lo, True)
            a = min(max(want[0], lo), hi)
            wants.append((a, min(max(want[1], a), hi), order, child, want[2]))
        wants.sort(key=lambda w: (w[0], w[1] > w[0], w[2]))  # by their words; an empty one before a word there
        later: list[int | None] = [None] * len(wants)  # where the next sibling with words starts
        for i in range(len(wants) - 2, -1, -1):
            after = wants[i + 1]
            later[i] = after[0] if after[1] > after[0] else later[i + 1]
        children, cursor = [], lo
        for i, (a, z, _, child, forward) in enumerate(wants):
            a = max(a, cursor)
            if later[i] is not None and a < later[i] < z:
                z = later[i]
            z = max(z, a)
            children.append(self.place(child, (a, z), forward))
            cursor = z
        return _Placed(element, gaps, children, forward)


def _render(node: _Placed, text: str, starts: list[int], ends: list[int], lo: int, hi: int) -> str:
    """The node's tags around text[lo:hi] with its children inside; every character of text[lo:hi] is written
    once, in order, whatever the gaps say (they are clamped to what is left)."""
    out, cursor = [node.element.start_tag], lo
    for child in node.children:
        a, z = child.gaps
        if a == z:
            s = e = starts[a] if child.forward else ends[a]
        else:
            s, e = starts[a], ends[z]
        s = min(max(s, cursor), hi)
        e = min(max(e, s), hi)
        out.append(escape(text[cursor:s]))
        out.append(_render(child, text, starts, ends, s, e))
        cursor = e
    out.append(escape(text[cursor:hi]))
    out.append(node.element.end_tag)
    return "".join(out)
