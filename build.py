#!/usr/bin/env python3
"""The one build entry of dgserve: protobuf stubs and the native extension ``dgserve._C``.

Steps (each prints one line):

1. ``proto/**/*.proto`` → ``python/`` with ``grpc_tools.protoc -I proto --python_out --grpc_python_out
   --pyi_out`` (``proto/dgserve/v1/x.proto`` → ``python/dgserve/v1/x_pb2.py``), adding the ``__init__.py``
   files protoc does not write. Skipped, with a message, when there are no protos or grpc_tools is missing.
2. ``dgserve._C`` with ``torch.utils.cpp_extension.load`` (ninja) against the installed torch:
   ``csrc/bindings.cpp`` + ``csrc/ops/*_cpu.cpp`` always; ``csrc/ops/*.cu`` only when torch is a CUDA build
   AND nvcc is found (sm_90a, plus sm_80 and sm_100a when this nvcc knows them). ``-O3``, no fast-math,
   ``-ffp-contract=off`` / ``--fmad=false`` (the ops are bit-exact contracts), OpenMP. The library is copied
   to ``python/dgserve/_C<EXT_SUFFIX>``, importable as ``dgserve._C`` from the editable install.

Other modes: ``--check-cuda`` compiles each ``csrc/ops/*.cu`` alone with ``nvcc -c -arch=sm_90a`` (the .cu
files include no torch headers, so this works on any machine with nvcc); ``--logf-accuracy`` builds and runs
``csrc/tools/dg_logf_accuracy.cpp`` (exhaustive ulp error of the contract's float32 log).
Exit status is non-zero, with a one-line reason, when a step fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
PROTO = ROOT / "proto"
PYTHON = ROOT / "python"
PACKAGE = PYTHON / "dgserve"
BUILD = ROOT / "build"

# -ffp-contract=off / --fmad=false: no implicit FMAs (the ops are bit-exact contracts; explicit fmaf only).
# -fno-trapping-math changes no value (we never read FP exception flags); it lets g++ if-convert selects so
# the Philox / dg_logf / exp loops vectorise. The language standard is left to torch (it sets -std=c++20 or so).
CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fopenmp"]
NVCC_FLAGS = ["-O3", "--fmad=false", "-lineinfo"]
STANDALONE_STD = "-std=c++17"  # --check-cuda and the accuracy tool, which have no torch to pick one
# (arch name, required `compute_XX` in `nvcc --list-gpu-arch`); sm_90a is the target, the others are extras.
CUDA_ARCHES = [("sm_90a", "compute_90"), ("sm_80", "compute_80"), ("sm_100a", "compute_100")]


class BuildError(RuntimeError):
    """A build step failed; the message says which and why."""


def log(msg: str) -> None:
    print(f"[build] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------------
# 1. protobuf stubs
# ----------------------------------------------------------------------------------------------------------


def build_protos(verbose: bool) -> None:
    protos = sorted(PROTO.rglob("*.proto")) if PROTO.is_dir() else []
    if not protos:
        log("proto: no proto/**/*.proto files, skipped")
        return
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError:
        log("proto: grpc_tools is not installed (pip install grpcio-tools), skipped")
        return
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    rel = [str(p.relative_to(PROTO)) for p in protos]
    argv = [
        "grpc_tools.protoc",
        "-I",
        str(PROTO),
        "-I",
        str(well_known),
        f"--python_out={PYTHON}",
        f"--grpc_python_out={PYTHON}",
        f"--pyi_out={PYTHON}",
        *rel,
    ]
    if verbose:
        log("proto: " + " ".join(argv))
    if protoc.main(argv) != 0:
        raise BuildError(f"protoc failed on {', '.join(rel)}")
    for p in protos:  # protoc writes no __init__.py; every package directory below python/ needs one
        d = PYTHON / p.relative_to(PROTO).parent
        while d != PYTHON and d.is_relative_to(PYTHON):
            if not (d / "__init__.py").exists():
                (d / "__init__.py").write_text("")
            d = d.parent
    log(
        f"proto: {len(protos)} file(s) → {', '.join(sorted({str((PYTHON / r).parent.relative_to(ROOT)) for r in rel}))}"
    )


# ----------------------------------------------------------------------------------------------------------
# 2. the extension
# ----------------------------------------------------------------------------------------------------------


def find_nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (pathlib.Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(pathlib.Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_arch_flags(nvcc: str, requested: list[str] | None) -> tuple[list[str], list[str]]:
    """-gencode flags for the arches this nvcc supports → (flags, arch names)."""
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    known = set(out)
    flags, names = [], []
    for name, compute in CUDA_ARCHES:
        if requested is not None and name not in requested:
            continue
        if compute in known or (requested is not None):
            num = name[3:]
            flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
            names.append(name)
    if not names:
        raise BuildError(f"nvcc {nvcc} supports none of {[a for a, _ in CUDA_ARCHES]}")
    return flags, names


def ensure_ninja_on_path() -> None:
    """torch's JIT builder runs `ninja`; the venv's bin dir is not on PATH when the venv is not activated."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join(dirs + [os.environ.get("PATH", "")])
    if shutil.which("ninja") is None:
        raise BuildError("ninja not found (pip install ninja)")


def build_extension(args: argparse.Namespace) -> None:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        raise BuildError(f"torch is not importable ({e}); install dgserve's dependencies first") from e
    ensure_ninja_on_path()
    if args.jobs:
        os.environ["MAX_JOBS"] = str(args.jobs)

    sources = [CSRC / "bindings.cpp", *sorted((CSRC / "ops").glob("*_cpu.cpp"))]
    nvcc = None if args.cpu_only else find_nvcc()
    use_cuda = bool(torch.version.cuda) and nvcc is not None
    if not use_cuda:
        why = "--cpu-only" if args.cpu_only else "torch is a CPU build" if not torch.version.cuda else "nvcc not found"
        log(f"ext: CPU-only extension ({why})")
    cflags, cuda_flags, arches = list(CXX_FLAGS), list(NVCC_FLAGS), []
    if use_cuda:
        sources += sorted((CSRC / "ops").glob("*.cu"))
        arch_flags, arches = nvcc_arch_flags(nvcc, args.arch.split(",") if args.arch else None)
        cuda_flags += arch_flags
        cflags.append("-DDG_WITH_CUDA")
        cuda_flags.append("-DDG_WITH_CUDA")
        log(f"ext: CUDA extension with {nvcc} for {', '.join(arches)}")

    build_dir = BUILD / ("ext-cuda" if use_cuda else "ext-cpu")
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        module = cpp_extension.load(
            name="_C",
            sources=[str(s) for s in sources],
            extra_include_paths=[str(CSRC)],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            with_cuda=use_cuda,
            verbose=args.verbose,
        )
    except Exception as e:  # compiler errors arrive as RuntimeError (torch captures ninja's output)
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        detail = [ln for ln in lines if "error" in ln.lower() and "ninja" not in ln.lower()][:12]
        for ln in detail or lines[-12:]:
            print(f"[build]   {ln}", file=sys.stderr)
        raise BuildError("compiling dgserve._C failed (errors above; --verbose shows the full compiler output)") from e
    built = pathlib.Path(module.__file__)
    for old in PACKAGE.glob("_C*.so"):
        old.unlink()
    target = PACKAGE / f"_C{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    shutil.copy2(built, target)
    names = [str(s.relative_to(ROOT)) for s in sources]
    log(f"ext: sources {', '.join(names)}")
    log(
        f"ext: {'CUDA (' + ', '.join(arches) + ')' if use_cuda else 'CPU'} build → "
        f"{target.relative_to(ROOT)} in {time.time() - t0:.1f} s"
    )


# ----------------------------------------------------------------------------------------------------------
# standalone checks
# ----------------------------------------------------------------------------------------------------------


def check_cuda(args: argparse.Namespace) -> None:
    """nvcc -c -arch=sm_90a on every csrc/ops/*.cu, alone (no torch), into a temporary directory."""
    nvcc = shutil.which("nvcc") or (find_nvcc() if _torch_importable() else None)
    if nvcc is None:
        raise BuildError("--check-cuda: nvcc not found")
    cus = sorted((CSRC / "ops").glob("*.cu"))
    if not cus:
        raise BuildError("--check-cuda: no csrc/ops/*.cu files")
    arch = args.arch.split(",")[0] if args.arch else "sm_90a"
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dg-check-cuda-") as tmp:

        def compile_one(cu: pathlib.Path):
            cmd = [
                nvcc,
                "-c",
                f"-arch={arch}",
                STANDALONE_STD,
                *NVCC_FLAGS,
                "-I",
                str(CSRC),
                str(cu),
                "-o",
                str(pathlib.Path(tmp) / (cu.stem + ".o")),
            ]
            if args.verbose:
                log("check-cuda: " + " ".join(cmd))
            return cu, subprocess.run(cmd, capture_output=True, text=True)

        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs or os.cpu_count() or 2) as pool:
            results = list(pool.map(compile_one, cus))
    failed = [(cu, r) for cu, r in results if r.returncode != 0]
    for _, r in failed:
        print(r.stdout + r.stderr, file=sys.stderr)
    if failed:
        raise BuildError(f"--check-cuda: nvcc failed on {', '.join(cu.name for cu, _ in failed)}")
    log(
        f"check-cuda: {len(cus)} file(s) compile with nvcc -arch={arch} "
        f"({', '.join(cu.name for cu in cus)}) in {time.time() - t0:.1f} s"
    )


def logf_accuracy(args: argparse.Namespace) -> None:
    """Build and run csrc/tools/dg_logf_accuracy.cpp (exhaustive, a minute or so on 2 cores)."""
    src = CSRC / "tools" / "dg_logf_accuracy.cpp"
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise BuildError("--logf-accuracy: no C++ compiler found")
    out = BUILD / "dg_logf_accuracy"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [cxx, STANDALONE_STD, *CXX_FLAGS, "-I", str(CSRC), str(src), "-o", str(out)]
    if subprocess.run(cmd).returncode != 0:
        raise BuildError("--logf-accuracy: compile failed")
    if subprocess.run([str(out)]).returncode != 0:
        raise BuildError("--logf-accuracy: accuracy check failed")


def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Outputs: python/dgserve/v1/*_pb2*.py and python/dgserve/_C*.so (gitignored).",
    )
    p.add_argument("--no-proto", action="store_true", help="skip the protobuf stubs")
    p.add_argument("--no-ext", action="store_true", help="skip the native extension dgserve._C")
    p.add_argument(
        "--cpu-only",
        action="store_true",
        help="build the extension without CUDA sources even when torch is a CUDA build and nvcc is found",
    )
    p.add_argument(
        "--arch",
        default=None,
        help="comma-separated CUDA arches to build, e.g. sm_90a,sm_100a "
        "(default: sm_90a plus sm_80 and sm_100a when nvcc supports them)",
    )
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: ninja's choice)")
    p.add_argument(
        "--check-cuda",
        action="store_true",
        help="only compile each csrc/ops/*.cu with "
        "`nvcc -c -arch=sm_90a` into a temporary directory (no torch needed), then exit",
    )
    p.add_argument(
        "--logf-accuracy",
        action="store_true",
        help="only build and run the exhaustive accuracy check of dg_logf (csrc/tools/dg_logf_accuracy.cpp), then exit",
    )
    p.add_argument("--verbose", action="store_true", help="show compiler commands and output")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    try:
        if args.check_cuda:
            check_cuda(args)
            return 0
        if args.logf_accuracy:
            logf_accuracy(args)
            return 0
        if not args.no_proto:
            build_protos(args.verbose)
        if not args.no_ext:
            build_extension(args)
    except BuildError as e:
        print(f"[build] FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    log(f"done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
