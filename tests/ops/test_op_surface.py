"""The op surface: one name per op, end to end. Every native op of csrc (its header csrc/ops/<op>.h and its m.def in
csrc/bindings.cpp) has the module dgserve/ops/<op>.py holding the dispatcher ``dgserve.ops.<op>``, and
``dgserve.ops.reference.<op>`` with the same signature; each module has its "native ok" check."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

import pytest

from dgserve import ops
from dgserve.ops import reference

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPS_DIR = ROOT / "python" / "dgserve" / "ops"
# _C entries that are not ops of their own: test hooks of the noise and NVFP4 cores, and the build's facts
HOOKS = {"philox4x32_10", "dg_logf", "gumbel", "gumbel_bound", "nvfp4_decode", "build_info", "_set_cpu_level"}
# dispatchers without a NATIVE_OPS entry of their own (the test hook nvfp4_decode lives with nvfp4_repack, as in csrc)
EXTRA = {"nvfp4_decode": "nvfp4_repack"}


def _bound_ops() -> set[str]:
    text = (ROOT / "csrc" / "bindings.cpp").read_text()
    return set(re.findall(r'm\.def\("([A-Za-z0-9_]+)"', text)) - HOOKS


def test_bindings_define_exactly_the_native_ops():
    assert _bound_ops() == set(ops.NATIVE_OPS)


def test_every_cuda_op_dispatches_to_its_launcher_and_is_listed_in_cuda_ops():
    """csrc/bindings.cpp: each op that NATIVE_OPS serves on CUDA passes its launcher to dispatch (DG_CUDA) and is in
    the table behind build_info()["cuda_ops"], which CI's CUDA build compares with NATIVE_OPS
    (dgserve.ops.missing_cuda_ops)."""
    text = (ROOT / "csrc" / "bindings.cpp").read_text()
    dispatched = set(re.findall(r"dispatch\(op, \w+, dg::(\w+)_cpu, DG_CUDA\(dg::\1_cuda\)", text))
    listed = re.findall(r'\{"(\w+)", reinterpret_cast<const void\*>\(&dg::\1_cuda\)\}', text)
    cuda_ops = [op for op, kinds in ops.NATIVE_OPS.items() if "cuda" in kinds]
    assert listed == cuda_ops  # the same order as NATIVE_OPS
    assert set(cuda_ops) <= dispatched


@pytest.mark.parametrize("op", sorted(ops.NATIVE_OPS))
def test_one_name_end_to_end(op):
    assert (ROOT / "csrc" / "ops" / f"{op}.h").exists()
    assert (OPS_DIR / f"{op}.py").exists()
    assert (ROOT / "tests" / "ops" / f"test_{op}.py").exists()
    module = importlib.import_module(f"dgserve.ops.{op}")
    fn = getattr(ops, op)
    assert fn is getattr(module, op) and fn.__module__ == f"dgserve.ops.{op}"
    assert callable(getattr(module, f"{op}_native_ok"))
    assert fn.__doc__ and "Returns" in fn.__doc__  # shapes in the docstring


@pytest.mark.parametrize("op", sorted(ops.NATIVE_OPS) + sorted(EXTRA))
def test_reference_has_the_same_name_and_signature(op):
    assert inspect.signature(getattr(ops, op)) == inspect.signature(getattr(reference, op))


def test_signature_check_can_fail():
    def other(x, weight, eps=1e-6): ...

    assert inspect.signature(other) != inspect.signature(reference.rms_norm)


def test_extra_dispatchers_live_with_their_op():
    for name, home in EXTRA.items():
        assert getattr(ops, name).__module__ == f"dgserve.ops.{home}"


def test_package_only_re_exports():
    """dgserve/ops/__init__.py defines no function or class of its own."""
    tree = compile((OPS_DIR / "__init__.py").read_text(), "__init__.py", "exec", flags=0x400)  # ast.PyCF_ONLY_AST
    assert not [n for n in tree.body if type(n).__name__ in ("FunctionDef", "ClassDef", "AsyncFunctionDef")]


def test_native_helpers_used_by_siblings_are_public():
    """What the op modules read of dgserve.ops.native has no leading underscore (the extension ``_C`` aside)."""
    used = set()
    for path in OPS_DIR.glob("*.py"):
        if path.name != "native.py":
            used |= set(re.findall(r"\bnative\.(_?[A-Za-z]\w*)", path.read_text()))
    assert used, "no use of dgserve.ops.native found: the pattern is stale"
    assert {name for name in used if name.startswith("_")} <= {"_C"}
