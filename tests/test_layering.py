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
    """The OpenAI front door translates JSON to dgserve objects; protobuf and gRPC stay in the gRPC door
    (service/grpc/)."""
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
            (
                "dgserve._C",
                "dgserve.ops.native",
                "dgserve.ops.reference",
                "dgserve.ops.nvfp4_format",
                "dgserve.ops.bits",  # bit patterns in signed ints: the seed's int64, a token mask's int32 words
            ),
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
                "dgserve.config_fields",  # the typed readers of a checkpoint's JSON fields
                "dgserve.text_config",  # config.json's text_config, resolved as transformers does
                "dgserve.generation_config",  # generation_config.json
                "dgserve.config",
                "dgserve.knob",  # what one request knob accepts, and the check of a value against it
                "dgserve.v1",
                "dgserve.v1.*",
                "dgserve.text.token_bounds",
                "dgserve.text.client_json",  # the one reader of a client's JSON
                "dgserve.text.inert",  # content is content: caller strings never become control tokens
                "dgserve.text.gemma4",  # the Gemma 4 markers and the built-in format's tool pieces
                "dgserve.text.messages",
                "dgserve.text.reasoning",
                "dgserve.text.chat_template",  # chat templates compiled and rendered in the jinja2 sandbox
                "dgserve.text.gemma4_chat",  # the built-in Gemma 4 chat format
                "dgserve.text.incremental_decoder",  # text deltas of a token stream
                "dgserve.text.tokenizer_files",  # tokenizer.json, tokenizer_config.json, chat_template.jinja
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
            (
                "dgserve.model.nvfp4",
                "dgserve.model.cache",
                "dgserve.model.checkpoint_layout",  # the checkpoint's tensor names and shapes
                "dgserve.model.vision_config",  # vision_config and the image preprocessing settings
                "dgserve.model.fp8",  # the compressed-tensors FP8 weight format (docs/kernels.md, "FP8 checkpoints")
            ),
            ("dgserve.model.fp8_w8a8",),  # FP8 served as FP8: W8A8 GEMMs and the path decision
            ("dgserve.model.quant_format", "dgserve.model.checkpoint_fp8"),  # which format; loading FP8
            ("dgserve.model.checkpoint_save", "dgserve.model.checkpoint", "dgserve.model.layers"),
            ("dgserve.model.batched", "dgserve.model.stacked", "dgserve.model.vision"),  # stacked: CPU canvases at once
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
                "dgserve.engine.cgroups",  # where this process's cgroup of one controller lives (v1 or v2)
                "dgserve.engine.memory_room",
                "dgserve.engine.cpu_threads",  # torch's CPU threads: the process's CPUs (docs/deployment.md)
                "dgserve.engine.host_malloc",  # glibc's malloc thresholds for a CPU engine (docs/memory.md)
                "dgserve.engine.fair_share",  # callers' shares of the running slots (docs/architecture.md)
            ),
            ("dgserve.engine.request",),  # the one per-request record
            (
                "dgserve.engine.scheduler",
                "dgserve.engine.sampler",
                "dgserve.engine.prompt",
                "dgserve.engine.initial_canvas",  # a starting canvas and its pins, checked (docs/edit-in-place.md)
                "dgserve.engine.isolation",  # a request fails alone: the step's two guards
                "dgserve.engine.step_output",  # what a step reports; the blocks that commit or end a request
            ),
            ("dgserve.engine.image_batch",),  # prompts' images and the iteration's one vision tower call
            (
                "dgserve.engine.request_checks",  # a request's prompt ids, context, work, knobs and id, checked
                "dgserve.engine.loading",  # a checkpoint directory → model, tokenizer, defaults; the runtime info
                "dgserve.engine.grammar_rows",  # each structured request's grammar state, from one compiled cache
            ),
            (
                "dgserve.engine.admission",  # a submission checked and minted into a Request, before it is queued
                "dgserve.engine.model_runner",
                "dgserve.engine.request_stream",  # one request's events for asyncio callers
                "dgserve.engine.tokenize_pool",  # the async engine's bounded pool of tokenization threads
            ),
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
                "dgserve.service.errors",  # exceptions and the reason every door names them by
                "dgserve.service.body_thread",  # the one thread body-sized work of every door runs in
                "dgserve.service.vllm_metrics",
                "dgserve.service.media_fetch",  # remote images from allowed domains (docs/images.md)
                "dgserve.service.image_work",  # the bounded pools and pixel budget images are read in
                "dgserve.service.callers",  # a trusted gateway's caller header, per call
                "dgserve.service.hub",  # a model named by Hub id, fetched with huggingface_hub (docs/deployment.md)
            ),
            (
                "dgserve.service.events",  # what both doors take from an engine stream
                "dgserve.service.images",  # every door's image parts → the engine's (docs/images.md)
                "dgserve.service.metrics",
                "dgserve.service.grpc.errors",  # reasons → gRPC status codes
                "dgserve.service.grpc.interceptors",
                "dgserve.service.http.errors",
                "dgserve.service.http.fields",  # the field readers and the unknown / no-op field rule, once
                "dgserve.service.http.responses.store",
            ),
            (
                "dgserve.service.grpc.convert",  # the gRPC door's encoder
                "dgserve.service.http.body",
                "dgserve.service.http.call",  # a checked request of a JSON door: a Submission and the door's options
                "dgserve.service.http.knobs",  # the knobs and output constraints as body fields
                "dgserve.service.http.gate",
                "dgserve.service.http.access_log",
                "dgserve.service.http.bounded",
                "dgserve.service.http.site",
                "dgserve.service.http.choices",
                "dgserve.service.http.sse",
            ),
            (
                "dgserve.service.http.door",  # the one route skeleton of the generating APIs
                "dgserve.service.http.event_encoder",  # the output-item state machine of the agent doors
                "dgserve.service.http.openai.input",
                "dgserve.service.http.openai.output",
                "dgserve.service.http.responses.conversation",
                "dgserve.service.http.responses.tools",  # the Responses API's tool types: namespaces, hosted tools
                "dgserve.service.http.messages.conversation",
            ),
            (
                "dgserve.service.grpc.servicer",
                "dgserve.service.http.playground",
                "dgserve.service.http.openai.stream",
                "dgserve.service.http.openai.tokens",
                "dgserve.service.http.responses.input",
                "dgserve.service.http.messages.input",
                "dgserve.service.http.messages.output",
            ),
            (
                "dgserve.service.http.openai.api",
                "dgserve.service.http.responses.output",
                "dgserve.service.http.messages.api",
            ),
            ("dgserve.service.http.responses.api",),
            ("dgserve.service.http.app",),
            (
                "dgserve.service.http.front_door",
                "dgserve.service.http",
                "dgserve.service.http.openai",
                "dgserve.service.http.responses",
                "dgserve.service.http.messages",
            ),
            ("dgserve.service.grpc.door", "dgserve.service.grpc"),  # the gRPC door's server, built
            ("dgserve.service.server",),
            ("dgserve.service.flags",),  # every flag, its environment variable and ServiceConfig field
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


HTTP_APIS = ("openai", "responses", "messages")  # service/http's API folders
# the shared door layer's modules that import an API folder: the app mounts their routes; the gate holds the
# Responses store (what the routes need from the server)
HTTP_SHARED_USES = {"dgserve.service.http.app": HTTP_APIS, "dgserve.service.http.gate": ("responses",)}


def _http_api(module: str) -> str | None:
    """The API folder of a service/http module (None: the shared door layer, or not the HTTP door)."""
    head = module.removeprefix("dgserve.service.http.").split(".")[0]
    return head if module.startswith("dgserve.service.http.") and head in HTTP_APIS else None


def test_http_apis_import_the_shared_door_never_each_other():
    """The HTTP door's API folders (service/http/openai, responses, messages) import the shared door layer
    (service/http/*.py) and the layers below, never each other; the shared layer imports none of them, but for
    the app (their routes) and the gate (the Responses store)."""
    bad = []
    for module, deps in _graph().items():
        own = _http_api(module)
        shared = module.startswith("dgserve.service.http") and own is None
        for dep in deps:
            api = _http_api(dep)
            if api is None or api == own:
                continue
            if own is not None or (shared and api not in HTTP_SHARED_USES.get(module, ())):
                bad.append(f"{module} imports {dep}")
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


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (lazy and type-only imports count)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_grpc_door_imports_nothing_of_the_http_door():
    """The doors stand side by side on the shared door layer (events, images, errors, the body thread): no module
    of the gRPC door (service/grpc/) imports the HTTP door (service/http/), directly or through another module."""
    graph = _graph()
    door = sorted(m for m in graph if m == "dgserve.service.grpc" or m.startswith("dgserve.service.grpc."))
    assert "dgserve.service.grpc.servicer" in door, door
    http = "dgserve.service.http"
    bad = {m: sorted(d for d in _reachable(graph, m) if d == http or d.startswith(http + ".")) for m in door}
    assert not any(bad.values()), {m: deps for m, deps in bad.items() if deps}


def test_the_door_check_sees_an_indirect_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _reachable(graph, "a") == {"a", "b", "c"}
    assert _reachable(graph, "d") == set()


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
