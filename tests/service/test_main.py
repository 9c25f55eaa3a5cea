"""``dgserve serve`` (python -m dgserve.service): flags and environment fallbacks (docs/architecture.md,
"Configuration"), --dry-run, and
SIGTERM drain of a real server process (docs/architecture.md, "Service behaviours", row 17)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_helpers import ROOT, params
from storm import ServerProcess  # a real `python -m dgserve.service` process, ready (SERVING)

from dgserve.service.__main__ import build_config
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc


def test_flags_override_environment_which_overrides_defaults():
    env = {
        "NIM_MODEL_PATH": "/models/a",
        "NIM_SERVED_MODEL_NAME": "a,b",
        "DGSERVE_GRPC_PORT": "6000",
        "NIM_SERVER_PORT": "off",
        "NIM_MAX_MODEL_LEN": "2048",
        "NIM_LOG_LEVEL": "DEBUG",
        "NIM_JSONL_LOGGING": "true",
        "DGSERVE_MAX_NUM_SEQS": "8",
        "DGSERVE_MAX_QUEUE_LEN": "3",
        "DGSERVE_DRAIN_TIMEOUT": "2.5",
        "DGSERVE_AUTH_TOKEN_FILE": "/run/tokens",
    }
    cfg, dry = build_config(["--port", "7000", "--max-num-seqs", "9"], env)
    assert not dry
    assert (cfg.model, cfg.served_model_name, cfg.port, cfg.http_port, cfg.max_model_len) == (
        "/models/a",
        ("a", "b"),
        7000,
        None,
        2048,
    )
    assert (cfg.log_level, cfg.json_logs, cfg.max_num_seqs, cfg.max_queue_len, cfg.drain_timeout) == (
        "DEBUG",
        True,
        9,
        3,
        2.5,
    )
    assert cfg.auth_token_file == "/run/tokens"
    defaults, _ = build_config([], {})
    assert (defaults.port, defaults.http_port, defaults.model, defaults.json_logs) == (50051, 8000, None, False)


def test_cpu_threads_flag_env_and_bounds():
    """--cpu-threads / DGSERVE_CPU_THREADS (docs/deployment.md, "CPU threads"): 0 (the process's CPUs) by default,
    the flag over the variable, a negative count refused naming both."""
    assert build_config([], {})[0].cpu_threads == 0
    assert build_config([], {"DGSERVE_CPU_THREADS": "3"})[0].cpu_threads == 3
    assert build_config(["--cpu-threads", "2"], {"DGSERVE_CPU_THREADS": "3"})[0].cpu_threads == 2
    with pytest.raises(ValueError, match=r"cpu_threads.*--cpu-threads / env DGSERVE_CPU_THREADS"):
        build_config(["--cpu-threads", "-1"], {})


# defaults decided at runtime, said in words in the help ("(default: the model's)"); their field default is None / ()
RUNTIME_DEFAULTS = {
    "model": "the shipped small model",
    "served_model_name": "the model directory's name",
    "max_model_len": "the model's",
    "caller_header": "each auth token is a caller",
    "max_connections": "the open-file limit",
    "responses_store_max_entries_per_caller": "--responses-store-max-entries",
    "responses_store_max_bytes_per_caller": "--responses-store-max-bytes",
    "allowed_media_domains": "none, data URLs only",
    "image_workers": "one per core, at most 4",
    "image_decode_pixels": "twice it",
    "image_token_cost": "the device's",
    "default_max_tokens": "the checkpoint's generation_config",
    "allowed_origins": "none, same-origin only",
    "revision": "the repository's default branch",
    "download_dir": "HF_HUB_CACHE",
}
UNSET_BY_DEFAULT = {
    "auth_token_file",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "allowed_hosts",
    "hf_overrides",
}  # off: no default said


def test_every_flag_help_states_service_config_default():
    """Each flag's help, as ``dgserve serve --help`` prints it, names ServiceConfig's default: "(default X)" where X,
    given as the flag, resolves to that default, or words for a default decided at runtime; a switch changes its
    field from the default."""
    from dgserve.service.__main__ import FLAGS, SWITCHES, _parser
    from dgserve.service.config import ServiceConfig

    helps = {a.option_strings[0]: a.help for a in _parser()._actions if a.option_strings}
    defaults = ServiceConfig()
    for flag, _, field, _, _ in FLAGS:
        text, default = " ".join(helps[flag].split()), getattr(defaults, field)
        if field in RUNTIME_DEFAULTS:
            assert default in (None, ()) and f"(default: {RUNTIME_DEFAULTS[field]}" in text, (flag, text, default)
        elif field in UNSET_BY_DEFAULT:
            assert default in (None, ()) and "default" not in text, (flag, text, default)
        else:
            m = re.search(r"\(default ([^;:)]+)[;:)]", text)
            assert m, f"{flag}: its help states no default: {text!r}"
            shown = m.group(1)
            if shown.endswith(" MiB"):  # byte sizes are shown in MiB; the flag takes bytes
                shown = str(int(shown.removesuffix(" MiB")) << 20)
            resolved, _ = build_config([flag, shown], {})
            assert getattr(resolved, field) == default, (
                f"{flag}: help says {m.group(1)!r}, ServiceConfig has {default!r}"
            )
    for flag, _, field, value, _ in SWITCHES:
        assert value != getattr(defaults, field), f"{flag} sets {field} to its default {value!r}"


def test_the_server_and_the_engine_default_to_the_same_running_slots():
    from dgserve.engine.scheduler import DEFAULT_MAX_NUM_SEQS, SchedulerConfig
    from dgserve.service.config import ServiceConfig

    assert ServiceConfig().max_num_seqs == SchedulerConfig().max_num_seqs == DEFAULT_MAX_NUM_SEQS


@pytest.mark.parametrize(
    "argv, env, field",
    [
        (["--port", "70000"], {}, "port"),
        ([], {"DGSERVE_MAX_NUM_SEQS": "many"}, "max_num_seqs"),
        (["--tls-cert", "c.pem"], {}, "tls_cert"),
        (["--dtype", "int3"], {}, "dtype"),
        (["--media-fetch-timeout", "0"], {}, "media_fetch_timeout"),
        ([], {"DGSERVE_MEDIA_FETCH_TIMEOUT": "soon"}, "media_fetch_timeout"),
        (["--media-fetch-max-redirects", "-1"], {}, "media_fetch_max_redirects"),
        (["--image-token-cost", "0.5"], {}, "image_token_cost"),
        (["--responses-store-max-bytes-per-caller", "-1"], {}, "responses_store_max_bytes_per_caller"),
        ([], {"DGSERVE_RESPONSES_STORE_MAX_ENTRIES_PER_CALLER": "x"}, "responses_store_max_entries_per_caller"),
    ],
)
def test_bad_configuration_names_field(argv, env, field):
    with pytest.raises(ValueError, match=field):
        build_config(argv, env)


def test_image_flags_flow_to_the_fetch_policy_and_the_scheduler():
    from dgserve.service.server import scheduler_config

    env = {"DGSERVE_MEDIA_FETCH_TIMEOUT": "2.5", "DGSERVE_IMAGE_TOKEN_COST": "3"}
    cfg, _ = build_config(["--media-fetch-max-redirects", "0"], env)
    assert (cfg.media_fetch_timeout, cfg.media_fetch_max_redirects, cfg.image_token_cost) == (2.5, 0, 3.0)
    assert scheduler_config(cfg).image_token_cost == 3.0
    defaults, _ = build_config([], {})
    assert (defaults.media_fetch_timeout, defaults.media_fetch_max_redirects) == (10.0, 3)
    assert scheduler_config(defaults).image_token_cost is None  # the engine's device default
    with pytest.raises(ValueError, match=r"media_fetch_timeout .* \(set --media-fetch-timeout / env DGSERVE_ME"):
        build_config(["--media-fetch-timeout", "601"], {})


def test_the_per_caller_store_caps_default_to_the_global_ones():
    env = {"DGSERVE_RESPONSES_STORE_MAX_BYTES_PER_CALLER": "1000"}
    cfg, _ = build_config(["--responses-store-max-entries-per-caller", "5"], env)
    assert (cfg.responses_store_max_entries_per_caller, cfg.responses_store_max_bytes_per_caller) == (5, 1000)
    defaults, _ = build_config([], {})
    assert (defaults.responses_store_max_entries_per_caller, defaults.responses_store_max_bytes_per_caller) == (
        None,
        None,
    )


def test_dry_run_prints_resolved_config():
    env = {**os.environ, "NIM_MODEL_PATH": "/models/x", "DGSERVE_MAX_QUEUE_LEN": "5"}
    out = subprocess.run(
        [sys.executable, "-m", "dgserve.service", "--dry-run", "--port", "1234"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert (cfg["model"], cfg["port"], cfg["max_queue_len"], cfg["http_port"]) == ("/models/x", 1234, 5, 8000)
    assert cfg["runtime"]["cpu_threads"].startswith("CPU threads: "), cfg["runtime"]  # what serve would set


def test_sigterm_drain(model_dir):
    """docs/architecture.md, "Service behaviours", row 17: SIGTERM → readiness NOT_SERVING at once (Watch notified) on
    both front doors, new calls
    UNAVAILABLE (gRPC) / 503 (HTTP), the in-flight stream finishes within the grace period, the process exits 0."""
    srv = ServerProcess(model_dir, "--drain-timeout", "20")
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 120
        while health.Check(health_pb2.HealthCheckRequest(service="dgserve.v1.TextGeneration")).status != 1:
            assert time.monotonic() < deadline, "never became ready"
            time.sleep(0.1)
        watch = health.Watch(health_pb2.HealthCheckRequest(service="dgserve.v1.TextGeneration"))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.TextGenerationStub(ch)
        call = stub.Generate(
            pb.GenerateRequest(
                prompt="drain", params=params(max_new_tokens=16 * 20, max_denoising_steps=8, ignore_eos=True)
            )
        )
        assert next(call).HasField("started")
        srv.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="new", params=params()), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        http = f"http://127.0.0.1:{srv.http_port}"
        assert httpx.get(http + "/v1/health/ready", timeout=10).status_code == 503
        r = httpx.post(http + "/v1/completions", json={"prompt": "new", "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        rest = list(call)
        assert rest[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert rest[-1].finished.usage.completion_tokens == 16 * 20
        assert srv.proc.wait(30) == 0
        assert any("stopped" in line for line in srv.lines)
        ch.close()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
