"""Safe runtime defaults: bf16 on CUDA unless asked otherwise, fp32 on a GPU only when it fits
(a ConfigError before loading otherwise), and the resolved device / dtype / expert format / native ops shown by
--dry-run and the engine."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from dgserve import Engine
from dgserve.config import ConfigError
from dgserve.model import runtime
from dgserve.model.checkpoint import expected_shapes
from dgserve.model.tiny import make_random_checkpoint, preset

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("rt-tiny"), "tiny", seed=2)


def test_auto_dtype_is_bf16_on_cuda_and_fp32_on_cpu():
    assert runtime.resolve_dtype("cuda", "auto")[0] == "bfloat16"
    assert runtime.resolve_dtype("cuda:1", None)[0] == "bfloat16"
    assert runtime.resolve_dtype("cpu", "auto")[0] == "float32"
    assert runtime.resolve_dtype("cuda", "float32") == ("float32", "requested")
    assert runtime.resolve_dtype("cpu", torch.bfloat16) == ("bfloat16", "requested")
    with pytest.raises(ConfigError, match="dtype"):
        runtime.resolve_dtype("cpu", "float16")


def _headers(config):
    return {"model.decoder." + n: ("BF16", s) for n, s in expected_shapes(config).items()}


def test_the_26b_checkpoint_in_fp32_does_not_fit_an_h100_but_bf16_does():
    h = _headers(preset("26b-a4b"))
    fp32, bf16 = runtime.estimate_weight_bytes(h, "float32", False), runtime.estimate_weight_bytes(h, "bfloat16", False)
    assert 100e9 < fp32 < 110e9 and bf16 == fp32 // 2  # ≈ 104 GB vs ≈ 52 GB
    h100 = 80 << 30
    assert fp32 > h100 * (1 - runtime.HEADROOM_FRACTION) - runtime.HEADROOM_BYTES
    assert bf16 < h100 * (1 - runtime.HEADROOM_FRACTION) - runtime.HEADROOM_BYTES


def test_cpu_plan(tiny):
    plan = runtime.plan_runtime(tiny, "cpu", "auto")
    assert (plan.device, plan.dtype, plan.expert_format, plan.problem) == ("cpu", "float32", "dense float32", None)
    n = sum(t.numel() for t in __import__("dgserve.model.tiny", fromlist=["x"]).random_weights(preset("tiny")).values())
    assert plan.weight_bytes == 4 * n


def test_fp32_on_a_gpu_that_is_too_small_is_refused_before_loading(tiny, monkeypatch):
    monkeypatch.setattr(runtime, "_free_bytes", lambda device: 3 << 30)  # 3 GB free: 0.7 GB after headroom
    plan = runtime.plan_runtime(tiny, "cuda", "float32")
    assert plan.problem is None  # the tiny model fits
    monkeypatch.setattr(runtime, "HEADROOM_BYTES", (3 << 30) - 1000)
    plan = runtime.plan_runtime(tiny, "cuda", "float32")
    assert "float32" in plan.problem and "--dtype bfloat16" in plan.problem
    loaded = []
    monkeypatch.setattr("dgserve.model.DiffusionGemma.from_pretrained", lambda *a, **k: loaded.append(1))
    with pytest.raises(ConfigError, match="weights need"):
        Engine.from_pretrained(tiny, device="cuda", dtype="float32")
    assert loaded == []  # refused before loading


def test_engine_from_pretrained_defaults_and_runtime_info(tiny):
    engine = Engine.from_pretrained(tiny)
    assert engine.model.dtype == torch.float32 and engine.runtime.dtype == "float32"
    info = engine.runtime_info()
    assert (info["device"], info["dtype"], info["expert_format"]) == ("cpu", "float32", "dense float32")
    assert isinstance(info["native_ops"], list)


def test_dry_run_shows_the_resolved_runtime(tiny):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "DGSERVE_"))}
    env.update(NIM_MODEL_PATH=str(tiny), DGSERVE_DEVICE="cuda")
    out = subprocess.run(
        [sys.executable, "-m", "dgserve.service", "--dry-run", "--native-ops", "strict"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["dtype"] == "auto" and cfg["native_ops"] == "strict"
    rt = cfg["runtime"]
    assert (rt["device"], rt["dtype"], rt["expert_format"], rt["native_ops_mode"]) == (
        "cuda",
        "bfloat16",
        "dense bfloat16",
        "strict",
    )
    assert "native_ops" in rt and rt["weight_bytes"] > 0


def test_service_config_validates_native_ops():
    from dgserve.service.config import ServiceConfig

    assert ServiceConfig().dtype == "auto" and ServiceConfig().native_ops == "auto"
    with pytest.raises(ValueError, match="native_ops"):
        ServiceConfig(native_ops="maybe")
