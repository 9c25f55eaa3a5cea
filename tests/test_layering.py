"""The architecture's boundaries (docs/architecture.md), checked on the source tree."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "dgserve"


def _py_files(base: pathlib.Path):
    return [p for p in base.rglob("*.py") if "__pycache__" not in p.parts]


def _imports(path: pathlib.Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if re.match(r"\s*(import|from)\s", line))


def test_no_grpc_in_package_except_stubs_and_client():
    for p in _py_files(PKG):
        rel = p.relative_to(PKG)
        if rel.parts[0] == "v1" or rel.name == "client.py":
            continue
        assert "grpc" not in _imports(p), f"{rel} imports grpc"


def test_only_ops_imports_native_extension():
    for p in _py_files(PKG):
        rel = p.relative_to(PKG)
        if rel.parts[0] == "ops":
            continue
        assert not re.search(r"(dgserve\._C|from dgserve import _C|from \. import _C|import _C)", _imports(p)), rel


def test_only_bindings_include_torch_or_pybind():
    csrc = ROOT / "csrc"
    for p in list(csrc.rglob("*.h")) + list(csrc.rglob("*.cpp")) + list(csrc.rglob("*.cu")) + list(csrc.rglob("*.cuh")):
        if p.name == "bindings.cpp":
            continue
        text = p.read_text()
        assert not re.search(r"#include\s*[<\"](torch|pybind11|ATen|c10)/", text), p


def test_environment_read_only_in_service_main():
    for base in (PKG, ROOT / "service", ROOT / "bench"):
        for p in _py_files(base) if base.exists() else []:
            if p == ROOT / "service" / "__main__.py":
                continue
            assert "os.environ" not in p.read_text() and "getenv" not in p.read_text(), p


def test_scheduler_is_pure_python():
    sched = PKG / "scheduler.py"
    if sched.exists():
        assert "torch" not in _imports(sched)


def test_model_calls_ops_not_native():
    for p in _py_files(PKG / "model"):
        assert not re.search(r"\b_C\b", _imports(p)), p


def test_service_imports_work_when_installed():
    """service/ is installed as dgserve.service: its modules import each other relatively (or as dgserve.*), never
    as a top-level `service`, which exists only in the source tree."""
    for p in _py_files(ROOT / "service"):
        assert not re.search(r"^\s*(from|import)\s+service\b", p.read_text(), re.M), p


def test_http_front_door_speaks_no_grpc():
    """The OpenAI front door translates JSON to dgserve objects; protobuf and gRPC stay in convert/servicer."""
    for p in _py_files(ROOT / "service" / "http"):
        imports = _imports(p)
        assert "grpc" not in imports and "_pb2" not in imports, p


# ------------------------------------------------------------------------------------------------------ layers
# A request walks service → async_engine → engine ↔ scheduler → model_runner → model → ops. Every
# dgserve module has a layer; it may import its own layer and those below, never one above (lazy imports inside
# functions and TYPE_CHECKING imports count too). "core" is plain data and rules (configuration, knobs, outputs,
# tokenizer, queues) that the layers above ops share; the ops import nothing outside dgserve.ops.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ops", ("dgserve.ops", "dgserve._C")),
    (
        "core",
        (
            "dgserve",  # the package face: imports nothing at import time (PEP 562)
            "dgserve.config",
            "dgserve.sampling_params",
            "dgserve.outputs",
            "dgserve.text",
            "dgserve.engine.cache_config",
            "dgserve.structured",  # response formats and the grammar compiler (llguidance): data and rules
            "dgserve.v1",
        ),
    ),
    (
        "model",
        (
            "dgserve.model",
            "dgserve.model.nvfp4",
            "dgserve.model.checkpoint",
            "dgserve.model.quantize",
            "dgserve.model.tiny",
            "dgserve.model.default_model",
            "dgserve.model.runtime",
        ),
    ),
    (
        "model_runner",
        (
            "dgserve.engine",
            "dgserve.engine.model_runner",
            "dgserve.engine.sampler",
            "dgserve.engine.scheduler",  # plans Requests, which carry the sampler's BlockState
            "dgserve.engine.request",
            "dgserve.structured.constrained",  # the grammar-verified step (sampler hooks)
            "dgserve.structured.hooks",
        ),
    ),
    ("engine", ("dgserve.engine.engine",)),
    ("async_engine", ("dgserve.engine.async_engine",)),
    ("service", ("dgserve.service",)),
    ("apps", ("dgserve.__main__", "dgserve.client")),
)


def _module_files() -> dict[str, pathlib.Path]:
    """dotted name → file, for every module of the installed layout (service/ is dgserve.service)."""
    out = {}
    for base, prefix in ((PKG, ("dgserve",)), (ROOT / "service", ("dgserve", "service"))):
        for p in _py_files(base):
            parts = (*prefix, *p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _layer(module: str) -> int | None:
    """Index in LAYERS of the longest matching prefix; None for a module no layer names."""
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def _dgserve_imports(module: str, path: pathlib.Path) -> set[str]:
    """Every dgserve module ``module`` imports anywhere in its file (relative imports resolved; ``from X import
    y`` counts as X.y when y is a module of the package, else as X)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = set(_module_files()) | {"dgserve._C"}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "dgserve"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base.split(".")[0] != "dgserve":
                continue
            subs = {f"{base}.{a.name}" for a in node.names} & known
            found |= subs or {base}
    return found - {module}


def test_every_module_has_a_layer():
    unplaced = [m for m in _module_files() if _layer(m) is None]
    assert not unplaced, f"add these modules to LAYERS in tests/test_layering.py: {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    """No back-edge: e.g. ops never import dgserve.model.nvfp4, the model or the engine; the engine never imports the
    async engine or the service."""
    bad = []
    for module, path in _module_files().items():
        own = _layer(module)
        for dep in _dgserve_imports(module, path):
            rank = _layer(dep)
            if own is not None and rank is not None and rank > own:
                bad.append(f"{module} ({LAYERS[own][0]}) imports {dep} ({LAYERS[rank][0]})")
    assert not bad, "\n".join(bad)


def test_ops_import_only_ops():
    """The ops layer is the bottom: its modules import nothing of dgserve outside dgserve.ops (and _C), the start-up
    self-check ``dgserve.ops.native_check`` included (it builds its NVFP4 inputs with ``dgserve.ops.nvfp4_format``
    and ``dgserve.ops.nvfp4_repack``, not ``dgserve.model.nvfp4``)."""
    assert _layer("dgserve.ops.native_check") == 0
    for module, path in _module_files().items():
        if _layer(module) == 0:
            outside = {d for d in _dgserve_imports(module, path) if _layer(d) != 0}
            assert not outside, f"{module} imports {outside}"


def test_ops_modules_do_not_import_their_package():
    """No circle inside the ops layer either: an op module imports its siblings (native, rms_norm, reference, ...),
    never the package ``dgserve.ops`` itself, which imports every op module (the old ``import dgserve.ops as
    _ops  # partially initialised``)."""
    for module, path in _module_files().items():
        if module.startswith("dgserve.ops.") and module != "dgserve.ops.native_check":  # the self-check is the top
            deps = _dgserve_imports(module, path)
            assert "dgserve.ops" not in deps, f"{module} imports the dgserve.ops package (a circle through __init__)"
            assert "partially initialised" not in path.read_text(), module


def test_the_layer_check_sees_a_back_edge(tmp_path):
    """The checker itself: a module of ops importing dgserve.model.nvfp4 (the old circle), lazily, is found."""
    fake = tmp_path / "nvfp4_moe_experts.py"
    fake.write_text("def f():\n    from ..model import nvfp4\n    from . import reference\n")
    deps = _dgserve_imports("dgserve.ops.nvfp4_moe_experts", fake)
    assert deps == {"dgserve.model.nvfp4", "dgserve.ops.reference"} and _layer("dgserve.model.nvfp4") > _layer(
        "dgserve.ops"
    )


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_import_dgserve_is_light():
    """``import dgserve`` imports nothing heavy (the names load on first use); ``import dgserve.ops`` does not pull
    in the model, the engine or the service."""
    r = _run(
        """
        import sys
        import dgserve
        heavy = [m for m in ("torch", "grpc", "dgserve.ops", "dgserve.model", "dgserve.engine") if m in sys.modules]
        assert not heavy, heavy
        import dgserve.ops
        ops = ("dgserve.ops", "dgserve._C")
        above = sorted(m for m in sys.modules if m.startswith("dgserve.") and not m.startswith(ops))
        assert not above, above
        assert dgserve.SamplingParams.__module__ == "dgserve.sampling_params"
        """
    )
    assert r.returncode == 0, r.stderr


def test_each_module_imports_alone():
    """No import circle: every module imports first in a fresh process (forked from one that has loaded the
    third-party libraries only, so this stays fast)."""
    modules = sorted(m for m in _module_files() if not m.endswith("__main__"))
    r = _run(
        f"""
        import importlib, os, sys
        import torch, grpc, google.protobuf  # third-party only: no dgserve module is loaded before the fork
        assert not any(m == "dgserve" or m.startswith("dgserve.") for m in sys.modules)
        failed = []
        for name in {modules!r}:
            pid = os.fork()
            if pid == 0:
                try:
                    importlib.import_module(name)
                except BaseException as e:
                    print(f"{{name}}: {{type(e).__name__}}: {{e}}", file=sys.stderr, flush=True)
                    os._exit(1)
                os._exit(0)
            if os.waitpid(pid, 0)[1] != 0:
                failed.append(name)
        assert not failed, failed
        """
    )
    assert r.returncode == 0, r.stderr
