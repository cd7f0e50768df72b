"""The engines a Translator decodes with (nmt.engines): nmt's own search supports every feature, an ensemble all but
the attention picture of one model, a CTranslate2 export searching and placing markup only; the Translator asks
the engine and names what a call needs instead of failing inside it. What each engine finds is tested where its
search is (test_decoding, test_translate, test_ct2)."""

import pytest
from helpers import model_dir, one_thread  # noqa: F401  (one_thread: module-wide)

from nmt.engines import ATTENTION, GLOSSARY, SCORE, TARGET_CHOICE, TorchEngine
from nmt.errors import NmtError
from nmt.translate import Translator

FEATURES = (GLOSSARY, SCORE, ATTENTION, TARGET_CHOICE)


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("engines") / "model")


def test_nmt_search_supports_everything_and_an_ensemble_all_but_one_models_picture(directory):
    one = Translator.from_pretrained(directory)
    both = Translator.from_pretrained([directory, directory])
    assert isinstance(one.engine, TorchEngine) and one.backend == "torch"
    assert all(one.engine.supports(f) for f in FEATURES)
    assert [f for f in FEATURES if not both.engine.supports(f)] == [ATTENTION]
    with pytest.raises(NmtError, match="attention pictures need one PyTorch model"):
        both.attention("a b c", beam_size=1)
    assert both.translate(["a b c"], beam_size=1) == one.translate(["a b c"], beam_size=1)  # same weights twice


def test_a_ctranslate2_export_names_what_needs_nmts_own_search(directory, tmp_path):
    pytest.importorskip("ctranslate2")
    from nmt.ct2 import export_ctranslate2

    ct2 = Translator.from_ctranslate2(export_ctranslate2(directory, tmp_path / "ct2"))
    assert ct2.backend == "ctranslate2" and not any(ct2.engine.supports(f) for f in FEATURES)
    assert ct2.translate(["a b c"], beam_size=1) == Translator.from_pretrained(directory).translate(["a b c"],
                                                                                                   beam_size=1)
    with pytest.raises(NmtError, match="scoring needs the PyTorch model"):
        ct2.score(["a b c"], ["a b"])
    with pytest.raises(NmtError, match="attention pictures need one PyTorch model"):
        ct2.attention("a b c")
    with pytest.raises(NmtError, match="a glossary needs nmt's own beam search"):
        ct2.translate(["a b c"], glossary=[["a", "b"]])
    with pytest.raises(NmtError, match="with_pytorch pairs a CTranslate2 export with a PyTorch model"):
        Translator.from_pretrained(directory).with_pytorch(ct2)
