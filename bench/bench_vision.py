"""The vision tower's cost (docs/images.md, "Bench"): time per image, and what image prompts do to running streams.

    python bench/bench_vision.py [--device cpu|cuda] [--dtype float32|bfloat16] [--soft 70,140,280]
                                 [--towers small,real] [--tile N] [--repeats 3] [--streams 4] [--rounds 8]
                                 [--stream-tower small|real] [--stream-soft 70] [--skip-towers] [--skip-streams]
                                 [--json out.json]

(a) Tower time per image at each --soft count of soft tokens (a random image resized to exactly that many), for
    the shipped model's tiny tower ("small": 1 layer, width 16) and a random tower at the real model's vision dims
    ("real": transformers' Gemma 4 vision defaults, 16 layers, width 768, 12 heads, MLP 3072). Batch 1 always; a
    tile of --tile images in one padded pass too when --tile > 1 (default: the model's ``image_tile``, 1 on CPU,
    4 on accelerators). Reported: ms per image, soft tokens/s, the pass's peak memory beside what the KV budget
    sets aside for it (``tile_workspace_bytes``; on the CPU the resident set's high-water mark, approximate), and
    the ratio to a text prompt chunk of the same token count (the image's placeholders plus BOI and EOI) encoded
    by the same run's text model: the shipped small model for "small"; for "real", a random two-layer model at
    the real text width (26B-A4B's hidden size, attention and per-token expert work: 8 experts, all routed),
    whose time × 15 estimates the 30-layer chunk.
(b) Effect on running streams: --streams text requests decoding on the shipped small model (its tower, or the
    real-dims one with --stream-tower real, answering images through ids moved into its vocabulary); per engine
    step, the latency distribution (p50/p95/max over --rounds rounds) of a step with no new request, a step that
    admits an image request (one image of --stream-soft soft tokens, its whole prompt in that step's prefill), and
    a step that admits a text prompt of the same token count. Each admitted request is aborted after its step, so
    only its prefill adds work. Warm-up first.

One JSON line per measurement; a table at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np
import torch

from dgserve import DiffusionGemma, Engine, SamplingParams
from dgserve.config import FULL, SLIDING
from dgserve.engine.prompt import ImagePrompt, Submission
from dgserve.engine.scheduler import SchedulerConfig
from dgserve.media.images import ImageInput, preprocess
from dgserve.model.cache import SlotCache
from dgserve.model.default_model import default_model_path
from dgserve.model.tiny import preset, random_weights
from dgserve.model.vision import EMBED, TOWER, VisionConfig, VisionTower, tile_workspace_bytes

# a grid of (rows, columns) soft tokens per count: the image resizes to exactly that many
GRIDS = {70: (7, 10), 140: (10, 14), 280: (14, 20), 560: (20, 28), 1120: (28, 40)}
ROWS: list[dict] = []


def emit(**row) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fns: list, device: torch.device, repeats: int) -> list[float]:
    """The best of ``repeats`` seconds of each fn() after one warm-up call each, the calls interleaved (a, b, a,
    b, ...) so that a shared machine's load weighs on each alike."""
    best = [float("inf")] * len(fns)
    for r in range(repeats + 1):
        for i, fn in enumerate(fns):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if r:  # the first round warms up
                best[i] = min(best[i], time.perf_counter() - t0)
    return best


def image(soft: int, seed: int = 0) -> ImageInput:
    """A random RGB image of exactly ``soft`` soft tokens (16-pixel patches, 3 × 3 pooling)."""
    from PIL import Image

    gh, gw = GRIDS[soft]
    arr = np.random.default_rng(seed).integers(0, 256, (gh * 48, gw * 48, 3), dtype=np.uint8)
    im = preprocess(Image.fromarray(arr), 16, 3, soft)
    assert im.tokens == soft, (im.tokens, soft)
    return im


def real_tower(text_hidden: int, dtype, device, max_soft: int) -> VisionTower:
    """A random tower at transformers' Gemma 4 vision defaults (weights ~ N(0, 0.02), norms around 1)."""
    vc = VisionConfig.from_dict({"vision_config": {}, "vision_soft_tokens_per_image": max_soft})
    assert vc is not None
    g = torch.Generator().manual_seed(0)
    hv, inter, hd = vc.hidden_size, vc.intermediate_size, vc.head_dim
    qd, kvd = vc.num_attention_heads * hd, vc.num_key_value_heads * hd

    def rnd(*shape, norm=False):
        t = torch.randn(*shape, generator=g)
        return 1 + 0.3 * t if norm else 0.02 * t

    w = {
        TOWER + "patch_embedder.input_proj.weight": rnd(hv, 3 * vc.patch_size**2),
        TOWER + "patch_embedder.position_embedding_table": rnd(2, vc.position_embedding_size, hv),
        EMBED + "embedding_projection.weight": rnd(text_hidden, vc.output_proj_dims),
    }
    shapes = {"q": (qd, hv), "k": (kvd, hv), "v": (kvd, hv), "o": (hv, qd)}
    for i in range(vc.num_hidden_layers):
        p = f"{TOWER}encoder.layers.{i}."
        for n, s in shapes.items():
            w[f"{p}self_attn.{n}_proj.linear.weight"] = rnd(*s)
        w[p + "mlp.gate_proj.linear.weight"], w[p + "mlp.up_proj.linear.weight"] = rnd(inter, hv), rnd(inter, hv)
        w[p + "mlp.down_proj.linear.weight"] = rnd(hv, inter)
        w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = rnd(hd, norm=True), rnd(hd, norm=True)
        for n in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            w[f"{p}{n}_layernorm.weight"] = rnd(hv, norm=True)
    return VisionTower(vc, w, text_hidden, dtype, device)


def real_width_text(dtype, device) -> DiffusionGemma:
    """Two layers (one sliding, one full) at 26B-A4B's text width, 8 experts all routed (its per-token expert
    work), a small vocabulary: its chunk time × 15 estimates the 30-layer model's."""
    cfg = preset(
        "26b-a4b",
        num_hidden_layers=2,
        layer_types=(SLIDING, FULL),
        num_experts=8,
        vocab_size=1024,
        canvas_length=16,
        eos_token_id=(1,),
    )
    return DiffusionGemma(cfg, random_weights(cfg, 0, dtype, device), dtype, device)


def text_chunk(model: DiffusionGemma, tokens: int):
    """A function running one causal encoder pass of ``tokens`` prompt tokens into an empty slot."""
    cache = SlotCache(model.config, 1, tokens + model.config.canvas_length, tokens, model.dtype, model.device)
    ids = torch.randint(3, min(model.config.vocab_size, 2000), (tokens,), generator=torch.Generator().manual_seed(1))
    ids = ids.to(model.device)

    def run():
        cache.lengths[0] = 0
        with torch.inference_mode():
            model.encode_row(ids, cache.view(0))

    return run


def tower_rows(args, device, dtype) -> None:
    small = DiffusionGemma.from_pretrained(default_model_path(), device=device, dtype=dtype)
    tile = args.tile or small.image_tile
    for kind in args.towers:
        if kind == "small":
            assert small.vision is not None
            tower, text, scale = small.vision, small, 1
        else:
            text = real_width_text(dtype, device)
            tower, scale = real_tower(text.config.hidden_size, dtype, device, max(args.soft)), 15
        for soft in args.soft:
            im = image(soft)
            fns = [lambda im=im, t=tower: t.encode(im.patches, im.positions), text_chunk(text, soft + 2)]
            if tile > 1:
                pairs = [(im.patches, im.positions)] * tile
                fns.append(lambda pairs=pairs, t=tower: t.encode_tile(pairs))
            one, chunk, *many = timed(fns, device, args.repeats)
            chunk *= scale
            est = dataclasses.replace(tower.config, max_soft_tokens=soft)  # the workspace for images of this size
            for n, secs in [(1, one)] + [(tile, t) for t in many]:
                per = secs / n
                emit(
                    bench="tower",
                    tower=kind,
                    soft_tokens=soft,
                    batch=n,
                    ms_per_image=round(per * 1e3, 2),
                    soft_tokens_per_s=round(soft / per),
                    text_chunk_ms=round(chunk * 1e3, 2),
                    ratio_to_text_chunk=round(per / chunk, 3),
                    text_model="shipped" if scale == 1 else "x15 est",
                    peak_mib=round(peak_bytes(fns[0] if n == 1 else fns[2], device) / 2**20, 1),
                    workspace_mib=round(tile_workspace_bytes(est, n, dtype) / 2**20, 1),
                )


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def peak_bytes(fn, device: torch.device) -> int:
    """The memory one fn() call takes beyond what was held before it, at its peak: CUDA's allocator peak; on a
    Linux host the resident set's high-water mark (reset through /proc/self/clear_refs; -1 where unreadable)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _status_bytes("VmRSS")
        fn()
        return _status_bytes("VmHWM") - base
    except (OSError, StopIteration):
        return -1


def stream_engine(args, device, dtype) -> Engine:
    """The shipped small model serving images: its tower (or a real-dims one) with the image ids moved into its
    vocabulary (the shipped ids lie outside it). Chunks and the prefill budget hold a whole image prompt."""
    model = DiffusionGemma.from_pretrained(default_model_path(), device=device, dtype=dtype)
    assert model.vision is not None
    V = model.config.vocab_size
    tower = model.vision if args.stream_tower == "small" else real_tower(model.config.hidden_size, dtype, device, 280)
    tower.config = dataclasses.replace(
        tower.config, boi_token_id=V - 3, image_token_id=V - 2, eoi_token_id=V - 1, max_soft_tokens=280
    )
    model.vision = tower
    chunk = max(512, args.stream_soft + 64)
    sched = SchedulerConfig(max_num_seqs=args.streams + 2, prefill_chunk=chunk, max_prefill_tokens=chunk)
    return Engine(model, scheduler_config=sched, max_model_len=model.config.max_position_embeddings)


def stream_rows(args, device, dtype) -> None:
    engine = stream_engine(args, device, dtype)
    vc = engine.model.vision.config  # type: ignore[union-attr]
    im = image(args.stream_soft, seed=3)
    img_prompt = ImagePrompt((5, 6, vc.boi_token_id, *[vc.image_token_id] * im.tokens, vc.eoi_token_id, 7), (im,))
    text_prompt = list(range(10, 10 + len(img_prompt.ids)))
    streams = SamplingParams(max_new_tokens=1024, max_denoising_steps=48, confidence_threshold=1e-9, seed=1)
    short = SamplingParams(max_new_tokens=16, max_denoising_steps=4, seed=2)
    for k in range(args.streams):
        engine.add(engine.make_request(Submission(list(range(20 + k, 60 + k)), streams)))
    while any(r.prefilled < r.prompt_len for r in engine.in_flight()):
        engine.step()

    def one_step(prompt) -> float:
        req = engine.add(engine.make_request(Submission(prompt, short))) if prompt is not None else None
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        dt = time.perf_counter() - t0
        if req is not None:
            assert req.prefilled == req.prompt_len, "the admitted prompt was not prefilled in its step"
            engine.abort(req.request_id)
        return dt

    cases = {"none": None, "image": img_prompt, "text": text_prompt}
    for prompt in cases.values():  # warm-up
        one_step(prompt)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, prompt in cases.items():  # interleaved: the same streams' state for each case
            times[k].append(one_step(prompt))
            one_step(None)  # the aborted request's slot is freed
    for k, ts in times.items():
        ts = sorted(ts)
        p95 = ts[min(len(ts) - 1, round(0.95 * (len(ts) - 1)))]
        emit(
            bench="streams",
            case=k,
            streams=args.streams,
            tower=args.stream_tower,
            prompt_tokens=0 if cases[k] is None else len(img_prompt.ids),
            soft_tokens=args.stream_soft if k == "image" else 0,
            p50_ms=round(statistics.median(ts) * 1e3, 2),
            p95_ms=round(p95 * 1e3, 2),
            max_ms=round(ts[-1] * 1e3, 2),
            rounds=len(ts),
        )


def table() -> None:
    print()
    head = f"{'tower':6} {'soft':>5} {'batch':>5} {'ms/image':>10} {'soft tok/s':>11} {'text chunk ms':>14}"
    print(head + f" {'ratio':>7} {'peak MiB':>9} {'reserved MiB':>13}")
    for r in ROWS:
        if r["bench"] == "tower":
            print(
                f"{r['tower']:6} {r['soft_tokens']:>5} {r['batch']:>5} {r['ms_per_image']:>10} "
                f"{r['soft_tokens_per_s']:>11} {r['text_chunk_ms']:>14} {r['ratio_to_text_chunk']:>7} "
                f"{r['peak_mib']:>9} {r['workspace_mib']:>13}"
            )
    print()
    print(f"{'step admits':12} {'tower':6} {'tokens':>6} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8}")
    for r in ROWS:
        if r["bench"] == "streams":
            print(
                f"{r['case']:12} {r['tower']:6} {r['prompt_tokens']:>6} {r['p50_ms']:>8} {r['p95_ms']:>8} "
                f"{r['max_ms']:>8}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--soft", default="70,140,280", help="soft tokens per image, comma-separated")
    ap.add_argument("--towers", default="small,real")
    ap.add_argument("--tile", type=int, default=0, help="images per padded pass (0: the model's image_tile)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--stream-tower", choices=("small", "real"), default="small")
    ap.add_argument("--stream-soft", type=int, default=70)
    ap.add_argument("--skip-towers", action="store_true")
    ap.add_argument("--skip-streams", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    args.soft = [int(s) for s in args.soft.split(",")]
    args.towers = [t for t in args.towers.split(",") if t]
    if not args.skip_towers:
        tower_rows(args, device, dtype)
    if not args.skip_streams:
        stream_rows(args, device, dtype)
    table()
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in ROWS)


if __name__ == "__main__":
    main()
