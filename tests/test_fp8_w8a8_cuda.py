"""FP8 W8A8 on a CUDA device (docs/exactness.md, "FP8 W8A8"): the path the runtime picks on sm_89+, the scaled GEMM
against fp32 math on its quantized operands, and the tiny model's W8A8 logits against the same checkpoint dequantized
on the device (the bound and why: tests/test_fp8_w8a8.py, ``test_w8a8_model_on_cpu``). `cuda`: skipped without a
device (tests/conftest.py)."""

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

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    src = tmp_path_factory.mktemp("w8a8-cuda-src")
    make_random_checkpoint(src, "tiny", seed=3)
    return write_fp8_checkpoint(src, tmp_path_factory.mktemp("w8a8-cuda-fp8"))


def _sm89():
    return torch.cuda.get_device_capability() >= w8a8.MIN_CAPABILITY


def test_cuda_picks_w8a8_on_sm89(fp8_dir):
    kind, why = w8a8.decide("cuda", torch.bfloat16)
    assert kind == (w8a8.W8A8 if _sm89() else w8a8.DEQUANTIZED), why
    plan = plan_runtime(fp8_dir, device="cuda")
    assert plan.expert_format == ("fp8 (W8A8 scaled_mm, bfloat16 out)" if _sm89() else "fp8 (dequantized to bfloat16)")


def test_scaled_linear_on_cuda_is_the_fp32_math_of_its_operands():
    if not _sm89():
        pytest.skip("no FP8 tensor cores (sm_89+)")
    g = torch.Generator().manual_seed(4)
    qw, sw = fp8.quantize(torch.randn(96, 64, generator=g) * 0.05)
    x = torch.randn(13, 64, generator=g).to(torch.bfloat16)
    y = F.linear(x.cuda(), w8a8.Fp8Linear(qw.cuda(), sw.cuda(), torch.bfloat16)).cpu().float()
    qx, sx = w8a8.quantize_rows(x)
    a, b = qx.float() * sx, fp8.dequantize(qw, sw)
    ref, mag = a @ b.T, a.abs() @ b.abs().T
    assert bool(((y - ref).abs() <= 64 * 2.0**-24 * mag + 2.0**-8 * ref.abs()).all())


def test_w8a8_logits_against_dequantized_on_cuda(fp8_dir):
    if not _sm89():
        pytest.skip("no FP8 tensor cores (sm_89+)")
    deq = DiffusionGemma.from_pretrained(fp8_dir, device="cuda", dtype=torch.bfloat16, fp8_w8a8=False)
    w8 = DiffusionGemma.from_pretrained(fp8_dir, device="cuda", dtype=torch.bfloat16)  # the default: W8A8
    assert isinstance(w8.layers[0].q_proj, w8a8.Fp8Linear) and w8.layers[1].experts_fp8 is not None
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, deq.config.vocab_size, (1, 11), generator=g)
    canvas = torch.randint(0, deq.config.vocab_size, (1, deq.config.canvas_length), generator=g)
    a = deq.denoise(deq.prefill(prompt), canvas).float().cpu()
    b = w8.denoise(w8.prefill(prompt), canvas).float().cpu()
    assert bool(torch.isfinite(b).all())
    assert ((a - b).norm() / a.norm()).item() < 0.5
