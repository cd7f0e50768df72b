"""The sizes a run trains with: what `auto_sizes` leaves to the corpus, and vocabulary sizes from the tokenizer.
One home for `nmt train` and `nmt check`, so the check plans exactly the model training builds."""

from __future__ import annotations

import dataclasses

from nmt.config import TrainConfig, resolve_sizes


def sized_config(cfg: TrainConfig, corpus) -> tuple[TrainConfig, list[str]]:
    """`cfg` with every size resolved, and the sizes chosen for it (printable; empty when all were given).

    The tokenizer and model sizes it leaves null are chosen from the number of training pairs (`auto_sizes`);
    the model's vocabulary sizes come from `corpus.tokenizer`, and embeddings are shared only when it is joint.
    """
    cfg, chosen = resolve_sizes(cfg, corpus.stats["sizing_pairs"])
    tokenizer = corpus.tokenizer
    model_cfg = dataclasses.replace(cfg.model, src_vocab_size=tokenizer.src_vocab_size,
                                    tgt_vocab_size=tokenizer.tgt_vocab_size,
                                    share_embeddings=cfg.model.share_embeddings and tokenizer.joint)
    return dataclasses.replace(cfg, model=model_cfg), chosen
