"""The start-up self-check of the native ops: every native op runs once on small canonical
inputs against its PyTorch reference on the same device; an op that disagrees beyond its documented tolerance
is switched off for the process (``ops.switch_off_native``: its reference runs instead), with an error log.

Modes (``--native-ops``): ``auto`` checks and switches failing ops off; ``strict`` checks and raises
``NativeOpsError`` on any failure (the server refuses to start); ``off`` switches every native op off without
checking. The report (``SelfCheckReport``) feeds the start-up log, GetModelInfo and a metric.

Tolerances are the ops' own contracts (dgserve/ops docstrings, csrc/ops/*.h, docs/exactness.md): exact for the
integer ops, the processed logits, argmaxes and the renoise; 2 ulp of max(|g|, 1) for the Gumbel noise
(docs/seeded-noise.md); 3e-5 absolute for entropies; rel L2 3e-3 for the bf16 expert GEMMs and 1e-4 for fp32
sums in a different order. Inputs are built on the CPU from fixed seeds and copied to the device, so a run is
deterministic; well-separated logits keep the Gumbel race and the routing away from near-ties.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dgserve import ops
from dgserve.ops import reference
from dgserve.ops.nvfp4_format import PackedExperts, quantize
from dgserve.ops.nvfp4_repack import pack_experts

log = logging.getLogger("dgserve.ops.native_check")

MODES = ("auto", "off", "strict")


class NativeOpsError(RuntimeError):
    """A native op disagrees with its reference and --native-ops strict forbids serving with it switched off."""


@dataclass(frozen=True)
class OpResult:
    op: str
    ok: bool
    detail: str  # the measured error against the tolerance, or the exception


@dataclass
class SelfCheckReport:
    device: str
    mode: str
    results: list[OpResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> list[str]:
        return [r.op for r in self.results if r.ok]

    @property
    def failed(self) -> list[OpResult]:
        return [r for r in self.results if not r.ok]

    def summary(self) -> str:
        if self.mode == "off":
            return f"native ops on {self.device}: off (--native-ops off): every op runs its torch reference"
        bad = "; ".join(f"{r.op}: {r.detail}" for r in self.failed) or "none"
        return (
            f"native ops on {self.device}: {len(self.passed)} passed the self-check "
            f"({', '.join(self.passed) or '-'}); failed and switched off: {bad} [{self.seconds * 1e3:.0f} ms]"
        )


# ---------------------------------------------------------------------------------------------------- checks


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _exact(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or not torch.equal(got, want):
        n = int((got != want).sum()) if got.shape == want.shape else -1
        return f"{name} differs from the reference at {n} of {want.numel()} elements (must be exact)"
    return None


def _noise_args(device, B=2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(11)
    seeds = torch.randint(0, 2**62, (B,), generator=g)
    blocks = torch.randint(0, 40, (B,), generator=g)
    steps = torch.randint(1, 48, (B,), generator=g)
    return seeds.to(device), blocks.to(device), steps.to(device)


# The references of the device-independent contracts (integer noise, the Gumbel noise, align, the acceptance)
# run on the CPU: torch's CUDA log and scans have their own rounding, which the contracts do not promise.


def check_canvas_noise(device) -> str | None:
    args = _noise_args(device)
    return _exact("canvas", ops.canvas_noise(*args, 37, 1009), reference.canvas_noise(*_noise_args("cpu"), 37, 1009))


def check_gumbel_noise(device) -> str | None:
    args = _noise_args(device)
    got, want = ops.gumbel_noise(*args, 5, 211).cpu(), reference.gumbel_noise(*_noise_args("cpu"), 5, 211)
    ulp = torch.from_numpy(__import__("numpy").spacing(want.abs().clamp_min(1).numpy()))
    err = ((got - want).abs() / ulp).max().item()
    return None if err <= 2 else f"noise is {err:.1f} ulp of max(|g|, 1) from the reference (tolerance 2)"


def _step_args(device, dtype):
    g = _gen(5)
    B, C, V = 2, 24, 333
    logits = (4 * torch.randn(B, C, V, generator=g)).to(dtype)
    temperature = torch.tensor([0.5, 0.75])
    bound = torch.tensor([1e30, 2.0])  # row 0 accepts all (canvas = the sample), row 1 renoises some
    seeds, blocks, steps = _noise_args("cpu", B)
    return [t.to(device) for t in (logits, temperature, seeds, blocks, steps, bound)]


def check_diffusion_step(device) -> str | None:
    for dtype in (torch.float32, torch.bfloat16):
        args = _step_args(device, dtype)
        got, want = ops.diffusion_step(*args), reference.diffusion_step(*args)
        for name in ("processed", "argmax"):
            bad = _exact(f"{name} ({dtype})", getattr(got, name), getattr(want, name))
            if bad:
                return bad
        err = (got.entropy.cpu() - want.entropy.cpu()).abs().max().item()
        if not err <= 3e-5:
            return f"entropy is {err:.2e} from the reference (tolerance 3e-5)"
        # the sample is the argmax of processed + the op's own noise (checked against the reference above);
        # rejected positions hold the contract renoise: both exact given the acceptance the op reports
        sample = torch.argmax(got.processed + ops.gumbel_noise(*args[2:5], *got.processed.shape[1:]), dim=-1)
        renoise = ops.canvas_noise(*args[2:5], *got.processed.shape[1:])
        bad = _exact(f"canvas ({dtype})", got.canvas, torch.where(got.accepted, sample, renoise))
        if bad:
            return bad
        if not bool(got.accepted[0].all()):
            return "a row with an unbounded entropy budget did not accept every position"
        accepted = reference.entropy_bound_accept(got.entropy.cpu(), args[5].cpu())
        bad = _exact(f"accepted ({dtype})", got.accepted, accepted)
        if bad:
            return bad
    return None


def _router_args(device, dtype, T=40, H=64, E=16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(3)
    residual = (2 * torch.randn(T, H, generator=g)).to(dtype)
    scale = (torch.rand(H, generator=g) + 0.5).to(dtype)
    proj = (torch.randn(E, H, generator=g) * 4 * H**-0.5).to(dtype)  # well-separated logits: no near-ties
    pes = torch.rand(E, generator=g) + 0.5
    return residual.to(device), scale.to(device), proj.to(device), pes.to(device)


def check_moe_route(device) -> str | None:
    args = _router_args(device, torch.float32)
    w, ids = ops.moe_route(*args, 4, 1e-6)
    w_ref, ids_ref = reference.moe_route(*args, 4, 1e-6)
    if torch.device(device).type == "cpu":
        return _exact("ids", ids, ids_ref) or _exact("weights", w, w_ref)
    rows = (ids.cpu() == ids_ref.cpu()).all(-1)
    if rows.float().mean().item() < 0.95:
        return f"expert ids agree with the reference in {rows.float().mean().item():.0%} of rows (tolerance 95%)"
    err = _rel_l2(w.cpu()[rows], w_ref.cpu()[rows])
    return None if err <= 1e-4 else f"routing weights rel L2 {err:.2e} from the reference (tolerance 1e-4)"


def _ids(device, T=40, E=16, K=4):
    return torch.rand(T, E, generator=_gen(9)).topk(K, dim=-1).indices.to(device)


def check_moe_align(device) -> str | None:
    ids = _ids(device)
    got, want = ops.moe_align(ids, 16, 8), reference.moe_align(ids.cpu(), 16, 8)
    for name in ("counts", "offsets", "sorted_pairs", "block_expert"):
        bad = _exact(name, getattr(got, name), getattr(want, name))
        if bad:
            return bad
    return None


def check_moe_combine(device) -> str | None:
    g = _gen(4)
    y, w = torch.randn(40, 4, 64, generator=g).to(device), torch.rand(40, 4, generator=g).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        bad = _exact(f"combine ({dtype})", ops.moe_combine(y, w, dtype), reference.moe_combine(y, w, dtype))
        if bad:
            return bad
    return None


def _experts_args(device, T=40, H=64, I=32, E=16, K=4):
    g = _gen(8)
    x = torch.randn(T, H, generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).bfloat16()
    w = torch.rand(T, K, generator=g)
    return [t.to(device) for t in (x, gate_up, down, w, _ids("cpu", T, E, K))]


def check_linear(device) -> str | None:
    g = _gen(21)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(19, 37, generator=g).to(dtype), torch.randn(23, 37, generator=g).to(dtype)
        problem = _exact(f"linear ({dtype})", ops.linear(x.to(device), w.to(device)).cpu(), reference.linear(x, w))
        if problem is not None:
            return problem
    return None


def check_gelu_tanh_mul(device) -> str | None:
    g = _gen(22)
    gate, up = torch.randn(7, 300, generator=g) * 4, torch.randn(7, 300, generator=g)
    got, want = ops.gelu_tanh_mul(gate.to(device), up.to(device)).cpu(), reference.gelu_tanh_mul(gate, up)
    err = ((got - want).abs() / (gate * up).abs().clamp_min(1e-30)).max().item()  # torch's own GELU cancels below 0
    return None if err <= 1e-6 else f"gelu_tanh_mul is {err:.2e} of |gate·up| from the reference (tolerance 1e-6)"


def check_decode_attention(device) -> str | None:
    g = _gen(23)
    q = torch.randn(4, 2 * 5, 24, generator=g)
    keys = [torch.randn(2, n, 24, generator=g) for n in (7, 21)]
    values = [torch.randn(2, n, 24, generator=g) for n in (7, 21)]
    ck, cv = torch.randn(2, 10, 24, generator=g), torch.randn(2, 10, 24, generator=g)
    got = ops.decode_attention(
        q.to(device), [k.to(device) for k in keys], [v.to(device) for v in values], ck.to(device), cv.to(device), 5
    )
    err = _rel_l2(got, reference.decode_attention(q, keys, values, ck, cv, 5))
    return None if err <= 1e-5 else f"decode_attention is {err:.2e} rel L2 from the reference (tolerance 1e-5)"


def check_rope(device) -> str | None:
    g = _gen(25)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(9, 3, 10, generator=g).to(dtype)
        cos, sin = torch.randn(9, 10, generator=g).to(dtype), torch.randn(9, 10, generator=g).to(dtype)
        got = ops.rope(x.to(device), cos.to(device), sin.to(device))
        problem = _exact(f"rope ({dtype})", got, reference.rope(x, cos, sin))
        if problem is not None:
            return problem
    return None


def check_rms_norm_add(device) -> str | None:
    g = _gen(27)
    for dtype in (torch.float32, torch.bfloat16):
        r, x = torch.randn(7, 33, generator=g).to(dtype), (torch.randn(7, 33, generator=g) * 3).to(dtype)
        w, s = 1 + 0.3 * torch.randn(33, generator=g), torch.tensor([0.625]).to(dtype)
        for weight, scale in ((w, None), (None, s)):
            got = ops.rms_norm_add(r.to(device), x.to(device), _on(weight, device), 1e-6, _on(scale, device))
            problem = _exact(f"rms_norm_add ({dtype})", got, reference.rms_norm_add(r, x, weight, 1e-6, scale))
            if problem is not None:
                return problem
    return None


def check_rms_norm_rope(device) -> str | None:
    g = _gen(28)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = (torch.randn(9, 3, 10, generator=g) * 3).to(dtype), 1 + 0.3 * torch.randn(10, generator=g)
        cos, sin = torch.randn(9, 10, generator=g).to(dtype), torch.randn(9, 10, generator=g).to(dtype)
        got = ops.rms_norm_rope(x.to(device), w.to(device), 1e-6, cos.to(device), sin.to(device))
        problem = _exact(f"rms_norm_rope ({dtype})", got, reference.rms_norm_rope(x, w, 1e-6, cos, sin))
        if problem is not None:
            return problem
    return None


def _on(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def check_softcap(device) -> str | None:
    x = torch.cat([torch.randn(4000, generator=_gen(24)) * 40, torch.tensor([0.0, -0.0, 1e-30, 7.4, -7.6, 2e4])])
    got, want = ops.softcap(x.clone().to(device), 30.0).cpu(), reference.softcap(x.clone(), 30.0)
    err = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
    return None if err <= 5e-7 else f"softcap is {err:.2e} relative from the reference (tolerance 5e-7)"


def check_softmax_rows(device) -> str | None:
    g = _gen(26)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, 300, generator=g) * 8).to(dtype)
        got, want = ops.softmax_rows(x.to(device)).cpu(), reference.softmax_rows(x)
        err = ((got - want).abs() / want.clamp_min(1e-30)).max().item()
        if err > 2e-6:
            return f"softmax_rows ({dtype}) is {err:.2e} relative from the reference (tolerance 2e-6)"
    return None


def check_moe_experts(device) -> str | None:
    args = _experts_args(device)
    err = _rel_l2(ops.moe_experts(*args), reference.moe_experts(*args))
    return None if err <= 3e-3 else f"bf16 expert MLP rel L2 {err:.2e} from the reference (tolerance 3e-3)"


@functools.lru_cache(maxsize=1)
def _nvfp4_cpu(H=64, I=32, E=4):
    """(PackedExperts fields, ModelOpt tensors) of E random experts, on the CPU, built once."""
    g = _gen(12)

    def proj(n, k):
        qs = [quantize(torch.randn(n, k, generator=g) * k**-0.5) for _ in range(E)]
        return tuple(torch.stack([q[i] for q in qs]) for i in range(3))

    gate, up, down = proj(I, H), proj(I, H), proj(H, I)
    with ops.native_disabled():  # the layout from the reference repack: checked separately below
        packed = pack_experts(gate, up, down)
    return tuple(packed), (gate, up, down)


def _nvfp4_experts(device):
    fields, modelopt = _nvfp4_cpu()
    return [t.to(device) if isinstance(t, torch.Tensor) else t for t in fields], modelopt


def check_nvfp4_repack(device) -> str | None:
    _, (gate, _, _) = _nvfp4_experts("cpu")
    w, s = gate[0].to(device), gate[1].to(device)
    got, want = ops.nvfp4_repack(w, s, interleave=True), reference.nvfp4_repack(w, s, interleave=True)
    return _exact("words", got[0], want[0]) or _exact("scales", got[1], want[1])


def check_nvfp4_moe_experts(device) -> str | None:
    fields, _ = _nvfp4_experts(device)
    packed = PackedExperts(*fields)
    x, _, _, w, ids = _experts_args(device, T=24, E=4, K=2)
    got = ops.nvfp4_moe_experts(x, packed, w, ids)
    want = reference.nvfp4_moe_experts(x, packed, w, ids)
    err = _rel_l2(got, want)
    tol = 0.0 if torch.device(device).type == "cpu" else 3e-3
    return None if err <= tol else f"NVFP4 expert MLP rel L2 {err:.2e} from the reference (tolerance {tol:g})"


def check_rms_norm(device) -> str | None:
    g = _gen(2)
    x, w = torch.randn(7, 300, generator=g).to(device), (1 + torch.randn(300, generator=g)).to(device)
    if torch.device(device).type == "cpu":
        return _exact("rms_norm", ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    # CUDA: a tree sum instead of torch's order: fp32 within 4 ulp; bf16 within one bf16 rounding
    for dtype, rtol in ((torch.float32, 5e-7), (torch.bfloat16, 2**-8)):
        got, want = (
            ops.rms_norm(x.to(dtype), w, 1e-6).float().cpu(),
            reference.rms_norm(x.to(dtype), w, 1e-6).float().cpu(),
        )
        err = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
        if not err <= rtol:
            return f"rms_norm ({dtype}) is {err:.2e} relative from the reference (tolerance {rtol:.1e})"
    return None


CHECKS: dict[str, Callable[[torch.device], str | None]] = {
    "rms_norm": check_rms_norm,
    "linear": check_linear,
    "gelu_tanh_mul": check_gelu_tanh_mul,
    "decode_attention": check_decode_attention,
    "softcap": check_softcap,
    "rope": check_rope,
    "rms_norm_add": check_rms_norm_add,
    "rms_norm_rope": check_rms_norm_rope,
    "softmax_rows": check_softmax_rows,
    "canvas_noise": check_canvas_noise,
    "gumbel_noise": check_gumbel_noise,
    "diffusion_step": check_diffusion_step,
    "moe_route": check_moe_route,
    "moe_align": check_moe_align,
    "moe_experts": check_moe_experts,
    "moe_combine": check_moe_combine,
    "nvfp4_repack": check_nvfp4_repack,
    "nvfp4_moe_experts": check_nvfp4_moe_experts,
}


# ---------------------------------------------------------------------------------------------------- driver

_reports: dict[tuple[str, str], SelfCheckReport] = {}
_lock = threading.Lock()


def run_self_check(device: torch.device | str, mode: str = "auto", *, force: bool = False) -> SelfCheckReport:
    """Check every native op serving ``device`` once per process (memoised per device and mode; ``force``
    re-runs). auto: failing ops are switched off (error log); strict: NativeOpsError on any failure (the failing
    ops are switched off too, for callers that catch it); off: every native op is switched off, nothing runs."""
    if mode not in MODES:
        raise ValueError(f"native_ops must be one of {', '.join(MODES)}, got {mode!r}")
    device = torch.device(device)
    key = (str(device), mode)
    with _lock:
        if key in _reports and not force:
            report = _reports[key]
        else:
            report = _run(device, mode)
            _reports[key] = report
    if mode == "strict" and report.failed:
        raise NativeOpsError("--native-ops strict: " + report.summary())
    return report


def _run(device: torch.device, mode: str) -> SelfCheckReport:
    report = SelfCheckReport(str(device), mode)
    if mode == "off":
        for op in ops.NATIVE_OPS:
            ops.switch_off_native(op, "--native-ops off")
        log.warning(report.summary())
        return report
    t0 = time.perf_counter()
    for op in ops.active_native_ops(device):
        try:
            problem = CHECKS[op](device)
        except Exception as e:  # noqa: BLE001 - a crash is a failed check, reported with the exception
            problem = f"raised {type(e).__name__}: {e}"
        report.results.append(OpResult(op, problem is None, problem or "ok"))
        if problem is not None:
            ops.switch_off_native(op, f"self-check on {device}: {problem}")
            log.error(
                "native op %s disagrees with its reference on %s: %s; switched off for this process "
                "(its torch reference runs instead)",
                op,
                device,
                problem,
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report.seconds = time.perf_counter() - t0
    log.info(report.summary())
    return report


def forget_reports() -> None:
    """Tests: drop the memoised reports (pair with ``ops.switch_on_native()``)."""
    with _lock:
        _reports.clear()


def main(argv: list[str] | None = None) -> int:
    """``python -m dgserve.ops.native_check [DEVICE] [--mode auto|strict]``: run the self-check, print the report."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dgserve.ops.native_check", description=main.__doc__)
    p.add_argument("device", nargs="?", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", choices=("auto", "strict"), default="strict")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = run_self_check(args.device, args.mode)
    except NativeOpsError as e:
        print(e)
        return 1
    for r in report.results:
        print(f"{r.op:20s} {'ok' if r.ok else 'FAILED'}  {r.detail}")
    print(report.summary())
    return 0 if not report.failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
