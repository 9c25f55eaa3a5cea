"""``moe_align``: group token-expert pairs by expert (docs/kernels.md, MoE dispatch); native core in
``csrc/ops/moe_align.h``. Bit-identical everywhere (stable order within an expert, integer only); no host
synchronisation on CUDA.

Also the MoE limits the other MoE op modules share: ``CUDA_ALIGN_BLOCK`` (the block the CUDA expert GEMMs align
to), ``CUDA_MAX_EXPERTS`` and ``moe_native_device``.
"""

from __future__ import annotations

import torch

from . import native, reference
from .reference import MoeAlignOut, moe_align_capacity

CUDA_ALIGN_BLOCK = 8  # moe_align block on CUDA: one n8 tile of the expert GEMMs' token dimension
CUDA_MAX_EXPERTS = 256  # the CUDA route and align kernels' limit (csrc/ops/moe_route.h, moe_align.h)


def moe_native_device(device: torch.device, experts: int) -> bool:
    """Whether the native MoE route and align serve ``device`` for a layer of ``experts`` experts: the CPU always;
    CUDA in a CUDA build up to ``CUDA_MAX_EXPERTS``."""
    return device.type == "cpu" or (device.type == "cuda" and native.cuda_built() and experts <= CUDA_MAX_EXPERTS)


def moe_align_native_ok(ids, num_experts: int, block_size: int) -> bool:
    """Whether ``moe_align`` runs ``_C.moe_align``: ids a [T, K] int64 tensor on a served device, E and the block
    >= 1."""
    return (
        native.has_native("moe_align")
        and isinstance(ids, torch.Tensor)
        and ids.dim() == 2
        and ids.dtype == torch.int64
        and num_experts >= 1
        and block_size >= 1
        and moe_native_device(ids.device, num_experts)
    )


def moe_align(ids: torch.Tensor, num_experts: int, block_size: int) -> MoeAlignOut:
    """Group the pairs of ids by expert, each expert's segment padded to block_size; see ``reference.moe_align``.

    Parameters
    ----------
    ids : [T, K] int64, values in [0, E) (on CUDA not checked)
    num_experts : E >= 1
    block_size : >= 1

    Returns
    -------
    MoeAlignOut of new int32 tensors: counts [E], offsets [E + 1], sorted_pairs [T·K + E·(block_size − 1)] (stable
    within an expert, sentinel T·K in padding), block_expert [len(sorted_pairs) // block_size] (−1 unused).
    """
    if not moe_align_native_ok(ids, num_experts, block_size):
        return reference.moe_align(ids, num_experts, block_size)
    P, dev = ids.numel(), ids.device
    cap = moe_align_capacity(P, num_experts, block_size)
    out = MoeAlignOut(
        counts=torch.empty(num_experts, dtype=torch.int32, device=dev),
        offsets=torch.empty(num_experts + 1, dtype=torch.int32, device=dev),
        sorted_pairs=torch.empty(cap, dtype=torch.int32, device=dev),
        block_expert=torch.empty(cap // block_size, dtype=torch.int32, device=dev),
    )
    native._C.moe_align(ids.contiguous(), int(num_experts), int(block_size), *out)
    return out
