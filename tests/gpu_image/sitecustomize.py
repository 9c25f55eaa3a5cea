"""The GPU image's Python, imitated: a meta-path finder that refuses every third-party package the GPU machine
does not have (tests/test_gpu_check.py puts this directory first on PYTHONPATH of the pytest subprocesses it runs
with ``--collect-only``).

Allowed: the standard library, the packages of the GPU image (``IMAGE``: torch and its own dependencies, numpy,
safetensors, tokenizers, jinja2, pytest, pytest-xdist, grpcio, protobuf, prometheus-client, nvidia-ml-py,
pybind11, ninja) and every module of this repository. Anything else raises ModuleNotFoundError, as it would there,
so a test module that imports, say, jsonschema at module level fails to collect here too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

# top-level import names of the GPU image's packages (and what they import: torch's own dependencies, pytest's
# and xdist's); the service's packages (grpc_health, grpc_reflection, jsonschema, llguidance, fastapi, openai,
# transformers, ...) are absent from it
IMAGE = frozenset(
    {
        "torch", "torchgen", "functorch", "triton", "sympy", "mpmath", "networkx", "filelock", "fsspec",
        "typing_extensions", "setuptools", "pkg_resources", "_distutils_hack", "nvidia", "cuda",
        "numpy", "safetensors", "tokenizers", "huggingface_hub", "jinja2", "markupsafe",
        "pytest", "_pytest", "pluggy", "iniconfig", "packaging", "py", "exceptiongroup", "tomli", "pygments",
        "xdist", "execnet", "grpc", "google", "prometheus_client", "pynvml", "pybind11", "ninja",
        "sitecustomize", "usercustomize",
    }
)  # fmt: skip
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ours(path: str) -> bool:
    """A file of this repository, not of a virtual environment inside it."""
    path = os.path.abspath(path)
    return path.startswith(ROOT + os.sep) and "site-packages" not in path.split(os.sep)


class _GpuImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in sys.stdlib_module_names or top in IMAGE or name != top or top.startswith("_sysconfigdata"):
            return None  # (a submodule's parent was already allowed)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        origin = (spec.origin or "") if spec else ""
        locations = list(spec.submodule_search_locations or []) if spec else []
        if any(_ours(p) for p in [origin, *locations] if p):
            return None  # this repository's own modules (dgserve, service, tests' helpers)
        if spec is None:
            return None  # absent everywhere: the normal ModuleNotFoundError follows
        raise ModuleNotFoundError(f"No module named {name!r} (not in the GPU image)", name=name)


sys.meta_path.insert(0, _GpuImage())
