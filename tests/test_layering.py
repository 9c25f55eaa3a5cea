"""The architecture's boundaries (docs/architecture.md, "Boundaries"), checked on the source tree."""

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


def test_scheduler_and_request_are_pure_python():
    """The scheduler plans Requests without torch: neither module imports it (type-only imports aside)."""
    for name in ("scheduler.py", "request.py"):
        path = PKG / "engine" / name
        assert path.exists(), path
        runtime_imports = [n for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in runtime_imports for a in n.names} | {
            n.module or "" for n in runtime_imports if isinstance(n, ast.ImportFrom)
        }
        assert not any(x.split(".")[0] == "torch" for x in names), path


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
# A request walks service → engine (async engine → engine ↔ scheduler → model runner → sampler) → model → ops
# (docs/architecture.md). Folders are layers, and each layer is ordered inside too: a module may import modules of
# its own tier and of the tiers and layers below, never above (lazy imports inside functions and TYPE_CHECKING
# imports count). "core" is the plain data and rules the layers above ops share (configuration, sampling params,
# outputs, text, structured output, the gRPC stubs). A name is a module exactly; "X.*" is every module under X
# that no exact name or longer pattern claims.
LAYERS: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    (
        "ops",
        (
            ("dgserve._C", "dgserve.ops.native", "dgserve.ops.reference", "dgserve.ops.nvfp4_format"),
            ("dgserve.ops.*",),  # one module per op
            ("dgserve.ops",),  # the op surface: re-exports
            ("dgserve.ops.native_check",),  # the start-up self-check of every native op
        ),
    ),
    (
        "core",
        (
            (
                "dgserve",  # the package face: imports nothing at import time (PEP 562)
                "dgserve.config",
                "dgserve.v1",
                "dgserve.v1.*",
                "dgserve.text.token_bounds",
                "dgserve.text.client_json",  # the one reader of a client's JSON
                "dgserve.text.inert",  # content is content: caller strings never become control tokens
                "dgserve.text.gemma4",  # the Gemma 4 markers and the built-in format's tool pieces
                "dgserve.text.messages",
                "dgserve.text.reasoning",
                "dgserve.structured.schema_check",
                "dgserve.media",
                "dgserve.media.images",  # image limits, decoding and preprocessing (docs/images.md)
                "dgserve.media.processor",  # the checkpoint's image processor settings (docs/images.md)
            ),
            (
                "dgserve.text",
                "dgserve.text.tokenizer",
                "dgserve.structured.response_format",
                "dgserve.structured.tool_parser",
            ),
            (
                "dgserve.sampling_params",
                "dgserve.outputs",
                "dgserve.structured",
                "dgserve.structured.grammar",
                "dgserve.structured.tools",
                "dgserve.structured.tool_grammar",
                "dgserve.structured.chat_output",
                "dgserve.structured.closing",  # the shortest endings a grammar accepts (steering at the budget)
            ),
            ("dgserve.structured.constrained",),  # the grammar-verified step the sampler calls
        ),
    ),
    (
        "model",
        (
            ("dgserve.model.nvfp4", "dgserve.model.cache"),
            ("dgserve.model.checkpoint", "dgserve.model.layers"),
            ("dgserve.model.batched", "dgserve.model.vision"),
            ("dgserve.model.diffusion_gemma", "dgserve.model.quantize", "dgserve.model.runtime", "dgserve.model.tiny"),
            ("dgserve.model", "dgserve.model.default_model"),
        ),
    ),
    (
        "engine",
        (
            (
                "dgserve.engine.block",
                "dgserve.engine.cache_config",
                "dgserve.engine.prefix_cache",
                "dgserve.engine.memory_room",
                "dgserve.engine.fair_share",  # callers' shares of the running slots (docs/architecture.md)
            ),
            ("dgserve.engine.request",),  # the one per-request record
            (
                "dgserve.engine.scheduler",
                "dgserve.engine.sampler",
                "dgserve.engine.prompt",
                "dgserve.engine.canvas_draft",  # a request's starting canvas and pins, checked (docs/edit-in-place.md)
                "dgserve.engine.isolation",  # a request fails alone: the step's two guards
                "dgserve.engine.step_output",  # what a step reports; the blocks that commit or end a request
            ),
            ("dgserve.engine.image_batch",),  # prompts' images and the iteration's one vision tower call
            (
                "dgserve.engine.request_checks",  # a request's prompt ids, context, work, knobs and id, checked
                "dgserve.engine.loading",  # a checkpoint directory → model, tokenizer, defaults; the runtime info
                "dgserve.engine.grammar_rows",  # each structured request's grammar state, from one compiled cache
            ),
            ("dgserve.engine.model_runner",),
            ("dgserve.engine.engine",),
            ("dgserve.engine.async_engine",),
            ("dgserve.engine",),
        ),
    ),
    (
        "service",
        (
            (
                "dgserve.service.logs",
                "dgserve.service.connections",
                "dgserve.service.in_flight",
                "dgserve.service.config",
                "dgserve.service.errors",
                "dgserve.service.vllm_metrics",
                "dgserve.service.media_fetch",  # remote images from allowed domains (docs/images.md)
                "dgserve.service.image_work",  # the bounded pools and pixel budget images are read in
                "dgserve.service.callers",  # a trusted gateway's caller header, per call
            ),
            (
                "dgserve.service.events",  # what both doors take from an engine stream
                "dgserve.service.images",  # every door's image parts → the engine's (docs/images.md)
                "dgserve.service.metrics",
                "dgserve.service.interceptors",
                "dgserve.service.http.errors",
                "dgserve.service.http.response_store",
            ),
            (
                "dgserve.service.convert",  # the gRPC door's encoder
                "dgserve.service.http.body",
                "dgserve.service.http.protocol",
                "dgserve.service.http.responses",
                "dgserve.service.http.gate",
                "dgserve.service.http.access_log",
                "dgserve.service.http.bounded",
                "dgserve.service.http.site",
                "dgserve.service.http.choices",
            ),
            (
                "dgserve.service.http.sse",
                "dgserve.service.http.responses_input",
                "dgserve.service.http.messages_input",
                "dgserve.service.http.event_encoder",  # the output-item state machine of the agent doors
            ),
            (
                "dgserve.service.servicer",
                "dgserve.service.http.generate",
                "dgserve.service.http.tokens",
                "dgserve.service.http.playground",
            ),
            ("dgserve.service.http.responses_api", "dgserve.service.http.messages_api"),
            ("dgserve.service.http.app",),
            ("dgserve.service.http.front_door", "dgserve.service.http"),
            ("dgserve.service.server",),
            ("dgserve.service.__main__", "dgserve.service"),
        ),
    ),
    ("apps", (("dgserve.client",), ("dgserve.__main__",))),
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


def _rank(module: str) -> tuple[int, int] | None:
    """(layer, tier) of a module: an exact name first, else the longest "X.*" pattern; None when none matches."""
    best: tuple[int, int] | None = None
    best_len = -1
    for li, (_, tiers) in enumerate(LAYERS):
        for ti, names in enumerate(tiers):
            for name in names:
                if name == module:
                    return (li, ti)
                if name.endswith(".*") and module.startswith(name[:-1]) and len(name) > best_len:
                    best, best_len = (li, ti), len(name)
    return best


def _describe(rank: tuple[int, int]) -> str:
    return f"{LAYERS[rank[0]][0]} tier {rank[1]}"


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


def _graph() -> dict[str, set[str]]:
    files = _module_files()
    return {m: _dgserve_imports(m, p) for m, p in files.items()}


def test_every_module_has_a_layer():
    unplaced = [m for m in _module_files() if _rank(m) is None]
    assert not unplaced, f"add these modules to LAYERS in tests/test_layering.py: {unplaced}"


def test_no_module_imports_above_its_own_tier():
    """No back-edge between layers or inside one: e.g. ops never import the model; the scheduler never imports the
    model runner; the engine never imports the async engine; servicer and HTTP app never import the server."""
    bad = []
    for module, deps in _graph().items():
        own = _rank(module)
        for dep in deps:
            rank = _rank(dep)
            if own is not None and rank is not None and rank > own:
                bad.append(f"{module} ({_describe(own)}) imports {dep} ({_describe(rank)})")
    assert not bad, "\n".join(bad)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself): Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    """No two modules import each other, directly or round a ring (lazy and type-only imports count)."""
    assert _circles(_graph()) == []


def test_the_circle_check_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_ops_import_only_ops():
    """The ops layer is the bottom: its modules import nothing of dgserve outside dgserve.ops (and _C)."""
    for module, deps in _graph().items():
        rank = _rank(module)
        if rank is not None and rank[0] == 0:
            outside = {d for d in deps if (_rank(d) or (-1,))[0] != 0}
            assert not outside, f"{module} imports {outside}"


def test_the_layer_check_sees_a_back_edge(tmp_path):
    """The checker itself: an op module importing the model lazily, and the scheduler importing the model runner,
    are found."""
    fake = tmp_path / "moe_experts.py"
    fake.write_text("def f():\n    from ..model import nvfp4\n    from . import reference\n")
    deps = _dgserve_imports("dgserve.ops.moe_experts", fake)
    assert deps == {"dgserve.model.nvfp4", "dgserve.ops.reference"}
    assert _rank("dgserve.model.nvfp4") > _rank("dgserve.ops.moe_experts")  # type: ignore[operator]
    assert _rank("dgserve.engine.model_runner") > _rank("dgserve.engine.scheduler")  # type: ignore[operator]
    assert _rank("dgserve.ops.native_check") > _rank("dgserve.ops") > _rank("dgserve.ops.moe_route")  # type: ignore[operator]


# ---------------------------------------------------------------------------------------- the native extension
def _native_uses(path: pathlib.Path) -> list[str]:
    """Every use of the extension ``_C`` in a file, in any form: an import, an attribute (``x._C``), a name, or a
    string naming it (``import_module("dgserve._C")``, ``getattr(m, "_C")``); docstrings and comments aside."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    native = re.compile(r"(^|\.)_C($|\.)")
    uses = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.alias) and (native.search(node.name) or node.name == "_C"):
            uses.append(f"{path}:{line}: import {node.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and native.search(node.module):
            uses.append(f"{path}:{line}: from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr == "_C":
            uses.append(f"{path}:{line}: ._C")
        elif isinstance(node, ast.Name) and node.id == "_C":
            uses.append(f"{path}:{line}: _C")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and native.search(node.value)
        ):
            uses.append(f"{path}:{line}: {node.value!r}")
    return uses


def test_native_extension_used_only_in_ops():
    """Only dgserve.ops touches ``_C``; the model, the engine, the service, bench/, scripts/ and tools/ call ops."""
    bases = (PKG, ROOT / "service", ROOT / "bench", ROOT / "scripts", ROOT / "tools")
    uses = [
        u
        for base in bases
        for p in (_py_files(base) if base.exists() else [])
        if not p.is_relative_to(PKG / "ops")
        for u in _native_uses(p)
    ]
    assert not uses, "\n".join(uses)


def test_the_native_check_sees_every_form(tmp_path):
    fake = tmp_path / "sneaky.py"
    fake.write_text(
        '''"""Mentions dgserve._C in a docstring only."""
import importlib
import dgserve._C
from dgserve import _C
from dgserve._C import rms_norm
x = importlib.import_module("dgserve._C")
y = getattr(ops.native, "_C")
z = ops.native._C.rms_norm
'''
    )
    assert len(_native_uses(fake)) == 6


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
