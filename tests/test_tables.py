"""A Dataset read through its Arrow table (nmt.tables): batches, rows and columns are the dataset's own, of
selections too, and no row is formatted one by one."""


from helpers import PAIRS, read_all
from hypothesis import given, settings
from hypothesis import strategies as st

from nmt.data import prepare
from tests.conftest import write_pairs

# --- whole-column cleaning, overlap, mixing, sampling ------------------------------------------------


class RowFormatting:
    """Counts rows formatted one at a time by `datasets` (what iterating a Dataset or a Column does)."""

    def __init__(self, monkeypatch):
        from datasets.formatting import formatting

        self.calls = 0
        todo = [formatting.Formatter]
        while todo:
            cls = todo.pop()
            todo += cls.__subclasses__()
            if "format_row" in vars(cls):
                monkeypatch.setattr(cls, "format_row", self._counted(vars(cls)["format_row"]))

    def _counted(self, fn):
        def format_row(formatter, table):
            self.calls += 1
            return fn(formatter, table)
        return format_row


def test_no_dataset_row_is_formatted_one_by_one(corpus_dir, tmp_path, monkeypatch):
    """Preparation, the training sampler's inputs and `nmt check` read columns as Arrow/NumPy, never rows."""
    from nmt.batching import TokenBatchSampler
    from nmt.encoding import pair_lengths
    from nmt.tables import column
    from nmt.tools.check import preflight
    from tests.conftest import tiny_config

    counter = RowFormatting(monkeypatch)
    cfg = tiny_config(corpus_dir, tmp_path)
    for _ in range(2):  # cold, then from the cache
        corpus = prepare(cfg.data, cfg.tokenizer)
        TokenBatchSampler(column(corpus.splits["train"], "cost"), 400, ties=pair_lengths(corpus.splits["train"])[0]).plan(0)
    preflight(cfg, probe_steps=0)
    assert counter.calls == 0
    assert corpus.splits["train"][0]["src_ids"] and counter.calls == 1  # the counter sees row formatting


def _arrow_file(tmp_path, sizes):
    """A memory-mapped Dataset over an Arrow stream of our own, written in batches of `sizes` rows."""
    import pyarrow as pa

    from nmt.tables import open_arrow
    from nmt.textfiles import write_arrow

    bounds, batches = [0], []
    for size in sizes:
        rows = range(bounds[-1], bounds[-1] + size)
        batches.append(pa.record_batch([pa.array([f"s{i}" for i in rows], pa.string()),
                                        pa.array([f"t{i} " * 20 for i in rows], pa.string())], names=["src", "tgt"]))
        bounds.append(bounds[-1] + size)
    path = tmp_path / f"pairs-{'-'.join(map(str, sizes))}.arrow"
    if not path.exists():
        write_arrow(iter(batches), path)
    return open_arrow(path, path.stem), path


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5), batch_size=st.integers(1, 12), data=st.data())
def test_batches_rows_and_columns_are_the_datasets_own(tmp_path_factory, sizes, batch_size, data):
    """arrow_batches, rows and column read a memory-mapped file of ours, and selections of it, as datasets reads
    them row by row; a pickled Dataset re-opens the file by its path."""
    import pickle

    import numpy as np

    from nmt.tables import arrow_batches, rows

    ds, _ = _arrow_file(tmp_path_factory.getbasetemp(), sizes)
    n = len(ds)
    picked = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=n)) if n else []
    for view in (ds, ds.select(picked), pickle.loads(pickle.dumps(ds.select(picked)))):
        expected = [(r["src"], r["tgt"]) for r in view]
        streamed = [t.to_pydict() for t in arrow_batches(view, batch_size)]
        assert [p for t in streamed for p in zip(t["src"], t["tgt"])] == expected
        assert all(len(t["src"]) == batch_size for t in streamed[:-1])
        idx = np.array(data.draw(st.lists(st.integers(0, len(view) - 1), max_size=8)) if len(view) else [], np.int64)
        assert rows(view, idx) == [expected[i] for i in idx]


def test_a_column_of_a_selection_is_the_datasets_own(tmp_path):
    from nmt.encoding import pair_lengths
    from nmt.tables import column

    write_pairs(tmp_path / "train", PAIRS, "en", "fr")
    train = read_all(tmp_path, tmp_path / "train").splits["train"]
    picked = train.select(list(range(len(train)))[::-2])
    assert column(picked, "cost").tolist() == picked["cost"]
    assert [a.tolist() for a in pair_lengths(picked)] == [picked["src_len"], picked["tgt_len"]]
