#!/usr/bin/env python
"""Long-context evaluation of the small DiffusionGemma: the denoising loss against position.

What it measures (the "Long context" section of `python/dgserve/models/small/README.md`):

* text: the held-out documents of `tools/modern_corpus.py` (every 20th document of the sorted list; never a train
  document), each written `<bos>…<eos>` as in training, concatenated in their fixed sorted order into one stream,
  cut into sequences of `--seq-len` tokens (65,536 by default; the held-out documents are all shorter than that);
* model: dgserve's own `DiffusionGemma` (python/dgserve/model/diffusion_gemma.py), so the figures are what the
  server computes. Each sequence is prefilled in chunks of `--stride` tokens with `encode_row` on one slot cache
  of the whole length; after every chunk (a probe at position p = the tokens encoded so far) the next 16 tokens are
  the canvas;
* loss: the definition of `heldout_loss` in tools/train_small_model.py: the canvas corrupted by uniform random ids
  with probability t, no self-conditioning, cross-entropy in nats per canvas token over all 16 positions; at
  t = 1 and t = 0.5, `--draws` noise draws per probe (seeded);
* control: the same probe canvases with only the `--local` tokens before them as the prefix, encoded from
  position 0 (so the same text, scored at positions below 2K). The ratio long / local per bucket separates the
  effect of position and context length from that of which text happens to sit in a bucket.

Prints a table of mean loss per position bucket (< 2K, 2–4K, 4–8K, 8–16K, 16–32K, 32–64K) and writes --json.

    apt-get install -y --no-install-recommends python3.11-doc git-doc debian-reference-en
    python tools/eval_long_context.py [--model DIR] [--hf-overrides JSON] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import modern_corpus  # noqa: E402

DEFAULT_MODEL = HERE.parent / "python" / "dgserve" / "models" / "small"
BUCKETS = [(0, 2048, "< 2K"), (2048, 4096, "2-4K"), (4096, 8192, "4-8K"), (8192, 16384, "8-16K")]
BUCKETS += [(16384, 32768, "16-32K"), (32768, 65536, "32-64K"), (65536, 1 << 40, ">= 64K")]
BOS, EOS = 2, 1


def held_out_stream(model_dir: pathlib.Path) -> tuple[np.ndarray, list[str]]:
    """The held-out documents in their sorted order, each `<bos>…<eos>` under the model's tokenizer, as one stream."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    corpus = modern_corpus.build()
    ids: list[int] = []
    for text in corpus["held_plain"]:
        ids += [BOS, *tok.encode(text, add_special_tokens=False).ids, EOS]
    return np.array(ids, dtype=np.int64), corpus["held_docs"]


def probe_losses(model, prefix_row, target: torch.Tensor, ts, draws: int, gen: torch.Generator) -> dict:
    """{t: mean canvas cross-entropy over `draws` noise draws} for the canvas `target` [C] after `prefix_row`."""
    V = model.config.vocab_size
    out = {}
    for t in ts:
        losses = []
        for _ in range(draws):
            u = torch.rand(target.shape, generator=gen)
            noise = torch.randint(0, V, target.shape, generator=gen)
            canvas = torch.where(u < t, noise, target)
            logits = model.decode_row(prefix_row, canvas, None, None)
            losses.append(F.cross_entropy(logits, target).item())
        out[t] = sum(losses) / len(losses)
    return out


def run_sequence(model, seq: torch.Tensor, args, seed: int) -> list[dict]:
    """Prefill `seq` chunk by chunk; after each chunk, score the next C tokens with the long prefix and (control)
    with only the last `--local` tokens as the prefix."""
    from dgserve.model.cache import SlotCache

    C = model.config.canvas_length
    cpu = torch.device("cpu")
    cache = SlotCache(model.config, 1, len(seq) + C, max(args.stride, C), model.dtype, cpu, zero=True)
    row = cache.view(0)
    gen = torch.Generator().manual_seed(seed)
    probes, t0 = [], time.time()
    for p in range(0, len(seq) - C, args.stride):
        model.encode_row(seq[p : p + args.stride], row)
        pos = row.length
        if pos + C > len(seq):
            break
        target = seq[pos : pos + C]
        rec = {"position": pos, "long": probe_losses(model, row, target, args.ts, args.draws, gen)}
        if args.local:
            lo = max(0, pos - args.local)
            local = SlotCache(model.config, 1, pos - lo + C, max(pos - lo, C), model.dtype, cpu, zero=True)
            model.encode_row(seq[lo:pos], local.view(0))
            rec["local"] = probe_losses(model, local.view(0), target, args.ts, args.draws, gen)
        probes.append(rec)
        if len(probes) % 32 == 0:
            print(f"  position {pos:,}: {time.time() - t0:.0f} s", flush=True)
    return probes


def summarize(probes: list[dict], ts) -> list[dict]:
    """Mean loss per position bucket, per t, for the long prefix and the local control; then one row "all (local)":
    every probe's canvas with its local prefix, i.e. all the scored text at positions below 2K."""
    rows = []
    for lo, hi, name in BUCKETS:
        sel = [r for r in probes if lo <= r["position"] < hi]
        if not sel:
            continue
        row = {"bucket": name, "probes": len(sel)}
        for kind in ("long", "local"):
            if kind in sel[0]:
                row[kind] = {str(t): float(np.mean([r[kind][t] for r in sel])) for t in ts}
        rows.append(row)
    if probes and "local" in probes[0]:
        rows.append({"bucket": "all (local)", "probes": len(probes)})
        rows[-1]["long"] = {str(t): float(np.mean([r["local"][t] for r in probes])) for t in ts}
    return rows


def print_table(rows: list[dict], ts) -> None:
    """Per bucket: the loss with the whole prefix, its ratio to the < 2K bucket, the same canvases with the local
    prefix (positions < 2K) and the ratio long / local (same text). The last row: all probes with the local prefix,
    the < 2K loss over all the scored text."""
    base = rows[0]["long"]
    head = ["bucket", "probes"] + [f"t={t} long" for t in ts] + [f"t={t} / <2K" for t in ts]
    if "local" in rows[0]:
        head += [f"t={t} local" for t in ts] + [f"t={t} long/local" for t in ts]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["bucket"], str(r["probes"])]
        cells += [f"{r['long'][str(t)]:.3f}" for t in ts] + [f"{r['long'][str(t)] / base[str(t)]:.3f}" for t in ts]
        if "local" in r:
            cells += [f"{r['local'][str(t)]:.3f}" for t in ts]
            cells += [f"{r['long'][str(t)] / r['local'][str(t)]:.3f}" for t in ts]
        print("| " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--hf-overrides", default=None, help="JSON object deep-merged into config.json")
    ap.add_argument("--seq-len", type=int, default=65_536)
    ap.add_argument("--sequences", type=int, default=0, help="how many sequences (0: as many as the text gives)")
    ap.add_argument("--stride", type=int, default=256, help="prefill chunk = distance between probes")
    ap.add_argument("--draws", type=int, default=3, help="noise draws per probe and t")
    ap.add_argument("--ts", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--local", type=int, default=512, help="control prefix length (0: no control)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--summarize", default=None, help="print the tables of an earlier run's --json and exit")
    args = ap.parse_args(argv)
    if args.summarize:
        done = json.loads(pathlib.Path(args.summarize).read_text())
        ts = done["args"]["ts"]
        probes = [
            {k: ({float(t): x for t, x in v.items()} if isinstance(v, dict) else v) for k, v in r.items()}
            for r in done["probes"]
        ]
        print_table(summarize(probes, ts), ts)
        return 0
    torch.set_num_threads(args.threads)
    from dgserve.model.diffusion_gemma import DiffusionGemma

    model_dir = pathlib.Path(args.model)
    model = DiffusionGemma.from_pretrained(model_dir, hf_overrides=args.hf_overrides)
    stream, docs = held_out_stream(model_dir)
    n_seq = len(stream) // args.seq_len
    n_seq = min(n_seq, args.sequences) if args.sequences else n_seq
    print(f"held-out: {len(docs)} documents, {len(stream):,} tokens -> {n_seq} sequences of {args.seq_len:,}")
    probes, t0 = [], time.time()
    with torch.inference_mode():
        for i in range(n_seq):
            seq = torch.from_numpy(stream[i * args.seq_len : (i + 1) * args.seq_len])
            probes += run_sequence(model, seq, args, args.seed + i)
            print(f"sequence {i + 1}/{n_seq} done: {time.time() - t0:.0f} s", flush=True)
    rows = summarize(probes, args.ts)
    print_table(rows, args.ts)
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        meta.update(documents=len(docs), stream_tokens=len(stream), sequences=n_seq, seconds=time.time() - t0)
        pathlib.Path(args.json).write_text(json.dumps({"args": meta, "buckets": rows, "probes": probes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
