#!/usr/bin/env python
"""Train the small DiffusionGemma shipped in `python/dgserve/models/small/` (its card, README.md there, has the
recipe and results).

Three stages, all driven by this one script (each is skipped when its output already exists):

1. corpus: `--corpus modern` (the shipped model's): documentation prose from Debian packages
   (python3.11-doc, git-doc, debian-reference-en; see tools/modern_corpus.py), whole documents held out (every 20th),
   plus chat examples built from consecutive sentences of a train paragraph. `--corpus kjv` (the model shipped
   before): the King James Bible from Debian's `bible-kjv-text` package (public domain), extracted with the
   package's `bible` program, split by chapter into train / held-out (every 50th chapter is held out, ~2%), plus
   chat-formatted examples built from consecutive train verses (user: one verse, model: the next one or two);
2. tokenizer: a byte-level BPE trained with `tokenizers` on the train split only, with a `<bos> $A` post-processor
   (tokenizer_config.json says add_bos_token, so every tokenizer path adds exactly one BOS, as the training
   documents `<bos>...<eos>` have);
3. training: the uniform-noise block-diffusion objective (docs/generation.md) with transformers'
   `DiffusionGemmaForBlockDiffusion` (the reference implementation) on CPU (or CUDA if available):
   prefix encoded causally by the encoder (it writes the KV cache, with gradients), canvas = the next C tokens,
   corrupted per example with probability t (t = u ** t_power, u ~ U(0, 1]) by uniform random ids,
   self-conditioning per example with probability 0.5 (a first decoder pass without gradient whose fp32 logits,
   temperature 1, are fed back as `self_conditioning_logits`), cross-entropy over all canvas positions.

Usage:
    python tools/train_small_model.py --work /work/train --out /work/train/ckpt --threads 2 --steps 6000
    python tools/train_small_model.py ... --resume            # continue from the latest checkpoint in --out
    python tools/train_small_model.py ... --export-only DIR   # write the HF dir from the latest checkpoint
    python tools/train_small_model.py ... --init-from python/dgserve/models/small   # warm start (fresh optimizer)
    python tools/train_small_model.py --corpus modern --init-from KJV_DIR --init-new-vocab ...   # new corpus + BPE

Reproducible with `--seed` (data order, noise and init all come from seeded generators; a resumed run restores the
RNG states, so it follows the same trajectory up to floating-point thread effects).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"]  # ids 0..4
PAD, EOS, BOS, SOT, EOT = range(5)

# The chat template written into the exported tokenizer_config.json (the shipped model's): Gemma 4's turns, and
# the built-in format's tool declarations, calls and results (docs/tools.md), as dgserve.text.gemma4_chat renders
# them without a template.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}\n"
    "{%- if content is string -%}{{ content | trim }}\n"
    "{%- elif content is iterable -%}\n"
    "{%- for part in content -%}\n"
    "{%- if part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- macro declare(tools) -%}\n"
    "{%- for t in tools -%}\n"
    "{%- set fn = t['function'] -%}\n"
    "{%- set body = {'description': fn['description'] or '', 'parameters': fn['parameters'] or {}} -%}\n"
    "<|tool>declaration:{{ t['function']['name'] }}{{ body | tojson(separators=(',', ':')) }}<tool|>\n"
    "{%- endfor -%}\n"
    "{%- endmacro -%}\n"
    "{%- set ns = namespace(open=false, last_user=-1) -%}\n"
    "{%- for m in messages -%}\n"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{{ bos_token }}\n"
    "{%- if tools and messages[0]['role'] != 'system' -%}<|turn>system\n"
    "{{ declare(tools) }}<turn|>\n"
    "{% endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- set i = loop.index0 -%}\n"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "{%- if role == 'model' -%}\n"
    "{%- if not ns.open -%}<|turn>model\n"
    "{% endif -%}\n"
    "{%- set calls = message['tool_calls'] or [] -%}\n"
    "{%- if calls and message['reasoning_content'] and i > ns.last_user -%}<|channel>thought\n"
    "{{ message['reasoning_content'] }}\n"
    "<channel|>{%- endif -%}\n"
    "{%- for c in calls -%}\n"
    "{%- set a = c['function']['arguments'] -%}"
    "{%- set args = a if a is string else a | tojson(separators=(',', ':')) -%}\n"
    "<|tool_call>call:{{ c['function']['name'] }}{{ args }}<tool_call|>\n"
    "{%- endfor -%}\n"
    "{%- set r = namespace(n=0, stop=false) -%}\n"
    "{%- if calls -%}{%- for k in range(i + 1, messages | length) -%}\n"
    "{%- if r.stop or messages[k]['role'] != 'tool' -%}{%- set r.stop = true -%}\n"
    "{%- else -%}\n"
    "{%- set name = namespace(v='') -%}\n"
    "{%- for c in calls -%}\n"
    "{%- if c['id'] == messages[k]['tool_call_id'] -%}{%- set name.v = c['function']['name'] -%}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set result = {'value': text(messages[k]['content'])} -%}\n"
    "<|tool_response>response:{{ name.v }}{{ result | tojson(separators=(',', ':')) }}<tool_response|>\n"
    "{%- set r.n = r.n + 1 -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}{%- endif -%}\n"
    "{%- set body = text(message['content']) -%}\n"
    "{{ body }}\n"
    "{%- if calls and r.n == 0 -%}<|tool_response>{%- set ns.open = true -%}\n"
    "{%- elif r.n > 0 and not body -%}{%- set ns.open = true -%}\n"
    "{%- else -%}<turn|>\n"
    "{% set ns.open = false -%}\n"
    "{%- endif -%}\n"
    "{%- elif role != 'tool' -%}<|turn>{{ role }}\n"
    "{{ text(message['content']) }}{% if role == 'system' and tools %}{{ declare(tools) }}{% endif %}<turn|>\n"
    "{% set ns.open = false -%}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt and not ns.open -%}<|turn>model\n"
    "{% endif -%}\n"
)


# ----------------------------------------------------------------------------- corpus


def extract_kjv(work: pathlib.Path) -> list[tuple[str, list[str]]]:
    """[(chapter title, [verse text, ...]), ...] in canonical order, from the `bible` program."""
    raw = work / "kjv_raw.txt"
    if not raw.exists():
        if shutil.which("bible") is None:
            sys.exit("the `bible` program is missing: apt-get install -y bible-kjv-text bible-kjv")
        with open(raw, "w") as f:
            subprocess.run(["bible", "-l0", "Gen1:1-Rev22:21"], stdout=f, check=True)
    chapters: list[tuple[str, list[str]]] = []
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+(\d+)\s+(.*)$", line)
        if m:
            chapters[-1][1].append(m.group(2).strip())
        else:
            chapters.append((line.strip(), []))
    return chapters


SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def build_modern_corpus(work: pathlib.Path, seed: int) -> dict:
    """Modern English documentation prose from Debian packages (tools/modern_corpus.py), plus chat
    exchanges built from consecutive sentences of one train paragraph (user: a sentence, model: the next one or
    two)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import modern_corpus

    corpus = modern_corpus.build()
    rng = random.Random(seed)

    def chat(docs, n):
        pool = []
        for d in docs:
            for para in d.split("\n"):
                ss = SENTENCE_END.split(para)
                pool += [ss[i : i + 3] for i in range(len(ss) - 1)]
        out = []
        for ss in rng.sample(pool, n):
            k = rng.choice([1, 1, 2])
            out.append(f"<|turn>user\n{ss[0]}<turn|>\n<|turn>model\n{' '.join(ss[1 : 1 + k])}<turn|>\n")
        return out

    corpus.update(
        train_chat=chat(corpus["train_plain"], 4000),
        held_chat=chat(corpus["held_plain"], 80),
        n_docs=[len(corpus["train_plain"]), len(corpus["held_plain"])],
        source="modern",
    )
    return corpus


def build_corpus(work: pathlib.Path, seed: int, source: str = "kjv") -> dict:
    meta_path = work / "corpus.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    if source == "modern":
        corpus = build_modern_corpus(work, seed)
        meta_path.write_text(json.dumps(corpus))
        return corpus
    chapters = extract_kjv(work)
    train_ch = [c for i, c in enumerate(chapters) if i % 50 != 49]
    held_ch = [c for i, c in enumerate(chapters) if i % 50 == 49]
    rng = random.Random(seed)

    def plain(chs):
        return ["\n".join(vs) for _, vs in chs]

    def chat(chs, n):
        pool = [(ci, vi) for ci, (_, vs) in enumerate(chs) for vi in range(len(vs) - 1)]
        out = []
        for ci, vi in rng.sample(pool, n):
            vs = chs[ci][1]
            k = rng.choice([1, 1, 2])
            answer = " ".join(vs[vi + 1 : vi + 1 + k])
            out.append(f"<|turn>user\n{vs[vi]}<turn|>\n<|turn>model\n{answer}<turn|>\n")
        return out

    corpus = {
        "train_plain": plain(train_ch),
        "held_plain": plain(held_ch),
        "train_chat": chat(train_ch, 4000),
        "held_chat": chat(held_ch, 80),
        "n_chapters": [len(train_ch), len(held_ch)],
        "n_verses": [sum(len(v) for _, v in train_ch), sum(len(v) for _, v in held_ch)],
        "held_titles": [t for t, _ in held_ch],
    }
    meta_path.write_text(json.dumps(corpus))
    return corpus


def train_tokenizer(work: pathlib.Path, corpus: dict, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dgserve.model.default_model import add_bos_post_processor

    path = work / "tokenizer.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus["train_plain"], trainer=trainer)
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    add_bos_post_processor(tok)  # text encodes as <bos> + text everywhere (transformers, tokenizers, dgserve)
    tok.save(str(path))
    return tok


def encode_stream(tok, plain: list[str], chat: list[str], seed: int) -> np.ndarray:
    """One token stream: documents (a chapter, or one chat exchange) each starting with <bos>; chapters end with
    <eos>, chat exchanges with <turn|>\\n. Documents are shuffled (seeded) so chat examples are spread out."""
    docs = [[BOS] + tok.encode(t, add_special_tokens=False).ids + [EOS] for t in plain]
    docs += [[BOS] + tok.encode(t, add_special_tokens=False).ids for t in chat]
    random.Random(seed).shuffle(docs)
    return np.array([i for d in docs for i in d], dtype=np.int16)


def build_data(work: pathlib.Path, seed: int, vocab_size: int, source: str = "kjv"):
    work.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(work, seed, source)
    tok = train_tokenizer(work, corpus, vocab_size)
    tr, he = work / "train.npy", work / "held.npy"
    if not tr.exists():
        np.save(tr, encode_stream(tok, corpus["train_plain"], corpus["train_chat"], seed))
        np.save(he, encode_stream(tok, corpus["held_plain"], corpus["held_chat"], seed + 1))
    return tok, np.load(tr).astype(np.int64), np.load(he).astype(np.int64), corpus


# ----------------------------------------------------------------------------- model


def make_config(args, vocab_size: int):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig, Gemma4VisionConfig

    n = args.layers
    layer_types = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(n)]
    layer_types[-1] = "full_attention"
    text = DiffusionGemmaTextConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        top_k_experts=args.top_k,
        num_hidden_layers=n,
        layer_types=layer_types,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        global_head_dim=2 * args.head_dim,
        num_global_key_value_heads=1,
        sliding_window=args.window,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        use_bidirectional_attention="vision",
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
    )
    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    return DiffusionGemmaConfig(
        text_config=text,
        vision_config=vision,
        canvas_length=args.canvas,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=[EOS, EOT],
        bos_token_id=BOS,
    )


def canvas_logits(
    model,
    prefix: torch.Tensor,
    canvas: torch.Tensor,
    sc_mask: torch.Tensor | None,
    sc_logits: torch.Tensor | None = None,
    first_pass: bool = True,
):
    """Decoder logits for `canvas` after encoding `prefix` (one encoder pass; its cache keeps the graph).

    With `sc_mask` (bool [B]) and `first_pass`, a first decoder pass without gradient produces the
    self-conditioning logits (temperature 1, fp32 = the model dtype here) for the rows where the mask is set.
    """
    inner = model.model
    enc = inner.encoder(input_ids=prefix, use_cache=True)
    cache = enc.past_key_values

    def decode(c, sc, mask):
        h = inner.decoder(
            decoder_input_ids=c, past_key_values=cache, self_conditioning_logits=sc, self_conditioning_mask=mask
        ).last_hidden_state
        z = model.lm_head(h).float()
        cap = model.final_logit_softcapping
        return torch.tanh(z / cap) * cap

    if sc_mask is not None and sc_logits is None and first_pass and bool(sc_mask.any()):
        with torch.no_grad():
            sc_logits = decode(canvas, None, None).to(model.dtype)
    if sc_logits is None:
        return decode(canvas, None, None)
    return decode(canvas, sc_logits, sc_mask)


def corrupt(target: torch.Tensor, t: torch.Tensor, vocab: int, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(target.shape, generator=gen, device=target.device)
    noise = torch.randint(0, vocab, target.shape, generator=gen, device=target.device)
    return torch.where(u < t[:, None], noise, target)


def sample_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - length, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + length] for s in starts]))


def heldout_batches(held: np.ndarray, C: int, n: int = 96, prefix_lens=(16, 48, 96), seed: int = 1234):
    rng = np.random.default_rng(seed)
    return [(P, sample_windows(held, n, P + C, rng)) for P in prefix_lens]


@torch.no_grad()
def heldout_loss(model, batches, vocab: int, ts=(0.25, 0.5, 0.75, 1.0), sc: bool = False, seed: int = 99):
    """Mean canvas cross-entropy (nats/token) at fixed noise levels.

    Returns ({t: loss}, the mean over ts, {t: [loss at canvas position 1..C]}); a position's loss and the overall
    loss come from the same noise draw (every window has C canvas positions, so the overall loss is the mean of
    the per-position ones).
    """
    was = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    res, per_position = {}, {}
    for t in ts:
        nll = []
        for P, w in batches:
            prefix, target = w[:, :P], w[:, P:]
            tt = torch.full((w.shape[0],), float(t))
            noisy = corrupt(target, tt, vocab, gen)
            mask = torch.ones(w.shape[0], dtype=torch.bool) if sc else None
            logits = canvas_logits(model, prefix, noisy, mask)
            nll.append(F.cross_entropy(logits.transpose(1, 2), target, reduction="none"))  # [B, C]
        by_position = torch.cat(nll).mean(0)
        res[t] = by_position.mean().item()
        per_position[t] = by_position.tolist()
    model.train(was)
    return res, sum(res.values()) / len(res), per_position


def unigram_baseline(train: np.ndarray, batches, vocab: int) -> float:
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0  # add-one smoothing
    logp = np.log(counts / counts.sum())
    tgt = np.concatenate([w[:, P:].reshape(-1).numpy() for P, w in batches])
    return float(-logp[tgt].mean())


@torch.no_grad()
def remap_embeddings(model, init_dir, new_tok):
    """Re-base the tied embedding of a warm-started model onto `new_tok` (same vocabulary size): a token present in
    the old vocabulary keeps its row; any other token gets the mean of the old rows of its old-vocabulary BPE
    tokenization (both are byte-level BPEs over the same byte alphabet)."""
    from tokenizers import Tokenizer

    old_tok = Tokenizer.from_file(str(pathlib.Path(init_dir) / "tokenizer.json"))
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == new_tok.get_vocab_size(), (emb.shape, new_tok.get_vocab_size())
    old_rows = emb.detach().clone()
    old_vocab = old_tok.get_vocab()
    same = 0
    for s, i in new_tok.get_vocab().items():
        if s in old_vocab:
            emb[i] = old_rows[old_vocab[s]]
            same += 1
            continue
        ids = [t.id for t in old_tok.model.tokenize(s)]
        emb[i] = old_rows[ids].mean(0)
    print(f"embedding re-based on the new vocabulary: {same} of {emb.shape[0]} tokens kept their row", flush=True)


# ----------------------------------------------------------------------------- checkpoints / export


def latest_ckpt(out: pathlib.Path):
    cks = sorted(glob.glob(str(out / "step_*.pt")))
    return pathlib.Path(cks[-1]) if cks else None


def save_ckpt(out: pathlib.Path, state: dict, keep: int = 3):
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"step_{state['step']:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in sorted(glob.glob(str(out / "step_*.pt")))[:-keep]:
        os.remove(old)
    return path


def export_hf(model, tok_path: pathlib.Path, dest: pathlib.Path, args, dtype: torch.dtype):
    from transformers import GenerationConfig

    dest.mkdir(parents=True, exist_ok=True)
    m = model.to(dtype)
    m.generation_config = GenerationConfig(
        eos_token_id=[EOS, EOT],
        pad_token_id=PAD,
        bos_token_id=BOS,
        max_new_tokens=64,
        max_denoising_steps=args.gen_steps,
        t_min=args.gen_t_min,
        t_max=args.gen_t_max,
        stability_threshold=1,
        confidence_threshold=0.005,
        sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": float(args.gen_entropy_bound)},
    )
    m.save_pretrained(dest)
    shutil.copy(tok_path, dest / "tokenizer.json")
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": 2048,
                "chat_template": CHAT_TEMPLATE,
                "extra_special_tokens": {"sot_token": "<|turn>", "eot_token": "<turn|>"},
            },
            indent=2,
        )
        + "\n"
    )
    model.to(torch.float32)


# ----------------------------------------------------------------------------- training


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to min_lr_frac * lr at args.steps; counted from args.restart_step."""
    step -= args.restart_step
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(1.0, (step - args.warmup) / max(1, args.steps - args.restart_step - args.warmup))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/work/train", help="corpus, tokenizer and token streams")
    ap.add_argument("--out", default="/work/train/ckpt", help="checkpoints (step_*.pt) and the final HF dir")
    ap.add_argument("--final", default=None, help="HF dir to write at the end (default OUT/final)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export-only", default=None, metavar="DIR", help="export the latest checkpoint and exit")
    ap.add_argument("--export-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--init-from",
        default=None,
        metavar="HF_DIR",
        help="warm start: load the weights (and, when --work has none yet, the tokenizer) of an exported "
        "model, e.g. python/dgserve/models/small; the optimizer starts fresh",
    )
    ap.add_argument(
        "--corpus",
        default="kjv",
        choices=["kjv", "modern"],
        help="kjv: the King James Bible (bible-kjv-text); modern: Debian documentation prose (tools/modern_corpus.py)",
    )
    ap.add_argument(
        "--init-new-vocab",
        action="store_true",
        help="with --init-from: keep this corpus's own tokenizer (trained into --work) instead of the "
        "init model's; all non-embedding weights are copied, and each new token's (tied) embedding "
        "row is the mean of the init model's rows for that token's tokenization under the old "
        "vocabulary (the same row when the token exists in both)",
    )
    # model
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--moe-intermediate", type=int, default=192)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=48)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--canvas", type=int, default=16)
    # objective / optimisation
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prefix-max", type=int, default=96, help="prefix length ~ U{8..prefix-max} per batch")
    ap.add_argument("--t-power", type=float, default=1.0, help="t = u**t_power, u ~ U(0,1]; >1 favours low noise")
    ap.add_argument("--sc-prob", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument(
        "--restart-step",
        type=int,
        default=0,
        help="with --resume: start a fresh warmup + cosine schedule at this step (a warm restart; the optimizer "
        "state is kept)",
    )
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every-s", type=float, default=600)
    ap.add_argument("--ckpt-every-s", type=float, default=240)
    ap.add_argument("--max-minutes", type=float, default=0, help="stop (checkpoint + export) after this wall time")
    ap.add_argument(
        "--stop-at-step",
        type=int,
        default=0,
        help="stop (checkpoint + export) at this step without changing the LR schedule (--steps); "
        "used to replay a run whose recipe changed on --resume",
    )
    # generation defaults written to generation_config.json
    ap.add_argument("--gen-steps", type=int, default=32)
    ap.add_argument("--gen-t-min", type=float, default=0.4)
    ap.add_argument("--gen-t-max", type=float, default=0.8)
    ap.add_argument("--gen-entropy-bound", type=float, default=0.5)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    work, out = pathlib.Path(args.work), pathlib.Path(args.out)
    if args.init_from and not args.init_new_vocab:
        # The warm-started weights only make sense with the tokenizer they were trained with.
        work.mkdir(parents=True, exist_ok=True)
        src_tok = pathlib.Path(args.init_from) / "tokenizer.json"
        if not (work / "tokenizer.json").exists():
            shutil.copy(src_tok, work / "tokenizer.json")
        elif (work / "tokenizer.json").read_bytes() != src_tok.read_bytes():
            sys.exit(f"{work}/tokenizer.json differs from {src_tok}: use a fresh --work for a warm start")
    tok, train, held, corpus = build_data(work, args.seed, args.vocab, args.corpus)
    V = tok.get_vocab_size()
    print(f"data: train {len(train):,} tokens, held-out {len(held):,} tokens, vocab {V}", flush=True)

    from transformers import DiffusionGemmaForBlockDiffusion

    ck = latest_ckpt(out) if (args.resume or args.export_only) else None
    if ck is None and args.export_only:
        sys.exit(f"no checkpoint in {out}")
    torch.manual_seed(args.seed)
    if ck is None and args.init_from:
        # from_pretrained restores the encoder/decoder weight sharing that a state-dict load would not see.
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(args.init_from, dtype=torch.float32)
        have, want = model.config.text_config.to_dict(), make_config(args, V).text_config.to_dict()
        diff = {
            k: (have.get(k), want.get(k)) for k in set(have) | set(want) if k != "dtype" and have.get(k) != want.get(k)
        }
        if diff:
            sys.exit(f"--init-from {args.init_from}: config differs from this script's model flags: {diff}")
        if args.init_new_vocab:
            remap_embeddings(model, args.init_from, tok)
        print(f"warm start from {args.init_from} (fresh optimizer)", flush=True)
    else:
        model = DiffusionGemmaForBlockDiffusion(make_config(args, V)).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_vis = sum(p.numel() for n, p in model.named_parameters() if "vision" in n)
    print(f"model: {n_params:,} parameters ({n_vis:,} vision)", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-8,
    )
    np_rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    step, tokens_seen, train_time = 0, 0, 0.0
    if ck is not None:
        st = torch.load(ck, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        np_rng.bit_generator.state = st["np_rng"]
        gen.set_state(st["torch_gen"])
        step, tokens_seen, train_time = st["step"], st["tokens_seen"], st["train_time"]
        print(f"resumed from {ck} at step {step}", flush=True)
    if not args.export_only and not step >= args.restart_step >= 0:
        # lr_at counts the schedule from restart_step: before it the learning rate would be negative.
        sys.exit(f"--restart-step {args.restart_step} must lie between 0 and the step the run starts at ({step})")

    if args.export_only:
        export_hf(
            model, work / "tokenizer.json", pathlib.Path(args.export_only), args, getattr(torch, args.export_dtype)
        )
        print(f"exported step {step} to {args.export_only}")
        return

    hb = heldout_batches(held, args.canvas)
    uni = unigram_baseline(train, hb, V)
    print(f"held-out unigram baseline (train-set frequencies): {uni:.4f} nats/token", flush=True)

    def checkpoint():
        p = save_ckpt(
            out,
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "tokens_seen": tokens_seen,
                "train_time": train_time,
                "args": vars(args),
                "np_rng": np_rng.bit_generator.state,
                "torch_gen": gen.get_state(),
            },
        )
        print(f"checkpoint {p}", flush=True)

    t_start = time.time()
    last_ck = last_ev = time.time()
    run_loss, run_n, t_log, tok_log = 0.0, 0, time.time(), 0
    C = args.canvas
    while step < args.steps:
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        P = int(np_rng.integers(8, args.prefix_max + 1))
        w = sample_windows(train, args.batch, P + C, np_rng)
        prefix, target = w[:, :P], w[:, P:]
        u = 1.0 - torch.rand(args.batch, generator=gen)  # (0, 1]
        t = u**args.t_power
        noisy = corrupt(target, t, V, gen)
        sc_mask = torch.rand(args.batch, generator=gen) < args.sc_prob
        logits = canvas_logits(model, prefix, noisy, sc_mask)
        loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens_seen += w.numel()
        tok_log += w.numel()
        train_time += time.time() - t0
        run_loss += loss.item()
        run_n += 1
        if step % args.log_every == 0:
            dt = time.time() - t_log
            print(
                f"step {step} loss {run_loss / run_n:.4f} lr {lr_at(step, args):.2e} gnorm {gnorm:.2f} "
                f"{run_n / dt:.2f} steps/s {tok_log / dt:.0f} tok/s elapsed {train_time / 60:.1f} min",
                flush=True,
            )
            run_loss, run_n, t_log, tok_log = 0.0, 0, time.time(), 0
        if time.time() - last_ev > args.eval_every_s or step == args.steps:
            res, mean, _ = heldout_loss(model, hb, V)
            print(
                f"eval step {step} held-out "
                + " ".join(f"t={k}:{v:.4f}" for k, v in res.items())
                + f" mean {mean:.4f} (unigram {uni:.4f})",
                flush=True,
            )
            last_ev = time.time()
        if time.time() - last_ck > args.ckpt_every_s or step == args.steps:
            checkpoint()
            last_ck = time.time()
        if (args.max_minutes and time.time() - t_start > args.max_minutes * 60) or step == args.stop_at_step:
            print("time budget or --stop-at-step reached", flush=True)
            checkpoint()
            break
    final = pathlib.Path(args.final) if args.final else out / "final"
    export_hf(model, work / "tokenizer.json", final, args, getattr(torch, args.export_dtype))
    print(f"done: step {step}, {tokens_seen:,} tokens, {train_time / 60:.1f} min; exported {final}", flush=True)


if __name__ == "__main__":
    main()
