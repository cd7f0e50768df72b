"""Glossaries: a user's terms translated their way, by lexically constrained beam search.

A `Glossary` is a list of (source term, target term) pairs, read from a TSV file (`Glossary.read`) or given as
pairs (`Glossary.from_pairs`). Where a source sentence contains a source term (`Glossary.targets_in`: whole words,
case as given, after NFKC), its target term must appear in the translation. Beam search makes it appear with
dynamic beam allocation (Post & Vilar 2018, as in Sockeye and fairseq's `LexicallyConstrainedBeamSearch`):

- each hypothesis tracks, per target term of its sentence, how many of the term's tokens it has just produced
  (`Terms.progress`); a term is met once all of them have been produced in a row and the next token does not
  continue the word (a whole word: "Bruder", never "Bruderer"), and stays met;
- each step's candidates are the plain search's best continuations, plus, for every hypothesis, the next token of
  each term it has not met and its own best token;
- the candidates are ranked into "banks" by how many term tokens they hold (of the terms met, and of the one
  furthest under way), and the beam is filled round robin
  over the banks, best first within each, so hypotheses that hold more of the terms keep a place in the beam
  although their log-probability is lower;
- a hypothesis may end (</s>) only once it has met every term, except at its length limit; there a hypothesis
  that missed a term ends too, and ranks after every one that met them all.

All of it stays on the device: the state is a few (rows, terms) tensors updated each step without reading them,
so a constrained search reads the device as often as a plain one. A batch none of whose sentences holds a term
is searched by the plain code path (`nmt.decoding.beam_search` with `terms=None`) and costs nothing extra.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from nmt.errors import NmtError

# --- Glossaries: reading and matching ---------------------------------------------------------------------------------

MAX_TERM_CHARS = 256  # the server's bound on a term's length (a file's terms are not bounded)


@dataclass(frozen=True)
class Glossary:
    """(source term, target term) pairs, each source term once. Hashable: requests that share one batch together."""

    pairs: tuple[tuple[str, str], ...]

    @classmethod
    def from_pairs(cls, pairs: Iterable, name: str = "glossary") -> Glossary:
        """Pairs given in Python or JSON (a dict, or [source, target] items); NmtError names the item (from 0)."""
        items = pairs.items() if isinstance(pairs, dict) else pairs
        out: list[tuple[str, str]] = []
        for i, pair in enumerate(items):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(t, str) for t in pair):
                raise NmtError(f"{name} item {i}: a term pair must be [source term, target term] (two strings), "
                               f"got {_shown(pair)}")
            out.append(_checked(pair[0], pair[1], f"{name} item {i}"))
        return cls(_unique(out, [f"{name} item {i}" for i in range(len(out))]))

    @classmethod
    def read(cls, path: str | Path) -> Glossary:
        """A TSV file: source term TAB target term, one pair a line (blank lines skipped). NmtError names the line."""
        from nmt.textfiles import utf8_lines  # (pyarrow's home: not loaded for a search)

        path = Path(path)
        try:
            with open(path, "rb") as f:
                lines = list(utf8_lines(f, path, keep_ends=False))
        except OSError as e:
            raise NmtError(f"{path}: cannot read the glossary ({e.strerror})") from None
        out, where = [], []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            columns = line.split("\t")
            if len(columns) != 2:
                raise NmtError(f"{path}:{n}: a glossary line is source term TAB target term; this one has "
                               f"{len(columns)} tab-separated column{'s' if len(columns) != 1 else ''}")
            out.append(_checked(columns[0], columns[1], f"{path}:{n}"))
            where.append(f"{path}:{n}")
        return cls(_unique(out, where))

    def __len__(self) -> int:
        return len(self.pairs)

    def targets_in(self, text: str) -> list[str]:
        """The target terms of the source terms that `text` holds, in the order they occur, each once.

        A source term matches as whole words (not inside a longer word: no letter, digit or _ on either side),
        with the case as given, after NFKC normalisation of both (as the tokenizer reads them); any run of
        whitespace in a term matches any run in the text. Where terms overlap, the leftmost wins, and of those
        starting there the longest.
        """
        return _matcher(self).targets_in(text) if self.pairs else []


def _checked(source: str, target: str, where: str) -> tuple[str, str]:
    source, target = source.strip(), target.strip()
    for side, term in (("source", source), ("target", target)):
        if not term:
            raise NmtError(f"{where}: the {side} term is empty; give source term TAB target term")
        if "\n" in term or "\r" in term or "\t" in term:
            raise NmtError(f"{where}: the {side} term {_shown(term)} holds a tab or line break")
    return source, target


def _unique(pairs: list[tuple[str, str]], where: list[str]) -> tuple[tuple[str, str], ...]:
    """Pairs with each source term once (a repeated identical pair is kept once); NmtError where one source term has
    two targets."""
    first: dict[str, int] = {}
    out = []
    for i, (source, target) in enumerate(pairs):
        key = _words(unicodedata.normalize("NFKC", source))
        if key in first:
            j = first[key]
            if pairs[j][1] != target:
                raise NmtError(f"{where[i]}: source term {_shown(source)} is given twice with different targets "
                               f"({_shown(pairs[j][1])} at {where[j]}, {_shown(target)} here); keep one")
            continue
        first[key] = i
        out.append((source, target))
    return tuple(out)


def _words(text: str) -> str:
    return " ".join(text.split())


class _Matcher:
    """A glossary's source terms (NFKC, whitespace runs as one space) in a character trie, and the target term of
    each. Matching walks the trie from each place a word may start, so it costs at most the text's length times
    the longest term's, whatever the number of terms (one regular expression of all the terms as alternatives
    cost seconds to compile for a few hundred long terms and backtracked on long sentences: issue 47, row 3).
    It remembers its last texts' matches: the server's preparing thread matches a request's sentences to price
    them, and the model's thread finds those matches instead of matching again."""

    END = ""  # the key under which a node holds the term that ends there (no character is "")

    def __init__(self, glossary: Glossary):
        self.target = {_words(unicodedata.normalize("NFKC", s)): t for s, t in glossary.pairs}
        self.root: dict = {}
        for term in self.target:
            node = self.root
            for char in term:
                node = node.setdefault(char, {})
            node[self.END] = term
        self.seen: dict[str, list[str]] = {}

    def targets_in(self, text: str) -> list[str]:
        if text in self.seen:
            return list(self.seen[text])
        words = _words(unicodedata.normalize("NFKC", text))
        found: dict[str, None] = {}
        start, n = 0, len(words)
        while start < n:
            end = None
            if start == 0 or not _is_word(words[start - 1]):
                node, i = self.root, start
                while i < n and (node := node.get(words[i])) is not None:
                    i += 1
                    if self.END in node and (i == n or not _is_word(words[i])):
                        end, term = i, node[self.END]
            if end is None:
                start += 1
            else:
                found[self.target[term]] = None
                start = end
        if len(self.seen) >= 1024:
            self.seen.clear()
        self.seen[text] = list(found)
        return list(found)


def _is_word(char: str) -> bool:
    """A character of a word, as a regular expression's \\w: a letter, digit or _."""
    return char.isalnum() or char == "_"


_MATCHERS: dict[Glossary, _Matcher] = {}


def _matcher(glossary: Glossary) -> _Matcher:
    """The glossary's matcher, kept for the glossaries in use."""
    if glossary not in _MATCHERS:
        if len(_MATCHERS) >= 64:
            _MATCHERS.clear()
        _MATCHERS[glossary] = _Matcher(glossary)
    return _MATCHERS[glossary]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- Constraints: the state of each hypothesis and its update ---------------------------------------------------------


class Terms:
    """The target terms (token ids) of a batch's sentences and, per search row, its progress through each.

    `terms[b]` lists sentence b's terms, each a non-empty list of target token ids. `joins` (V,) marks the target
    tokens that continue the word before them (a subword without the word-start mark): a term is met only once the
    token after its last one does not continue its word, so a term is met as a whole word ("Bruder", never
    "Bruderer"). Shapes: B sentences, C terms at most per sentence, L tokens at most per term, R rows of the search
    (one per sentence to begin with).

    `progress` (R, C) per term: 0 .. length - 1 while under way (its tokens just produced), length once all are
    (the next token decides: a joining one starts it over, any other makes it met), length + 1 once met.
    </s> may follow a term's last token, and makes it met.
    """

    def __init__(self, terms: list[list[list[int]]], device, joins: torch.Tensor | None = None):
        B, C = len(terms), max(1, max(len(t) for t in terms))
        L = max([len(ids) for ts in terms for ids in ts] or [1])
        ids = torch.full((B, C, L), -1, dtype=torch.long)  # -1 after a term's end: never a token
        length = torch.zeros(B, C, dtype=torch.long)  # 0: no term in this slot (met from the start)
        for b, ts in enumerate(terms):
            for c, term in enumerate(ts):
                ids[b, c, : len(term)] = torch.tensor(term, dtype=torch.long)
                length[b, c] = len(term)
        self.ids, self.length = ids.to(device), length.to(device)  # (B, C, L), (B, C)
        self.row_sent = torch.arange(B, device=device)  # (R,) sentence of each row
        self.progress = torch.zeros(B, C, dtype=torch.long, device=device)  # (R, C) see above
        self.joins = None if joins is None else joins.to(device)
        # (V,) what a joining token adds to lp after a term's last token: one outer-product update of lp costs a
        # tenth of a boolean mask over (R, V); `allocate` takes any total this low for -inf
        self.after_term = None if joins is None else torch.zeros(joins.shape, device=device).masked_fill(
            self.joins, torch.finfo(torch.float32).min)

    def next_ids(self, sent: torch.Tensor, progress: torch.Tensor) -> torch.Tensor:
        """(..., C) the token each term of sentence `sent` (...,) wants after `progress` (..., C): read from the flat
        (B*C*L,) ids by index arithmetic, never as a (..., C, L) copy (with the search's candidates as `...`, 256
        terms of 256 tokens would be gigabytes)."""
        C, L = self.ids.shape[1], self.ids.shape[2]
        at = (sent[..., None] * C + torch.arange(C, device=sent.device)) * L + progress.clamp(max=L - 1)
        return self.ids.view(-1)[at]

    def unmet(self) -> torch.Tensor:
        """(R,) how many of its sentence's terms each row has not met."""
        return self.progress.lt(self.length.index_select(0, self.row_sent)).sum(1)

    def restrict(self, lp: torch.Tensor, at_limit: torch.Tensor, eos: int) -> torch.Tensor:
        """lp (R, V) with </s> made impossible for rows that have not produced all their terms, unless at their
        length limit (`at_limit` (R,)); after a term's last token, no token that would continue its word, but the
        next token of another term under way (a term may hold another: "Bruderschaft" and "Bruder"). In place."""
        lp[:, eos] = lp[:, eos].masked_fill(self.unmet().gt(0) & ~at_limit, -torch.inf)
        if self.after_term is None:
            return lp
        length = self.length.index_select(0, self.row_sent)
        wanted = self.next_ids(self.row_sent, self.progress).clamp(min=0)  # (R, C)
        under_way = self.progress.gt(0) & self.progress.lt(length)
        keep = (wanted[:, :, None].eq(wanted[:, None, :]) & under_way[:, None, :]).any(2)  # (R, C) wanted by one
        before = lp.gather(1, wanted)
        ended = (self.progress.eq(length) & length.gt(0)).any(1)  # (R,) a term's last token was the row's last
        lp.addr_(ended.to(lp.dtype), self.after_term.to(lp.dtype))  # lp += ended (x) after_term
        lp.scatter_(1, wanted, torch.where(keep, before, lp.gather(1, wanted)))  # equal ids: equal values
        return lp

    def advance(self, progress: torch.Tensor, sent: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """Progress (..., C) of rows of sentences `sent` (...,) after they emit `tok` (...,): a met term stays met;
        after its last token, a token that does not continue the word makes it met, one that does starts it over;
        the next token of a term moves it on; its first token starts it afresh; any other token starts it over."""
        length = self.length[sent]  # (..., C)
        wanted = self.next_ids(sent, progress)  # (..., C)
        y = tok[..., None]
        again = y.eq(self.ids[:, :, 0][sent]).long()  # a term's first token
        moved = torch.where(y.eq(wanted), progress + 1, again)
        joins = torch.zeros_like(y, dtype=torch.bool) if self.joins is None else self.joins[tok][..., None]
        decided = torch.where(joins, again, length + 1)  # the token after a term's last one
        return torch.where(progress.gt(length) | length.eq(0), progress,
                           torch.where(progress.eq(length), decided, moved))

    def allocate(self, scores: torch.Tensor, lp: torch.Tensor, sent: torch.Tensor, top: torch.Tensor,
                 beam: torch.Tensor, tok: torch.Tensor, at_limit: torch.Tensor, eos: int, k: int) -> tuple:
        """The step's candidates that end, and those that go on in dynamic beam allocation's order.

        scores (N, W) prefix log-probabilities of the N sentence groups `sent` (N,), lp (N*W, V) next-token
        log-probabilities, the plain search's best continuations top/beam/tok (N, n), and which rows are at their
        length limit (N*W,). Adds each row's next token of every term it has not met and its own best token; drops
        repeated (row, token) candidates; ranks them round robin over banks (the term tokens a candidate holds,
        most first), best first within a bank.

        Returns ((top, beam, ends), (top, beam, tok)): all candidates (N, M) best bank first, with whether each
        ends a hypothesis (its </s> ranks within the `k` best candidates that hold every term, as the plain search
        ends one within its `k` best of all; or its row is at the limit); and the n first in allocation's order.
        """
        N, W = scores.shape
        n, dev = top.shape[1], top.device
        C = self.progress.shape[1]
        wanted = self.next_ids(self.row_sent, self.progress)  # (N*W, C) next token per term
        open_ = self.progress.lt(self.length.index_select(0, self.row_sent))
        term_lp = lp.gather(1, wanted.clamp(min=0)).masked_fill(~open_, -torch.inf)  # (N*W, C)
        best_lp, best_tok = lp.max(1)  # (N*W,)
        flat = scores.reshape(N * W, 1)
        top = torch.cat([top, (flat + term_lp).view(N, W * C), (flat + best_lp[:, None]).view(N, W)], 1)  # (N, M)
        row = torch.arange(W, device=dev)
        beam = torch.cat([beam, row.repeat_interleave(C).expand(N, W * C), row.expand(N, W)], 1)
        tok = torch.cat([tok, wanted.clamp(min=0).view(N, W * C), best_tok.view(N, W)], 1)
        top = top.masked_fill(top.lt(torch.finfo(top.dtype).min / 2), -torch.inf)  # what `restrict` ruled out
        # the same (row, token) twice: keep one (the copies that are possible have the same score)
        key, order = ((beam * lp.shape[1] + tok) * 2 + top.isneginf().long()).sort(1)
        again = torch.zeros_like(key, dtype=torch.bool)
        again[:, 1:] = key[:, 1:].eq(key[:, :-1])
        top = top.masked_fill(torch.zeros_like(again).scatter(1, order, again), -torch.inf)
        # banks: the tokens of met terms each candidate holds once it takes its token, and of the one term furthest
        # under way (counting every term under way would let a word that starts two terms count twice forever)
        rows = torch.arange(N, device=dev)[:, None] * W + beam  # (N, M)
        progress = self.advance(self.progress[rows], sent[:, None].expand_as(tok), tok)  # (N, M, C)
        length = self.length.index_select(0, sent)[:, None, :]  # (N, 1, C)
        met = progress.gt(length) | length.eq(0)
        held = length.masked_fill(~met, 0).sum(2) + progress.masked_fill(met, 0).amax(2)  # (N, M)
        held = held.masked_fill(~top.isfinite(), -1)
        most = int(self.ids.shape[1] * self.ids.shape[2]) + 2
        by_score = top.argsort(dim=1, descending=True, stable=True)
        by_bank = held.gather(1, by_score).argsort(dim=1, descending=True, stable=True)
        ranked = by_score.gather(1, by_bank)  # (N, M) candidates by bank, then score
        bank = held.gather(1, ranked)
        pos = torch.arange(ranked.shape[1], device=dev).expand_as(ranked)
        first = torch.cat([torch.ones_like(bank[:, :1], dtype=torch.bool), bank[:, 1:].ne(bank[:, :-1])], 1)
        start = torch.where(first, pos, 0).cummax(1).values  # (N, M) where each candidate's bank begins
        turn = (pos - start) * most + (most - 1 - bank)  # round robin over the banks, most term tokens first
        turn = turn.masked_fill(bank.lt(0), most * ranked.shape[1] * 2)
        chosen = ranked.gather(1, turn.argsort(dim=1, stable=True)[:, :n])  # (N, n)
        every = self.length.index_select(0, sent).sum(1, keepdim=True)  # (N, 1) the tokens of all the terms
        limit = at_limit.view(N, W).gather(1, beam.gather(1, ranked))
        ends = tok.gather(1, ranked).eq(eos) & bank.ge(0) & ((bank.eq(every) & (pos - start).lt(k)) | limit)
        return ((top.gather(1, ranked), beam.gather(1, ranked), ends),
                (top.gather(1, chosen), beam.gather(1, chosen), tok.gather(1, chosen)))

    def update(self, rows: torch.Tensor, last: torch.Tensor) -> None:
        """The search continues with rows `rows` (R',) of the current ones, which emitted `last` (R',)."""
        self.row_sent = self.row_sent.index_select(0, rows)
        self.progress = self.advance(self.progress.index_select(0, rows), self.row_sent, last)

    def keep(self, rows: torch.Tensor) -> None:
        """Only rows `rows` of the current ones go on (finished sentences leave)."""
        self.row_sent, self.progress = self.row_sent.index_select(0, rows), self.progress.index_select(0, rows)


def going_first(top: torch.Tensor, tok: torch.Tensor, eos: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(top, pick), each (N, k): the first k candidates in allocation order that do not end, by position in
    top/tok (N, n); where fewer than k do not end, ending ones fill the beam at -inf."""
    ends = tok.eq(eos)
    order = torch.arange(tok.shape[1], device=tok.device) + ends.long() * tok.shape[1]
    pick = order.expand_as(tok).topk(k, dim=1, largest=False).indices
    return top.masked_fill(ends, -torch.inf).gather(1, pick), pick
