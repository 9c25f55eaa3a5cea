"""Shared inputs and float64 oracles for the NVFP4 op tests (test_nvfp4_*.py); not collected by pytest."""

from __future__ import annotations

import torch

from dgserve.model import nvfp4

E2M1_F64 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e4m3_f64(byte: int) -> float:
    """Independent E4M3FN decode from the bits (docs/kernels.md, "NVFP4 format")."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def e2m1_f64(code: int) -> float:
    return -E2M1_F64[code & 7] if code & 8 else E2M1_F64[code & 7]


# all finite non-negative E4M3 bytes: 0 and the 126 positive values, plus -0 (0x80): 128 rows
SCALE_BYTES = list(range(0x7F)) + [0x80]


def exhaustive_matrix():
    """[1, 128, 128] u8 weight + [1, 128, 16] scales: row r, block j has scale SCALE_BYTES[(r + 37j) % 128] and the
    16 codes rotated by r + j, so every (code, scale) pair occurs at many fragment positions."""
    r = torch.arange(128)[:, None, None]
    j = torch.arange(16)[None, :, None]
    codes = ((torch.arange(16)[None, None, :] + r + j) % 16).to(torch.uint8).reshape(128, 256)
    scale_idx = (torch.arange(128)[:, None] + 37 * torch.arange(16)[None, :]) % 128
    scale = torch.tensor(SCALE_BYTES, dtype=torch.uint8)[scale_idx]
    weight = (codes[:, 1::2] << 4) | codes[:, 0::2]
    return weight[None], scale.view(torch.float8_e4m3fn)[None], codes, scale


def quantized(E: int, N: int, K: int, seed: int, magnitude: float = 1.0, spread: int = 2, device: str = "cpu"):
    """E random matrices [N, K] quantized with nvfp4.quantize → (weight [E, N, Kp/2] u8, weight_scale [E, N, Kp/16]
    e4m3, weight_scale_2 [E] fp32); row magnitudes spread over 2^±spread so many block scales occur."""
    g = torch.Generator().manual_seed(seed)
    out = [[], [], []]
    for e in range(E):
        w = torch.randn(N, K, generator=g) * magnitude * (1 + e) / E
        w = w * torch.exp2(torch.randint(-spread, spread + 1, (N, 1), generator=g).float())
        for lst, t in zip(out, nvfp4.quantize(w.to(device)), strict=True):
            lst.append(t.cpu())
    return tuple(torch.stack(t) for t in out)


def layer(E: int, H: int, I: int, seed: int, up_ratio: float = 10.0, device: str = "cpu"):
    """(gate, up, down) ModelOpt tensors of one layer (on the CPU; quantized on `device`); up is `up_ratio`×
    larger, so gs_up ≠ gs_gate."""
    return (
        quantized(E, I, H, seed, device=device),
        quantized(E, I, H, seed + 1, up_ratio, device=device),
        quantized(E, H, I, seed + 2, device=device),
    )


def dequant_f64(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, k: int) -> torch.Tensor:
    """Exact float64 W = E2M1 · E4M3 · gs
    (docs/kernels.md, "Kernel tests and tolerances") of one expert [N, Kp/2] → [N, k]."""
    codes = nvfp4.unpack(weight)
    vals = torch.tensor([e2m1_f64(c) for c in range(16)], dtype=torch.float64)[codes.long()]
    s = scale.to(torch.float64).repeat_interleave(nvfp4.GROUP, dim=1)
    return (vals * s * scale_2.double())[:, :k]


def exact_moe(
    x: torch.Tensor,
    gate,
    up,
    down,
    weights: torch.Tensor,
    ids: torch.Tensor,
    H: int,
    I: int,
    faithful: bool = False,
    with_bound: bool = False,
):
    """Σ_k w · Wd·(gelu_tanh(Wg·x) ⊙ Wu·x) in float64 → [T, H] (`faithful`: the GEMM1 output rounded to bf16
    where the kernel rounds it). `with_bound` also returns a rigorous per-element bound on |kernel − exact| for
    a bf16 output: 2^-8·|y| (output rounding) + 2^-8·S (the bf16 rounding of each GEMM1 output a_j, ≤ 2^-8·|a_j|,
    S = Σ_k |w| Σ_j |Wd[h, j]|·|a_j|) + 1e-4·R (fp32 sums and fp32 gelu: R = the same sum over |Wg||x|·|Wu||x|)."""
    T, K = ids.shape
    xf = x.double()
    out = torch.zeros(T, H, dtype=torch.float64)
    s_term, r_term = torch.zeros_like(out), torch.zeros_like(out)
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        wg, wu = (dequant_f64(p[0][e], p[1][e], p[2][e], H) for p in (gate, up))
        wd = dequant_f64(down[0][e], down[1][e], down[2][e], I)
        a = torch.nn.functional.gelu(xf[t] @ wg.T, approximate="tanh") * (xf[t] @ wu.T)
        if faithful:
            a = a.to(torch.bfloat16).double()
        w = weights[t, k, None].double()
        out.index_add_(0, t, (a @ wd.T) * w)
        s_term.index_add_(0, t, (a.abs() @ wd.abs().T) * w.abs())
        r_term.index_add_(0, t, (((xf[t].abs() @ wg.abs().T) * (xf[t].abs() @ wu.abs().T)) @ wd.abs().T) * w.abs())
    if with_bound:
        return out, 2.0**-8 * (out.abs() + s_term) + 1e-4 * r_term
    return out


def routing(T: int, E: int, K: int, seed: int, experts: list[int] | None = None):
    """ids [T, K] int64 (distinct per token, drawn from `experts` or all E) and weights [T, K] fp32."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else list(range(E)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:K]] for _ in range(T)]).long()
    weights = torch.rand(T, K, generator=g) + 0.1
    return ids, (weights / weights.sum(-1, keepdim=True)).float()


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    """|out − ref| ≤ bound everywhere."""
    excess = (out.double() - ref.double()).abs() - bound
    assert excess.max().item() <= 0, f"bound exceeded by {excess.max().item():.3g} at {excess.argmax().item()}"
