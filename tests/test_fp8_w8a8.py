"""FP8 W8A8 on the CPU (docs/exactness.md, "FP8 W8A8"): the per-token activation quantizer against its formula, the
scaled GEMMs (``torch._scaled_mm`` runs on the CPU in this torch) against fp32 math on the same quantized operands,
the error against the dequantized path within the bound activation rounding allows, the path decision, and a
whole model loaded as W8A8. The CUDA comparison is tests/test_fp8_w8a8_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fp8_checkpoint import write_fp8_checkpoint

from dgserve import DiffusionGemma
from dgserve.model import fp8
from dgserve.model import fp8_w8a8 as w8a8
from dgserve.model.runtime import plan_runtime
from dgserve.model.tiny import make_random_checkpoint
from dgserve.ops import reference

# E4M3 keeps 3 mantissa bits: round to nearest is within 2^-4 of |v| for normal codes, and within half the smallest
# subnormal step (2^-10, in units of the row's scale) below 2^-6.
REL, SUB = 2.0**-4, 2.0**-10


def _decode(q, s):
    return q.float() * s


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 33), (17, 129)])
def test_quantize_rows_reconstructs_within_e4m3_rounding(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 3
    q, s = w8a8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (shape[0], 1)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / 448)
    assert bool((q.float().abs().amax(-1) == 448).all())  # each row's amax maps onto the largest code
    err = (_decode(q, s) - x).abs()
    assert bool((err <= REL * x.abs() + SUB * s).all())


def test_quantize_rows_zero_rows_and_amax_448():
    x = torch.tensor([[0.0, 0.0, 0.0], [448.0, -1.0, 0.5], [-448.0, 448.0, 2.0**-9]])
    q, s = w8a8.quantize_rows(x)
    assert s[0].item() == torch.finfo(torch.float32).tiny and torch.equal(q[0].float(), torch.zeros(3))
    assert torch.equal(s[1:], torch.ones(2, 1))  # amax exactly 448: scale 1, codes are the values themselves
    assert torch.equal(q[1:].float(), x[1:])  # 448, 1, 0.5 and the smallest subnormal 2^-9 are all codes
    bf = torch.tensor([[3.0, -7.5, 0.0]], dtype=torch.bfloat16)
    qb, sb = w8a8.quantize_rows(bf)  # bf16 in: the amax and the division in fp32
    assert torch.equal(sb, torch.tensor([[7.5 / 448]])) and qb.float()[0, 1].item() == -448.0


def _quantized_operands(n, k, m, seed):
    g = torch.Generator().manual_seed(seed)
    qw, sw = fp8.quantize(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(m, k, generator=g)
    return x, qw, sw


@pytest.mark.parametrize("dims", [(24, 40, 3), (7, 33, 5), (96, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_linear_is_the_fp32_math_of_its_operands(dims, dtype):
    """y = rnd_md(Σ f32(qx)·f32(qw) · s_x · s_w): products of E4M3 codes are exact in fp32, so the only freedom is the
    summation order (≤ K·2^-24 of Σ|terms|) and the rounding to md: bf16 out is allowed two roundings (2^-8
    relative; where the kernel applies the scales is its own choice)."""
    x, qw, sw = _quantized_operands(*dims, seed=dims[0])
    x = x.to(dtype)
    y = F.linear(x, w8a8.Fp8Linear(qw, sw, dtype))
    qx, sx = w8a8.quantize_rows(x)
    a, b = _decode(qx, sx), fp8.dequantize(qw, sw)
    ref, mag = a @ b.T, a.abs() @ b.abs().T
    out_round = 2.0**-24 if dtype == torch.float32 else 2.0**-8
    assert y.dtype == dtype and y.shape == (dims[2], dims[0])
    assert bool(((y.float() - ref).abs() <= dims[1] * 2.0**-24 * mag + out_round * ref.abs()).all())


def test_scaled_linear_error_against_dequantized_is_bounded():
    x, qw, sw = _quantized_operands(48, 80, 9, seed=5)
    wd = fp8.dequantize(qw, sw)
    _, sx = w8a8.quantize_rows(x)
    y, ref = F.linear(x, w8a8.Fp8Linear(qw, sw, torch.float32)), F.linear(x, wd)
    bound = (REL * x.abs() + SUB * sx) @ wd.abs().T  # Σ_k |x_k - deq(q_k)|·|w_k|
    assert bool(((y - ref).abs() <= bound * (1 + 1e-5) + 1e-6).all())


def test_fp8_linear_other_ops_see_the_dequantized_weight():
    _, qw, sw = _quantized_operands(8, 16, 1, seed=1)
    w = w8a8.Fp8Linear(qw, sw, torch.float32)
    assert w.shape == (8, 16) and w.dtype == torch.float32
    assert torch.equal(w * 1, fp8.dequantize(qw, sw)) and type(w * 1) is torch.Tensor


def _experts(E, H, inter, seed):
    g = torch.Generator().manual_seed(seed)
    gu = [fp8.quantize(torch.randn(2 * inter, H, generator=g) * 0.1) for _ in range(E)]
    dn = [fp8.quantize(torch.randn(H, inter, generator=g) * 0.1) for _ in range(E)]
    ex = w8a8.Fp8Experts(
        torch.stack([q for q, _ in gu]),
        torch.stack([s.reshape(-1) for _, s in gu]).float(),
        torch.stack([q for q, _ in dn]),
        torch.stack([s.reshape(-1) for _, s in dn]).float(),
    )
    return ex, g


def test_moe_experts_follow_the_w8a8_formula():
    """Each routed pair: gate/up from the token's quantized row, GELU-tanh product quantized per row, down; combined
    in fp32 in slot order (ops.reference.moe_combine). The reference below decodes the same codes by hand."""
    E, H, inter, T, K = 4, 24, 12, 7, 2
    ex, g = _experts(E, H, inter, seed=3)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=g)
    got = w8a8.moe_experts(x, ex, wts, ids)
    qx, sx = w8a8.quantize_rows(x)
    y = torch.empty(T, K, H)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            gu = _decode(qx[t : t + 1], sx[t : t + 1]) @ (ex.gate_up[e].float() * ex.gate_up_scale[e, :, None]).T
            h = F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
            qh, sh = w8a8.quantize_rows(h)
            y[t, k] = (_decode(qh, sh) @ (ex.down[e].float() * ex.down_scale[e, :, None]).T)[0]
    ref = reference.moe_combine(y, wts, torch.float32)
    # fp32 sums in another order may move h across an E4M3 rounding boundary: allow one code step of h (2^-3 of it)
    # through the down projection, relative to the output's magnitude
    assert ((got - ref).norm() / ref.norm()).item() < 2.0**-3


def test_decide_and_plan():
    assert w8a8.decide("cpu", torch.float32)[0] == w8a8.DEQUANTIZED
    assert w8a8.decide("cpu", torch.bfloat16, request=True)[0] == w8a8.W8A8  # _scaled_mm runs on this CPU
    assert w8a8.decide("cuda", torch.bfloat16, request=False) == (w8a8.DEQUANTIZED, "requested")
    assert w8a8.keeps_codes("layers.0.self_attn.q_proj.weight", (64, 64), "cuda")
    assert not w8a8.keeps_codes("layers.0.self_attn.q_proj.weight", (40, 64), "cuda")  # _scaled_mm needs 16 | dims
    assert not w8a8.keeps_codes("embed_tokens.weight", (300, 64), "cpu")
    assert not w8a8.keeps_codes("layers.0.router.proj.weight", (4, 64), "cpu")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    src = tmp_path_factory.mktemp("w8a8-src")
    make_random_checkpoint(src, "tiny", seed=3)
    return write_fp8_checkpoint(src, tmp_path_factory.mktemp("w8a8-fp8"))


def test_plan_reports_the_fp8_path(fp8_dir):
    plan = plan_runtime(fp8_dir)
    assert plan.expert_format == "fp8 (dequantized to float32)" and plan.fp8_path.startswith("cpu: dequantized")
    assert plan_runtime(fp8_dir.parent).fp8_path is None  # no checkpoint: no FP8 path


def test_w8a8_model_on_cpu(fp8_dir):
    """The whole model as W8A8 against the same checkpoint dequantized: per-op errors are a few % (E4M3 activations,
    tests above), and this random 3-layer model amplifies rounding (bf16 vs fp32 alone moves its logits by 4-8e-2);
    measured rel-L2 0.29-0.36 over 3 seeds in fp32 and bf16, so the bound is 0.5 (a wrong scale or layout is > 1)."""
    deq = DiffusionGemma.from_pretrained(fp8_dir)
    w8 = DiffusionGemma.from_pretrained(fp8_dir, fp8_w8a8=True)
    assert isinstance(w8.layers[0].q_proj, w8a8.Fp8Linear) and isinstance(w8.sc_gate, w8a8.Fp8Linear)
    assert w8.layers[1].experts_fp8 is not None and w8.layers[1].experts_gate_up is None
    assert w8.layers[1].experts_fp8.gate_up.dtype == torch.float8_e4m3fn
    assert type(w8.embed) is torch.Tensor and type(w8.layers[1].router_proj) is torch.Tensor
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, deq.config.vocab_size, (1, 11), generator=g)
    canvas = torch.randint(0, deq.config.vocab_size, (1, deq.config.canvas_length), generator=g)
    a, b = deq.denoise(deq.prefill(prompt), canvas), w8.denoise(w8.prefill(prompt), canvas)
    assert bool(torch.isfinite(b).all())
    assert ((a - b).norm() / a.norm()).item() < 0.5
