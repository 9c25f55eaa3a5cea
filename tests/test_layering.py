"""The architecture's boundaries (DESIGN.md, Layout), checked on the source tree."""

from __future__ import annotations

import pathlib
import re

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
        assert "_C" not in _imports(p), p


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
