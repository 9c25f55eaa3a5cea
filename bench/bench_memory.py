"""Memory of the engine's denoising step, without the memory: ``ModelRunner.run`` runs on the `meta` device and a
TorchDispatchMode adds up the bytes of every live storage (freed when its storage is freed), so the figures are
exact for torch allocations and cost nothing (docs/memory.md).

    python bench/bench_memory.py                       # the 26B report: state per stream, step peaks, the 80 GB fit
    python bench/bench_memory.py --canvases 8 [--vocab 262144] [--canvas-length 256] [--dtype bfloat16]
                                 [--rows batched|per-row] [--tile N]    # one step of a tiny-hidden model, one line

One step = ``ModelRunner.run``: the decoder pass (each row adding the self-conditioning signal [C, H] it kept),
then per tile of canvases the LM head + softcap, the sampler (``ops.diffusion_step``'s outputs: the native path
allocates nothing else) and the next self-conditioning signal of each row. The sampler's host reads
(``.tolist()``) cannot run on `meta`, so ``MetaSampler`` keeps the real sampler's allocations without them. The MoE
branch is replaced by zeros (its working memory does not scale with the vocabulary, and its reference needs host
values). Figures are above what lives before the step (weights, KV cache) unless named otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from dgserve import DiffusionGemma, SamplingParams, ops
from dgserve.engine.block import BlockState
from dgserve.engine.cache_config import CacheConfig
from dgserve.engine.model_runner import ModelRunner
from dgserve.engine.request import Request
from dgserve.engine.sampler import Sampler
from dgserve.model.cache import SlotCache
from dgserve.model.checkpoint import expected_shapes
from dgserve.model.tiny import preset
from dgserve.outputs import OutputTracker

GB, MIB = 1e9, 2**20


class LiveBytes(TorchDispatchMode):
    """Bytes of the live storages created inside the mode, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        self.live[key] = n = st.nbytes()
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:  # a view shares its input's storage: a weight's transpose costs nothing
            tree_map_only(torch.Tensor, self._track, out)
        return out


def native_step_allocations(logits, temperature, seeds, blocks, steps, bound, bitmask=None):
    """What ops.diffusion_step allocates on the native path (its outputs; the kernels allocate nothing): the
    torch reference would add [B, C, V] int64 / fp32 Philox and Gumbel temporaries the served path never has."""
    B, C, V = logits.shape
    dev = logits.device
    return ops.DiffusionStepOut(
        canvas=torch.empty(B, C, dtype=torch.int64, device=dev),
        argmax=torch.empty(B, C, dtype=torch.int64, device=dev),
        entropy=torch.empty(B, C, device=dev),
        accepted=torch.empty(B, C, dtype=torch.bool, device=dev),
        mean_entropy=torch.empty(B, device=dev),
        processed=torch.empty(B, C, V, device=dev),
    )


class MetaSampler(Sampler):
    """The sampler's allocations on `meta`: the step's outputs become the blocks' canvases, no host reads."""

    def step(self, reqs, logits, knobs):
        out = ops.diffusion_step(logits, knobs.t_max.float(), knobs.seed, knobs.block_index, knobs.steps_left, None)
        for i, r in enumerate(reqs):
            r.block.canvas, r.block.argmax = out.canvas[i], out.argmax[i]
        return out.processed


@contextlib.contextmanager
def meta_ops():
    """The MoE branch as zeros and the diffusion step as its allocations, while the block runs."""
    saved = {name: getattr(ops, name) for name in ("moe_experts", "moe_route", "diffusion_step")}
    ops.moe_experts = lambda x, *a: torch.zeros_like(x)
    ops.diffusion_step = native_step_allocations
    ops.moe_route = lambda r, s, w, pes, k, eps: (
        torch.zeros(*r.shape[:-1], k, device=r.device),
        torch.zeros(*r.shape[:-1], k, dtype=torch.int64, device=r.device),
    )
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(ops, name, f)


def runner_requests(runner: ModelRunner, streams: int, context: int, device: torch.device) -> list[Request]:
    """``streams`` running requests admitted into the runner's slots, each with ``context`` positions encoded
    (host lengths only: the KV values do not matter here) and a started block (canvas only, no self-conditioning)."""
    C = runner.model.config.canvas_length
    reqs = []
    for i in range(streams):
        params = SamplingParams(max_denoising_steps=8, seed=i)
        tracker = OutputTracker(params.max_new_tokens, frozenset({1}), False, ())
        r = Request(f"r{i}", [0], params, tracker, steps_left=8)
        runner.admit(r)
        assert r.slot is not None
        runner.cache.lengths[r.slot] = context
        r.block = BlockState(torch.zeros(C, dtype=torch.int64, device=device))
        reqs.append(r)
    return reqs


def measure_steps(model: DiffusionGemma, streams: int, context: int, sampler: Sampler | None = None) -> dict:
    """Two ``ModelRunner.run`` steps of ``streams`` requests at ``context`` encoded positions each, under exact
    storage accounting: the state each request keeps between steps, and the step peak above the weights and KV
    cache (the second step's, which starts from the kept state). Call inside ``meta_ops()`` on `meta`."""
    cfg, C = model.config, model.config.canvas_length
    slot_len = context + C
    kv = SlotCache.bytes_per_slot(cfg, slot_len, max(512, C), model.dtype)
    with LiveBytes() as mem:
        cc = CacheConfig(memory=streams * kv + 1)
        runner = ModelRunner(model, streams, slot_len, 512, cc, prefix_caching=False)
        if sampler is not None:
            runner.sampler = sampler
        reqs = runner_requests(runner, streams, context, model.device)
        base = mem.current  # weights (made outside), cache, knob tables, the blocks' canvases
        runner.run(reqs)
        gc.collect()  # temporaries a reference cycle still holds are not state
        state = mem.current - base  # what the requests keep between steps (the canvases replaced in place)
        mem.reset_peak()
        runner.run(reqs)
        peak = mem.peak - base
        kept = [r.block.self_cond for r in reqs if r.block is not None]
    return {
        "streams": streams,
        "state_bytes_per_stream": state // streams,
        "self_cond_shape": list(kept[0].shape) if kept else None,
        "step_peak_bytes": peak,
        "kv_bytes_per_stream": kv,
    }


def meta_model(cfg, dtype: torch.dtype, rows: str, tile: int | None) -> DiffusionGemma:
    """The model on `meta` (weights cost nothing), its decoder batched (accelerators: the model's tile) or per row
    (the CPU engine's order; at the real vocabulary its tile is one canvas), and its canvas tile when given."""
    weights = {n: torch.zeros(s, dtype=dtype, device="meta") for n, s in expected_shapes(cfg).items()}
    model = DiffusionGemma(cfg, weights, dtype, "meta", batch_rows=rows == "batched")
    if tile is not None or rows == "per-row":
        model.canvas_tile = tile or 1
    return model


def nvfp4_weight_bytes(cfg) -> dict:
    """Bytes of the text model's weights with NVFP4 experts (ModelOpt layout, docs/memory.md, "The 26B model on
    one 80 GB device"): per expert and projection a [N, K/2] uint8 code array, a [N, K/16] E4M3 block scale and two
    fp32 scalars; everything else in bf16. The vision tower is not counted."""
    shapes = expected_shapes(cfg)
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    per_expert = sum(n * k // 2 + n * k // 16 + 8 for n, k in ((I, H), (I, H), (H, I)))  # gate, up, down
    experts = cfg.num_hidden_layers * cfg.num_experts * per_expert
    other = sum(2 * torch.Size(s).numel() for n, s in shapes.items() if ".experts." not in n)
    return {"experts": experts, "other_bf16": other, "total": experts + other}


def report_26b(rows: str, context: int, streams: list[int], budget_gb: float) -> dict:
    """The real 26B shape in bf16: state per stream and step peak at each stream count; the fit of the largest."""
    cfg = preset("26b-a4b")
    res: dict = {"shape": "26b-a4b", "dtype": "bfloat16", "rows": rows, "context": context, "steps": []}
    with meta_ops():
        model = meta_model(cfg, torch.bfloat16, rows, None)
        res["tile"] = model.canvas_tile
        measure_steps(model, 1, context - cfg.canvas_length, MetaSampler(model.dtype))  # one-off lazy tensors
        for n in streams:
            m = measure_steps(model, n, context - cfg.canvas_length, MetaSampler(model.dtype))
            res["steps"].append(m)
            print(json.dumps(m))
    w = nvfp4_weight_bytes(cfg)
    top = res["steps"][-1]
    n = top["streams"]
    total = w["total"] + n * (top["kv_bytes_per_stream"] + top["state_bytes_per_stream"]) + top["step_peak_bytes"]
    res["fit"] = {
        "streams": n,
        "weights_gb": round(w["total"] / GB, 2),
        "experts_nvfp4_gb": round(w["experts"] / GB, 2),
        "kv_gb": round(n * top["kv_bytes_per_stream"] / GB, 2),
        "state_gb": round(n * top["state_bytes_per_stream"] / GB, 3),
        "step_peak_gb": round(top["step_peak_bytes"] / GB, 2),
        "total_gb": round(total / GB, 2),
        "budget_gb": budget_gb,
        "fits": total <= budget_gb * GB,
    }
    print(json.dumps(res["fit"]))
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--canvases", type=int, default=None, help="one step of a tiny-hidden model at this many streams")
    p.add_argument("--vocab", type=int, default=262_144)
    p.add_argument("--canvas-length", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--rows", choices=("batched", "per-row"), default="batched", help="accelerators, or the CPU")
    p.add_argument("--tile", type=int, default=None, help="canvases per tile (default: the model's)")
    p.add_argument("--context", type=int, default=4096, help="positions per stream, the canvas included (26B)")
    p.add_argument("--streams", default="1,8,32,64", help="stream counts (26B report)")
    p.add_argument("--budget-gb", type=float, default=80.0)
    args = p.parse_args(argv)
    if args.canvases is None:
        return report_26b(args.rows, args.context, [int(s) for s in args.streams.split(",")], args.budget_gb)
    cfg = preset(
        "tiny",
        vocab_size=args.vocab,
        canvas_length=args.canvas_length,
        num_hidden_layers=1,
        layer_types=("full_attention",),
    )
    B, C, V = args.canvases, cfg.canvas_length, cfg.vocab_size
    with meta_ops():
        model = meta_model(cfg, getattr(torch, args.dtype), args.rows, args.tile)
        measure_steps(model, 1, 16, MetaSampler(model.dtype))  # the model's one-off lazily made tensors
        m = measure_steps(model, B, 16, MetaSampler(model.dtype))
    unit = B * C * V * 4  # one fp32 [B, C, V] tensor
    res = {
        **m,
        "canvases": B,
        "vocab": V,
        "dtype": args.dtype,
        "rows": args.rows,
        "tile": model.canvas_tile,
        "peak_above_base_gb": round(m["step_peak_bytes"] / GB, 2),
        "peak_in_fp32_logits": round(m["step_peak_bytes"] / unit, 2),
        "kept_after_step_gb": round(B * m["state_bytes_per_stream"] / GB, 2),
    }
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
