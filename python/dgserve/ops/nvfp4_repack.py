"""``nvfp4_repack``: ModelOpt NVFP4 tensors → the W4A16 kernel layout, at load time (docs/kernels.md, NVFP4
layout); native core in ``csrc/ops/nvfp4_repack.h`` (layout contract: ``csrc/ops/nvfp4_layout.h``). Pure
re-indexing: bit-identical to ``reference.nvfp4_repack`` on CPU and CUDA.

Also here, as in csrc: ``nvfp4_decode`` (the kernels' operand decode, a test hook) and ``pack_experts`` (one layer's
ModelOpt experts → ``PackedExperts``, the input of ``nvfp4_moe_experts``).
"""

from __future__ import annotations

import torch

from . import native, nvfp4_format, reference
from .nvfp4_format import PackedExperts


def nvfp4_repack_native_ok(weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether ``nvfp4_repack`` runs ``_C.nvfp4_repack``: uint8 weight [E, N, Kp/2] on a served device, scales
    [E, N, Kp/16] (E4M3 or its bytes) on its device, N and Kp multiples of 16 (else the reference raises)."""
    if not (native.has_native("nvfp4_repack") and native.native_device(weight.device)):
        return False
    if weight.dim() != 3 or weight.dtype != torch.uint8 or weight_scale.device != weight.device:
        return False
    E, N, half = weight.shape
    if weight_scale.shape != (E, N, 2 * half // nvfp4_format.GROUP) or (2 * half) % nvfp4_format.GROUP:
        return False
    return weight_scale.dtype in (torch.uint8, torch.float8_e4m3fn) and N % 16 == 0


def nvfp4_repack(
    weight: torch.Tensor, weight_scale: torch.Tensor, interleave: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 tensors of E experts → the kernel layout (words, scales); see ``reference.nvfp4_repack``.

    Parameters
    ----------
    weight : uint8 [E, N, Kp/2], two E2M1 codes per byte
    weight_scale : float8_e4m3fn [E, N, Kp/16] (finite, >= 0: checked, ValueError)
    interleave : True for GEMM1's stacked [gate; up] operand (rows interleaved by 8)

    Returns
    -------
    new tensors (words int32 [E, N/16, KC, 128], scales uint8 [E, N/16, KC, 64]) on weight's device, KC =
    ceil(Kp / 64). Bit-identical on every path.
    """
    if not nvfp4_repack_native_ok(weight, weight_scale):
        return reference.nvfp4_repack(weight, weight_scale, interleave)
    E, N, half = weight.shape
    raw = weight_scale.view(torch.uint8).contiguous()
    nvfp4_format.check_scales(raw, "weight_scale")  # load time: one host sync is fine here
    kc = nvfp4_format.chunks(2 * half)
    words = torch.empty(E, N // 16, kc, 128, dtype=torch.int32, device=weight.device)
    scales = torch.empty(E, N // 16, kc, 64, dtype=torch.uint8, device=weight.device)
    native._C.nvfp4_repack(weight.contiguous(), raw, N // 2 if interleave else 0, words, scales)
    return words, scales


def nvfp4_decode_native_ok(words: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``nvfp4_decode`` runs ``_C.nvfp4_decode``: int32 words [E, RT, KC, 128] and uint8 scales
    [E, RT, KC, 64] on one served device."""
    return (
        native.has_native("nvfp4_decode")
        and native.native_device(words.device)
        and words.dim() == 4
        and words.dtype == torch.int32
        and words.shape[3] == 128
        and scales.dtype == torch.uint8
        and scales.shape == (*words.shape[:3], 64)
        and scales.device == words.device
    )


def nvfp4_decode(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Test hook: the bf16 MMA operands the kernels decode; see ``reference.nvfp4_decode``.

    Parameters
    ----------
    words : int32 [E, RT, KC, 128] and scales : uint8 [E, RT, KC, 64], the output of ``nvfp4_repack``

    Returns
    -------
    new tensor bf16 [E, 16·RT, 64·KC] = E2M1·s·2^-7 in packed row order (exact: at most 6 significant bits),
    by the kernels' own fragment code on the CPU or CUDA.
    """
    if not nvfp4_decode_native_ok(words, scales):
        return reference.nvfp4_decode(words, scales)
    E, RT, kc = words.shape[:3]
    out = torch.empty(E, RT * 16, kc * nvfp4_format.CHUNK_K, dtype=torch.bfloat16, device=words.device)
    native._C.nvfp4_decode(words.contiguous(), scales.contiguous(), out)
    return out


def pack_experts(gate: tuple, up: tuple, down: tuple) -> PackedExperts:
    """ModelOpt tensors of one layer → PackedExperts, each projection a tuple (weight uint8 [E, N, Kp/2],
    weight_scale e4m3 [E, N, Kp/16], weight_scale_2 fp32 [E]); gate/up [E, I, pad16(H)/2], down
    [E, H, pad16(I)/2]. Repacks with ``nvfp4_repack`` (native when built) on the tensors' device."""
    E, inter = gate[0].shape[:2]
    hidden = down[0].shape[1]
    if up[0].shape != gate[0].shape or down[0].shape != (E, hidden, nvfp4_format.padded(inter) // 2):
        raise ValueError(
            f"pack_experts: gate {list(gate[0].shape)}, up {list(up[0].shape)} and down "
            f"{list(down[0].shape)} do not form one [E, I, H] expert set"
        )
    w13, s13 = nvfp4_repack(torch.cat([gate[0], up[0]], 1), torch.cat([gate[1], up[1]], 1), interleave=True)
    w2, s2 = nvfp4_repack(down[0], down[1])
    gs = torch.stack([gate[2], up[2], down[2]], 1).to(torch.float32).reshape(E, 3).contiguous()
    return PackedExperts(w13, s13, w2, s2, gs.to(w13.device), int(hidden), int(inter))
