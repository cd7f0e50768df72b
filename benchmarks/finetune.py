"""Domain adaptation from a pretrained model: an OPUS-MT-style Marian model, trained on one domain, adapted to a
second with the same budget three ways, each the command a user runs.

    python benchmarks/finetune.py --data ../shared/data/tatoeba-en-de --work /tmp/ft-bench --minutes 10 \
        [--base-minutes 55] [--threads N]

1. The domains. The corpus's train, valid and test pairs are pooled; domain B (the new one) is every pair whose
   source names one of `--words` as a whole word (Tatoeba: Tom or Mary, about a quarter of the pairs: stories told
   in the third person about two people, past tenses, "Tom told Mary that ..."), domain A (the old one) the rest
   (mostly first and second person: "I ...", "You ...", questions and commands). Each domain is dealt into
   train / valid / test by English sentence (a sentence with several translations stays in one split), seeded.
   The splits are written under WORK/domains/{a,b}; nothing is written next to the corpus.
2. The start: a Marian model as OPUS-MT-train ships one, built offline: source.spm and target.spm trained by
   spm_train with its defaults (unigram, character coverage 0.9995), one vocab.json counted from both encoded
   sides as marian-vocab counts (</s> 0, <unk> 1, then by frequency, <pad> last), MarianTokenizer.save_pretrained,
   and a MarianMTModel (swish, scaled embeddings, sinusoidal positions, tied embeddings; pad is the last id and
   starts the decoder) trained on domain A's train for `--base-minutes` with the HF baseline recipe of
   benchmarks/hf_baseline.py (AdamW 5e-4 (0.9, 0.98), inverse-sqrt warmup, label smoothing 0.1, clipping 1.0,
   length-bucketed batches, validation loss after every epoch with the best weights kept) at its size (d_model
   256, 3+3 layers, 4,096-token batches, 1,000 warmup steps) and under bf16 autocast (HF's `--bf16`), 2,000
   pieces a side. A pretrained model is trained far longer than it is adapted: 55 minutes of one core give
   1,400-2,500 steps (18-32 epochs of A) on the CPUs measured; ten minutes of d128 with 2+2 layers
   (`--base-size 128,2,4,512 --base-max-tokens 1024 --base-warmup 200`) gave a start too weak to measure
   fine-tuning with (docs/results.md).
   It is saved as huggingface_hub lays out a download, WORK/hub/models--nmt-bench--opus-mt-en-de/.
3. On domain B, `--minutes` each, with HF_HUB_CACHE=WORK/hub and HF_HUB_OFFLINE=1:
   (a) `nmt import nmt-bench/opus-mt-en-de` and README's fine-tuning command (`nmt train --init_from ...`);
   (b) the same with `--finetune.lora_r 8`;
   (c) README's own-corpus command from scratch (benchmarks/quality.py's user_command).
4. `nmt evaluate` (beam 4) of the start and of each run on domain B's test set (the new domain) and domain A's
   (the old one: what fine-tuning forgot). One table, then the two floor checks: (a) - (c) on the new domain, and
   (a) - start on the old one.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from hf_baseline import BaselineConfig  # noqa: E402
from quality import run_user_command, user_command  # noqa: E402

REPO_ID = "nmt-bench/opus-mt-en-de"
SPLITS = ("train", "valid", "test")


# --- 1. the domains --------------------------------------------------------------------------------------------------

def read_pairs(folder: Path, split: str, src: str, tgt: str) -> list[tuple[str, str]]:
    s = (folder / f"{split}.{src}").read_text(encoding="utf-8").splitlines()
    t = (folder / f"{split}.{tgt}").read_text(encoding="utf-8").splitlines()
    if len(s) != len(t):
        raise SystemExit(f"{folder}/{split}.{src} has {len(s)} lines but {split}.{tgt} has {len(t)}")
    return list(zip(s, t))


def write_pairs(folder: Path, split: str, src: str, tgt: str, pairs: list[tuple[str, str]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for lang, i in ((src, 0), (tgt, 1)):
        tmp = folder / f".{split}.{lang}.tmp"
        tmp.write_text("".join(p[i] + "\n" for p in pairs), encoding="utf-8")
        tmp.replace(folder / f"{split}.{lang}")


def deal(pairs: list[tuple[str, str]], held_out: int, seed: int) -> dict[str, list[tuple[str, str]]]:
    """Train / valid / test by source sentence, seeded: `held_out` pairs of test, half as many of valid (at most a
    fifth of the pairs each), the rest train; all translations of one source sentence land in one split."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for p in pairs:
        groups.setdefault(p[0], []).append(p)
    keys = sorted(groups)
    random.Random(seed).shuffle(keys)
    n_test = min(held_out, len(pairs) // 5)
    n_valid = min(held_out // 2, len(pairs) // 5)
    out: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    for key in keys:
        split = "test" if len(out["test"]) < n_test else "valid" if len(out["valid"]) < n_valid else "train"
        out[split].extend(groups[key])
    return out


def make_domains(data: Path, work: Path, src: str, tgt: str, words: list[str], held_out: int,
                 seed: int) -> dict[str, Path]:
    """Domain B: pairs whose source holds one of `words` as a whole word; domain A: the others. Written under
    WORK/domains/{a,b}/{train,valid,test}.{src,tgt}; returns the two folders."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, words)) + r")\b")
    pooled = [p for split in SPLITS for p in read_pairs(data, split, src, tgt)]
    b = [p for p in pooled if pattern.search(p[0])]
    a = [p for p in pooled if not pattern.search(p[0])]
    folders = {}
    for name, pairs in (("a", a), ("b", b)):
        folder = work / "domains" / name
        for split, part in deal(pairs, held_out, seed).items():
            write_pairs(folder, split, src, tgt, part)
        folders[name] = folder
        sizes = ", ".join(f"{s} {len(read_pairs(folder, s, src, tgt))}" for s in SPLITS)
        print(f"domain {name.upper()} ({'source names ' + ' or '.join(words) if name == 'b' else 'the rest'}): "
              f"{sizes} pairs, {folder}", flush=True)
    return folders


# --- 2. the start: an OPUS-MT-style Marian model ---------------------------------------------------------------------

def opus_mt_tokenizer(d: Path, pairs: list[tuple[str, str]], vocab_size: int):
    """source.spm and target.spm by spm_train with its defaults, vocab.json counted from the encoded corpus as
    marian-vocab counts (so <s> and pieces the corpus never produces are absent), MarianTokenizer saved in `d`."""
    import sentencepiece as spm
    from transformers import MarianTokenizer

    d.mkdir(parents=True, exist_ok=True)
    counts: Counter = Counter()
    for side, i in (("source", 0), ("target", 1)):
        spm.SentencePieceTrainer.train(sentence_iterator=iter([p[i] for p in pairs]), model_prefix=str(d / side),
                                       vocab_size=vocab_size, minloglevel=2)
        (d / f"{side}.model").replace(d / f"{side}.spm")
        (d / f"{side}.vocab").unlink()
        processor = spm.SentencePieceProcessor(model_file=str(d / f"{side}.spm"))
        for pieces in processor.encode([p[i] for p in pairs], out_type=str):
            counts.update(pieces)
    vocab = {"</s>": 0, "<unk>": 1}
    for piece, _ in counts.most_common():
        vocab.setdefault(piece, len(vocab))
    vocab["<pad>"] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tok = MarianTokenizer(source_spm=str(d / "source.spm"), target_spm=str(d / "target.spm"),
                          vocab=str(d / "vocab.json"))
    tok.save_pretrained(d)
    return tok


def encode(tok, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(source ids, target ids), each ending in </s>, as MarianTokenizer gives them."""
    src = tok([p[0] for p in pairs], truncation=True, max_length=256)["input_ids"]
    tgt = tok(text_target=[p[1] for p in pairs], truncation=True, max_length=256)["input_ids"]
    return list(zip(src, tgt))


def collate(rows: list[tuple[list[int], list[int]]], pad: int) -> dict:
    """Padded input_ids, labels (-100 at padding) and decoder inputs (labels shifted right behind pad, Marian's
    decoder start)."""
    import torch

    S, T = max(len(s) for s, _ in rows), max(len(t) for _, t in rows)
    src = torch.full((len(rows), S), pad)
    labels = torch.full((len(rows), T), -100)
    dec_in = torch.full((len(rows), T), pad)
    for i, (s, t) in enumerate(rows):
        src[i, :len(s)] = torch.tensor(s)
        labels[i, :len(t)] = torch.tensor(t)
        dec_in[i, 1:len(t)] = torch.tensor(t[:-1])
    return {"input_ids": src, "attention_mask": src.ne(pad), "decoder_input_ids": dec_in,
            "decoder_attention_mask": labels.ne(-100), "labels": labels}


def batches(rows: list[tuple[list[int], list[int]]], max_tokens: int, seed: int | None) -> list:
    """nmt's length-bucketed batches (cost max(source, target), ties by source length), as the HF baseline makes."""
    import numpy as np

    from nmt.batching import global_batches

    cost = np.asarray([max(len(s), len(t)) for s, t in rows], dtype=np.int64)
    ties = np.asarray([len(s) for s, _ in rows], dtype=np.int64)
    return global_batches(cost, max_tokens, 1, seed, ties=ties)


def train_marian(d: Path, tok, train, valid, minutes: float, cfg: BaselineConfig, log=print, bf16: bool = False):
    """A MarianMTModel as OPUS-MT configures one, trained with the HF baseline's recipe for `minutes` of wall time
    (validation included), the epoch with the best validation loss kept; saved in `d` in fp32. `bf16`: the steps
    under bf16 autocast, as HF's Trainer runs them with `--bf16`. Returns (steps, epochs, seconds)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    V = len(tok.get_vocab())
    pad = tok.pad_token_id
    config = MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=cfg.d_model, encoder_layers=cfg.layers,
        decoder_layers=cfg.layers, encoder_attention_heads=cfg.heads, decoder_attention_heads=cfg.heads,
        encoder_ffn_dim=cfg.ffn, decoder_ffn_dim=cfg.ffn, activation_function="swish", dropout=cfg.dropout,
        attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, max_position_embeddings=512,
        pad_token_id=pad, eos_token_id=tok.eos_token_id, decoder_start_token_id=pad,
        forced_eos_token_id=tok.eos_token_id, share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    torch.manual_seed(cfg.seed)
    model = MarianMTModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
    warmup = cfg.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, math.sqrt(warmup / (s + 1))))
    ce = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing, ignore_index=-100)
    valid_batches = [collate([valid[int(i)] for i in b], pad) for b in batches(valid, cfg.max_tokens, None)]

    @torch.no_grad()
    def valid_nll() -> float:
        model.eval()
        total, count = 0.0, 0
        for batch in valid_batches:
            n = int(batch["labels"].ne(-100).sum())
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                total += float(model(**batch).loss) * n  # HF's loss: mean token NLL, no smoothing
            count += n
        model.train()
        return total / max(count, 1)

    best, best_state, steps, epochs = math.inf, None, 0, 0
    budget, t0 = minutes * 60, time.perf_counter()
    model.train()
    while time.perf_counter() - t0 < budget:
        for order in batches(train, cfg.max_tokens, cfg.seed + epochs):
            batch = collate([train[int(i)] for i in order], pad)
            labels = batch.pop("labels")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(**batch, use_cache=False).logits
            loss = ce(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            if steps % 100 == 0:
                log(f"  base: step {steps}, loss {float(loss.detach()):.3f} ({(time.perf_counter() - t0) / 60:.1f} min)")
            if time.perf_counter() - t0 >= budget:
                break
        else:
            epochs += 1
        nll = valid_nll()
        log(f"  base: step {steps}, epoch {epochs}, valid nll {nll:.3f} ({(time.perf_counter() - t0) / 60:.1f} min)")
        if nll < best:
            best, best_state = nll, copy.deepcopy(model.state_dict())
    seconds = time.perf_counter() - t0
    model.load_state_dict(best_state)
    model.generation_config.update(max_length=512, num_beams=4, bad_words_ids=[[pad]])  # as OPUS-MT ships them
    model.eval().save_pretrained(d)
    return steps, epochs, seconds


def hub_cache_entry(cache: Path, repo_id: str, files_from: Path) -> Path:
    """The files of `files_from` as huggingface_hub lays out a download in the cache `cache`: blobs/<sha256>,
    snapshots/<commit>/<name> linking to its blob, refs/main naming the commit. Returns the snapshot folder."""
    files = sorted(p for p in files_from.iterdir() if p.is_file())
    commit = hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        blob = hashlib.sha256(p.read_bytes()).hexdigest()
        (repo / "blobs" / blob).write_bytes(p.read_bytes())
        link = snapshot / p.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.join("..", "..", "blobs", blob))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def build_base(domain_a: Path, work: Path, src: str, tgt: str, minutes: float, cfg: BaselineConfig,
               spm_vocab: int, bf16: bool = False) -> dict:
    """The start, trained on domain A and saved as the Hub cache entry REPO_ID under WORK/hub, its figures in
    WORK/base/base.json. A start built before in WORK with the same settings is kept: the adaptations can be rerun
    (with WORK/runs removed) without training it again."""
    import torch  # noqa: F401  (transformers' torch backend)

    folder = work / "base"
    settings = {"minutes": minutes, "spm_vocab": spm_vocab, "bf16": bf16, "recipe": vars(cfg)}
    record = folder / "base.json"
    if record.is_file() and (work / "hub").is_dir():
        saved = json.loads(record.read_text())
        if saved.get("settings") == json.loads(json.dumps(settings)):
            print(f"base: the start built before in {folder} ({saved['steps']} steps, {saved['epochs']} epochs in "
                  f"{saved['minutes']:.1f} min), kept", flush=True)
            return saved
    t0 = time.perf_counter()
    train = read_pairs(domain_a, "train", src, tgt)
    tok = opus_mt_tokenizer(folder, train, spm_vocab)
    encoded_train, encoded_valid = encode(tok, train), encode(tok, read_pairs(domain_a, "valid", src, tgt))
    print(f"base: OPUS-MT tokenizer (spm_train, {spm_vocab} pieces a side; vocab.json {len(tok.get_vocab())}) and "
          f"encoding in {time.perf_counter() - t0:.0f} s; MarianMTModel d{cfg.d_model}, {cfg.layers}+{cfg.layers} "
          f"layers, HF baseline recipe ({cfg.max_tokens}-token batches, {cfg.warmup_steps} warmup steps"
          f"{', bf16 autocast' if bf16 else ''}), {minutes:g} min on domain A", flush=True)
    steps, epochs, seconds = train_marian(folder, tok, encoded_train, encoded_valid, minutes, cfg,
                                          log=lambda line: print(line, flush=True), bf16=bf16)
    snapshot = hub_cache_entry(work / "hub", REPO_ID, folder)
    print(f"base: {steps} steps, {epochs} epochs in {seconds / 60:.1f} min; Hub cache entry {snapshot}", flush=True)
    base = {"steps": steps, "epochs": epochs, "minutes": seconds / 60, "settings": settings}
    record.write_text(json.dumps(base, indent=1))
    return base


# --- 3. the three ways, 4. scoring -----------------------------------------------------------------------------------

def nmt(argv: list[str], env: dict) -> str:
    """`nmt ...` with the nmt next to this Python; its output printed and returned."""
    exe = Path(sys.executable).with_name("nmt")
    print("$ " + " ".join(argv), flush=True)
    proc = subprocess.run([str(exe) if exe.is_file() else argv[0], *argv[1:]], env={**os.environ, **env},
                          capture_output=True, text=True)
    print(proc.stdout + proc.stderr, end="", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed with exit code {proc.returncode}")
    return proc.stdout


def evaluate(model: Path, domain: Path, src: str, tgt: str, env: dict) -> dict:
    """`nmt evaluate MODEL` (beam 4) on the domain's test set: {"bleu", "chrf"}."""
    out = nmt(["nmt", "evaluate", str(model), "--src", f"{domain}/test.{src}", "--ref", f"{domain}/test.{tgt}",
               "--beam", "4"], env)
    return {m.group(1).lower(): float(m.group(2)) for m in re.finditer(r"^(BLEU|chrF) ([\d.]+)", out, re.M)}


def finetune_command(model: Path, data: Path, src: str, tgt: str, minutes: float, output: Path) -> list[str]:
    """README's fine-tuning command ("Start from a pretrained model") for this model, corpus and budget."""
    return ["nmt", "train", "--init_from", str(model), "--data.train", f"{data}/train", "--data.valid",
            f"{data}/valid", "--data.src_lang", src, "--data.tgt_lang", tgt, "--max_minutes", f"{minutes:g}",
            "--output_dir", str(output)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="folder with train/valid/test.<src>/<tgt> (read only)")
    p.add_argument("--work", required=True, help="folder for the domains, the Hub cache and the runs")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--minutes", type=float, default=10.0, help="each adaptation's budget (wall clock)")
    p.add_argument("--base-minutes", type=float, default=55.0, help="the start's training on domain A")
    p.add_argument("--threads", type=int, default=0, help="torch threads of every step (0: torch's default)")
    p.add_argument("--words", default="Tom,Mary", help="domain B: pairs whose source names one of these")
    p.add_argument("--held-out", type=int, default=1000, help="test pairs per domain (valid: half as many)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--spm-vocab", type=int, default=2000, help="pieces of each SentencePiece model of the start")
    p.add_argument("--base-size", default="256,3,4,1024", help="the start's d_model,layers,heads,ffn")
    p.add_argument("--base-max-tokens", type=int, default=4096, help="the start's batch, in tokens")
    p.add_argument("--base-warmup", type=int, default=1000, help="the start's warmup steps")
    p.add_argument("--base-bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="the start's steps under bf16 autocast (HF's --bf16)")
    args = p.parse_args()
    import torch

    work = Path(args.work).resolve()
    if (work / "runs").exists():
        raise SystemExit(f"{work / 'runs'} exists: give a new --work folder (the runs write into empty ones)")
    env = {"HF_HUB_CACHE": str(Path(args.work).resolve() / "hub"), "HF_HUB_OFFLINE": "1"}
    if args.threads:
        torch.set_num_threads(args.threads)
        env["OMP_NUM_THREADS"] = str(args.threads)
    runs = work / "runs"
    start = time.perf_counter()
    domains = make_domains(Path(args.data), work, args.src, args.tgt, args.words.split(","), args.held_out,
                           args.seed)
    d_model, layers, heads, ffn = map(int, args.base_size.split(","))
    base = build_base(domains["a"], work, args.src, args.tgt, args.base_minutes,
                      BaselineConfig(d_model=d_model, layers=layers, heads=heads, ffn=ffn,
                                     max_tokens=args.base_max_tokens, warmup_steps=args.base_warmup), args.spm_vocab,
                      args.base_bf16)

    imported = runs / "opus"
    nmt(["nmt", "import", REPO_ID, str(imported)], env)
    systems = {"start (imported)": (imported, base["minutes"])}
    commands = {
        "(a) fine-tuned": finetune_command(imported, domains["b"], args.src, args.tgt, args.minutes, runs / "ft"),
        "(b) LoRA r8": finetune_command(imported, domains["b"], args.src, args.tgt, args.minutes, runs / "lora")
        + ["--finetune.lora_r", "8"],
        "(c) from scratch": user_command(domains["b"], args.src, args.tgt, args.minutes, runs / "scratch"),
    }
    for name, argv in commands.items():
        output = Path(argv[argv.index("--output_dir") + 1])
        systems[name] = (output / "model", run_user_command(argv, env)["minutes"])

    scores = {name: {dom: evaluate(model, domains[dom], args.src, args.tgt, env) for dom in ("b", "a")}
              for name, (model, _) in systems.items()}
    table = [f"{'system':<18}{'new BLEU':>9}{'new chrF':>9}{'old BLEU':>9}{'old chrF':>9}{'minutes':>9}"]
    for name, (_, minutes) in systems.items():
        s = scores[name]
        table.append(f"{name:<18}{s['b']['bleu']:>9.2f}{s['b']['chrf']:>9.2f}{s['a']['bleu']:>9.2f}"
                     f"{s['a']['chrf']:>9.2f}{minutes:>9.1f}")
    gain = scores["(a) fine-tuned"]["b"]["bleu"] - scores["(c) from scratch"]["b"]["bleu"]
    forgot = scores["(a) fine-tuned"]["a"]["bleu"] - scores["start (imported)"]["a"]["bleu"]
    print(f"\nnew domain: B test ({domains['b']}/test); old domain: A test ({domains['a']}/test); nmt evaluate, "
          f"beam 4; adaptation budget {args.minutes:g} min each, the start {args.base_minutes:g} min on A")
    print("\n".join(table))
    print(f"floor 1, (a) - (c) on the new domain: {gain:+.2f} BLEU (needs >= +3): {'met' if gain >= 3 else 'MISSED'}")
    print(f"floor 2, (a) - start on the old domain: {forgot:+.2f} BLEU (needs >= -2): "
          f"{'met' if forgot >= -2 else 'MISSED'}")
    print(f"the whole benchmark: {(time.perf_counter() - start) / 60:.1f} min")
    (work / "finetune.json").write_text(json.dumps({"scores": scores, "base": base, "minutes": args.minutes,
                                                    "gain": gain, "forgot": forgot}, indent=1))


if __name__ == "__main__":
    main()
