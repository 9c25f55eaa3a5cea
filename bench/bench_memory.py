"""Peak memory of one denoising step at the 26B vocabulary, without the memory: the model runs on the `meta`
device and a TorchDispatchMode adds up the bytes of every live storage (freed when its storage is freed), so
the peak is exact for torch allocations and costs nothing.

    python bench/bench_memory.py [--canvases 16] [--vocab 262144] [--dtype bfloat16] [--rows batched|per-row]
                                 [--tile N]

One step = Engine.step's work: the decoder pass with self-conditioning on every row (self-conditioning softmax),
then per tile of canvases the LM head + softcap and the sampler (ops.diffusion_step, then each row's
self-conditioning input kept in the model dtype). `--tile 16` is the untiled engine; the engine before tiling
(full [B, C, V] logits from denoise, one sampler call, logits softcapped out of place) measured 15.04 GB (bf16) and
17.19 GB (fp32) batched, 8.59 GB per-row. Hidden sizes are small (the [canvases × 256 × vocab] tensors dominate at
this vocabulary); the MoE branch is replaced by zeros (its memory does not scale with the vocabulary, and its
reference needs host values). Prints one JSON line: peak bytes above what lives before the step (weights, cache, the
previous step's self-conditioning inputs; the new ones replace them after the step), and the same in units of one
fp32 [canvases × 256 × vocab] tensor.
"""

from __future__ import annotations

import argparse
import json
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from dgserve import DiffusionGemma, ops
from dgserve.model.checkpoint import expected_shapes
from dgserve.model.tiny import preset


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
        tree_map_only(torch.Tensor, self._track, out)
        return out


def native_step_allocations(logits, temperature, seeds, blocks, steps, bound):
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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--canvases", type=int, default=16)
    p.add_argument("--vocab", type=int, default=262_144)
    p.add_argument("--canvas-length", type=int, default=256)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument(
        "--rows",
        choices=("batched", "per-row"),
        default="batched",
        help="the decoder over all rows at once (accelerators) or one by one (the CPU engine)",
    )
    p.add_argument("--tile", type=int, default=None, help="canvases per tile (default: the model's)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    cfg = preset(
        "tiny",
        vocab_size=args.vocab,
        canvas_length=args.canvas_length,
        num_hidden_layers=1,
        layer_types=("full_attention",),
    )
    saved = {name: getattr(ops, name) for name in ("moe_experts", "moe_route", "diffusion_step")}
    ops.moe_experts = lambda x, *a: torch.zeros_like(x)
    ops.diffusion_step = native_step_allocations
    ops.moe_route = lambda r, s, w, pes, k, eps: (
        torch.zeros(*r.shape[:-1], k, device=r.device),
        torch.zeros(*r.shape[:-1], k, dtype=torch.int64, device=r.device),
    )
    try:
        return _measure(args, cfg, dtype)
    finally:
        for name, f in saved.items():
            setattr(ops, name, f)


def _measure(args, cfg, dtype) -> dict:
    B, C, V = args.canvases, cfg.canvas_length, cfg.vocab_size
    with LiveBytes() as mem:
        weights = {n: torch.zeros(s, dtype=dtype, device="meta") for n, s in expected_shapes(cfg).items()}
        model = DiffusionGemma(cfg, weights, dtype, "meta", batch_rows=args.rows == "batched")
        if args.tile is not None:
            model.canvas_tile = args.tile
        cache = model.prefill(torch.zeros(B, 16, dtype=torch.int64, device="meta"))
        canvas = torch.zeros(B, C, dtype=torch.int64, device="meta")
        self_cond = [torch.zeros(C, V, dtype=dtype, device="meta") for _ in range(B)]  # the previous step's
        base = mem.current
        mem.reset_peak()
        # Engine.step: the decoder to hidden states, then LM head + sampler per tile of canvases
        hidden = model.denoise_hidden(cache, canvas, self_cond_logits=self_cond)
        peak_denoise = mem.peak
        self_cond = None  # consumed (Engine.step drops them here too)
        new_self_cond = []
        for _sl, logits in model.logits_tiles(hidden):
            n = logits.shape[0]
            z = torch.zeros(n, dtype=torch.int64, device="meta")
            out = ops.diffusion_step(logits, torch.ones(n, device="meta"), z, z, z + 1, torch.ones(n, device="meta"))
            del logits
            new_self_cond += [out.processed[i].to(dtype) for i in range(n)]  # Sampler._update keeps these
            del out
        del hidden
        self_cond = new_self_cond
        after = mem.current  # = base: the new self-conditioning inputs replace the old ones
    unit = B * C * V * 4
    res = {
        "canvases": B,
        "canvas_length": C,
        "vocab": V,
        "dtype": args.dtype,
        "rows": args.rows,
        "tile": getattr(model, "canvas_tile", None),
        "peak_above_base_bytes": mem.peak - base,
        "peak_above_base_gb": round((mem.peak - base) / 1e9, 2),
        "peak_in_fp32_logits": round((mem.peak - base) / unit, 2),
        "peak_decoder_in_fp32_logits": round((peak_denoise - base) / unit, 2),
        "kept_after_step_gb": round((after - base) / 1e9, 2),
    }
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
