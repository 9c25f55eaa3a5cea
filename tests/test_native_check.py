"""The start-up self-check of the native ops, on the CPU by injecting wrong results into
dgserve._C: auto switches the op off (error log, the reference runs, metric and GetModelInfo entries), strict
refuses to start, off uses no native op."""

from __future__ import annotations

import logging

import pytest
import torch

from dgserve import Engine, ops
from dgserve.model.tiny import preset, random_weights
from dgserve.ops import native_check as nc
from dgserve.ops import reference


@pytest.fixture(autouse=True)
def _restore():
    nc.forget_reports()
    ops.switch_on_native()
    yield
    nc.forget_reports()
    ops.switch_on_native()


class _Injected:
    """dgserve._C with one op replaced: `corrupt(args)` runs after the real op and may change its outputs."""

    def __init__(self, real, op, corrupt):
        self._real, self._op, self._corrupt = real, op, corrupt

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name != self._op:
            return attr

        def wrapped(*args):
            out = attr(*args)
            self._corrupt(args)
            return out

        return wrapped


def _bump_canvas(args):  # _C.diffusion_step(logits, T, seeds, blocks, steps, bound, canvas, ...)
    args[6][..., 0] += 1


def _raise(args):
    raise RuntimeError("injected crash")


@pytest.fixture
def wrong_step(monkeypatch):
    if ops.native._C is None:
        pytest.skip("dgserve._C is not built")
    monkeypatch.setattr(ops.native, "_C", _Injected(ops.native._C, "diffusion_step", _bump_canvas))


def test_all_native_ops_pass_on_the_cpu():
    if ops.native._C is None:
        pytest.skip("dgserve._C is not built")
    report = nc.run_self_check("cpu", "auto")
    assert report.failed == [] and set(report.passed) == set(ops.active_native_ops("cpu"))
    assert "diffusion_step" in report.passed and "moe_align" in report.passed


def test_auto_switches_a_wrong_op_off(wrong_step, caplog):
    with caplog.at_level(logging.ERROR, logger="dgserve.ops.native_check"):
        report = nc.run_self_check("cpu", "auto")
    assert [r.op for r in report.failed] == ["diffusion_step"]
    assert "canvas" in report.failed[0].detail
    assert not ops.has_native("diffusion_step") and "diffusion_step" in ops.switched_off()
    assert "diffusion_step" not in ops.active_native_ops("cpu") and "moe_align" in ops.active_native_ops("cpu")
    assert any("diffusion_step" in r.message and "switched off" in r.message for r in caplog.records)
    # the op now runs its reference: the injected error is gone
    args = nc._step_args("cpu", torch.float32)
    got, want = ops.diffusion_step(*args), reference.diffusion_step(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_crashing_op_is_switched_off(monkeypatch):
    if ops.native._C is None:
        pytest.skip("dgserve._C is not built")
    monkeypatch.setattr(ops.native, "_C", _Injected(ops.native._C, "moe_align", _raise))
    report = nc.run_self_check("cpu", "auto")
    assert [r.op for r in report.failed] == ["moe_align"] and "injected crash" in report.failed[0].detail


def test_strict_refuses(wrong_step):
    with pytest.raises(nc.NativeOpsError, match="diffusion_step"):
        nc.run_self_check("cpu", "strict")


def test_off_uses_no_native_op():
    report = nc.run_self_check("cpu", "off")
    assert report.results == [] and ops.active_native_ops("cpu") == []
    assert set(ops.switched_off()) == set(ops.NATIVE_OPS)


def test_bad_mode():
    with pytest.raises(ValueError, match="native_ops"):
        nc.run_self_check("cpu", "sometimes")


def _model():
    from dgserve import DiffusionGemma

    cfg = preset("tiny")
    return DiffusionGemma(cfg, random_weights(cfg, seed=1), torch.float32)


def test_engine_strict_refuses_to_start(wrong_step):
    with pytest.raises(nc.NativeOpsError):
        Engine(_model(), native_ops="strict")


def test_engine_reports_the_switched_off_op(wrong_step):
    engine = Engine(_model(), native_ops="auto")
    assert engine.native_report is None  # auto on the CPU: no check at start
    nc.run_self_check("cpu", "auto")
    info = engine.runtime_info()
    assert "diffusion_step" in info["native_ops_disabled"] and "diffusion_step" not in info["native_ops"]
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["native_ops_mode"] == "auto"


def test_model_info_and_metric_show_the_switched_off_op(wrong_step):
    pytest.importorskip("grpc")
    from prometheus_client import generate_latest

    from dgserve.engine.async_engine import AsyncEngine
    from dgserve.service.metrics import Metrics
    from service.grpc import convert

    engine = Engine(_model())
    nc.run_self_check("cpu", "auto")
    info = convert.model_info(AsyncEngine(engine), ("tiny",))
    assert info.device == "cpu" and info.expert_format == "dense float32" and info.native_ops_mode == "auto"
    assert "diffusion_step" not in info.native_ops and "moe_align" in info.native_ops
    assert [(s.op, "canvas" in s.reason) for s in info.native_ops_disabled] == [("diffusion_step", True)]
    text = generate_latest(Metrics().registry).decode()
    assert 'dgserve_native_op_disabled{op="diffusion_step"} 1.0' in text
