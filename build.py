#!/usr/bin/env python3
"""The one build entry of dgserve: protobuf stubs and the native extension ``dgserve._C``.

Steps (each prints one line):

1. ``proto/**/*.proto`` → ``python/`` with ``grpc_tools.protoc -I proto --python_out --grpc_python_out
   --pyi_out`` (``proto/dgserve/v1/x.proto`` → ``python/dgserve/v1/x_pb2.py``), adding the ``__init__.py``
   files protoc does not write. Skipped, with a message, when there are no protos or grpc_tools is missing.
2. ``dgserve._C`` with ``torch.utils.cpp_extension.load`` (ninja) against the installed torch:
   ``csrc/bindings.cpp`` + ``csrc/ops/*_cpu.cpp`` always; ``csrc/ops/*.cu`` only when torch is a CUDA build
   AND nvcc is found (SASS for sm_90a, sm_80, sm_100a, sm_120, sm_121, each when this nvcc knows it, plus
   PTX for compute_80 that newer parts JIT-compile; ``--arch native``: device 0's arch alone, which a
   one-machine check wants). ``-O3``, no fast-math,
   ``-ffp-contract=off`` / ``--fmad=false`` (the ops are bit-exact contracts), OpenMP. The library is copied
   to ``python/dgserve/_C<EXT_SUFFIX>``, importable as ``dgserve._C`` from the editable install, or into
   ``--package-dir`` (CI's CUDA build goes into a copy of the package). ``CUDA_HOME`` is set first to the real
   toolkit (``find_cuda_home``: the folder with ``include/cuda_runtime.h``, through an nvcc wrapper or symlink),
   since torch guesses ``dirname(dirname(which nvcc))``.

Other modes: ``--check-cuda`` compiles each ``csrc/ops/*.cu`` alone with ``nvcc -c`` for every arch of the
build (or those of ``--arch``), one job per (file, arch), and fails when a kernel spills more than
SPILL_BUDGET_BYTES of registers to local memory (``ptxas -v``); the .cu files include no torch headers, so this
works on any machine with nvcc. It prints the compile seconds per arch. ``--logf-accuracy`` builds and runs
``csrc/tools/dg_logf_accuracy.cpp`` (exhaustive ulp error of the contract's float32 log).
Exit status is non-zero, with a one-line reason, when a step fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping

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
# (arch name, required `compute_XX` in `nvcc --list-gpu-arch`); sm_90a is the target (H100/H200), the others
# are the seeds' hardware: A100 (sm_80 SASS also runs on sm_86/89 parts), B200 (sm_100a), RTX 5090 / RTX PRO 6000
# (sm_120) and DGX Spark (sm_121). PTX_ARCH: PTX embedded for any newer part without SASS here (sm_103, sm_110,
# later majors), JIT-compiled by the driver at first load. compute_80 because the kernels use nothing newer
# (mma.sync, cp.async) and PTX only runs on parts at least as new as its target: compute_120 PTX would leave
# sm_103 and sm_110 with no code at all ('a' SASS such as sm_100a runs on its own part only).
CUDA_ARCHES = [
    ("sm_90a", "compute_90"),
    ("sm_80", "compute_80"),
    ("sm_100a", "compute_100"),
    ("sm_120", "compute_120"),
    ("sm_121", "compute_121"),
]
PTX_ARCH = "compute_80"
# --check-cuda fails when a kernel spills more than this to local memory (ptxas -v), and lists smaller spills.
# A few bytes are tolerated: the NT=2 NVFP4 GEMMs, capped at 128 registers for 2 CTAs/SM, spill 4-16 B (as
# they always have); the class of bug this catches is accept_kernel's former 5.4 KB spill.
SPILL_BUDGET_BYTES = 64


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


def _has_cuda_headers(root: pathlib.Path) -> bool:
    return (root / "include" / "cuda_runtime.h").is_file()


def _toolkit_of_nvcc(nvcc: pathlib.Path, depth: int = 0) -> pathlib.Path | None:
    """The toolkit root behind one ``nvcc``: symlinks resolved (``…/cuda-13.0/bin/nvcc`` → ``…/cuda-13.0``), and a
    small shell wrapper (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``) followed to the nvcc it names; None when
    neither leads to a folder with ``include/cuda_runtime.h``."""
    real = nvcc.resolve()
    if _has_cuda_headers(real.parent.parent):
        return real.parent.parent
    if depth >= 4 or not real.is_file() or real.stat().st_size > 64 << 10:
        return None
    with open(real, "rb") as f:
        head = f.read()
    if not head.startswith(b"#!"):
        return None  # a binary outside a toolkit tree
    for target in _WRAPPED_NVCC.findall(head.decode("utf-8", "replace")):
        found = _toolkit_of_nvcc(pathlib.Path(target), depth + 1)
        if found is not None:
            return found
    return None


_WRAPPED_NVCC = re.compile(r"(/[^\s\"';|&<>]*/nvcc)(?![\w.-])")
# Toolkit folders tried after CUDA_HOME, CUDA_PATH and nvcc on PATH: the usual symlink, then versioned installs
CUDA_HOME_GLOBS = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda")


def find_cuda_home(
    env: Mapping[str, str] | None = None, path: str | None = None, globs: tuple[str, ...] | None = None
) -> pathlib.Path | None:
    """The real CUDA toolkit: the first folder holding ``include/cuda_runtime.h`` among $CUDA_HOME, $CUDA_PATH, the
    toolkit behind ``nvcc`` on ``path`` (``_toolkit_of_nvcc``: symlinks and wrapper scripts followed) and
    ``globs`` (default CUDA_HOME_GLOBS; versioned folders newest first). torch's own guess is
    ``dirname(dirname(which nvcc))``, which for a wrapper in /usr/local/bin is /usr/local, where the build then
    fails on ``cuda_runtime.h: No such file``."""
    env = os.environ if env is None else env
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var) and _has_cuda_headers(pathlib.Path(env[var])):
            return pathlib.Path(env[var])
    nvcc = shutil.which("nvcc", path=env.get("PATH", os.defpath) if path is None else path)
    if nvcc is not None:
        found = _toolkit_of_nvcc(pathlib.Path(nvcc))
        if found is not None:
            return found
    for pattern in CUDA_HOME_GLOBS if globs is None else globs:
        matches = sorted(glob.glob(pattern), key=_version_key, reverse=True)
        for m in matches:
            if _has_cuda_headers(pathlib.Path(m)):
                return pathlib.Path(m)
    return None


def _version_key(path: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", pathlib.Path(path).name))


def set_cuda_home() -> str | None:
    """Point $CUDA_HOME at ``find_cuda_home()`` (when found) before torch.utils.cpp_extension is imported: torch
    reads it once, at import, for the nvcc and the include and library folders of the build. Returns it."""
    home = find_cuda_home()
    if home is None:
        return None
    if os.environ.get("CUDA_HOME") != str(home):
        if os.environ.get("CUDA_HOME"):
            log(f"ext: CUDA_HOME={os.environ['CUDA_HOME']} has no include/cuda_runtime.h; using {home}")
        os.environ["CUDA_HOME"] = str(home)
    return str(home)


def find_nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (pathlib.Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(pathlib.Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def gencode(name: str) -> str:
    """-gencode flag of one arch name: ``sm_90a`` → SASS for sm_90a, ``compute_80`` → PTX for compute_80."""
    if name.startswith("compute_"):
        return f"-gencode=arch={name},code={name}"
    num = name[3:]
    return f"-gencode=arch=compute_{num},code=sm_{num}"


def arch_of_capability(major: int, minor: int) -> str:
    """The SASS arch name of a device of compute capability (major, minor): the arch-specific ``a`` variant
    where CUDA_ARCHES builds one (9.0 → sm_90a, 10.0 → sm_100a), else plain (8.6 → sm_86, 12.0 → sm_120)."""
    name = f"sm_{major}{minor}"
    return f"{name}a" if f"{name}a" in {a for a, _ in CUDA_ARCHES} else name


def native_arch() -> str:
    """The arch of CUDA device 0 (``--arch native``); BuildError without a visible device."""
    import torch

    if not torch.cuda.is_available():
        raise BuildError("--arch native: no CUDA device is visible to torch")
    return arch_of_capability(*torch.cuda.get_device_capability(0))


def cuda_arches(nvcc: str, requested: list[str] | None) -> list[str]:
    """Arch names to build: those of CUDA_ARCHES (+ PTX_ARCH) this nvcc knows, or exactly ``requested``
    (names from CUDA_ARCHES, PTX_ARCH or any ``sm_XX`` / ``compute_XX`` the caller asks for; ``native`` is
    the arch of device 0, so a one-machine build compiles one arch instead of six)."""
    if requested is not None:
        return [native_arch() if name == "native" else name for name in requested]
    known = set(subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout.split())
    names = [name for name, compute in CUDA_ARCHES if compute in known]
    if PTX_ARCH in known:
        names.append(PTX_ARCH)
    if not names:
        raise BuildError(f"nvcc {nvcc} supports none of {[a for a, _ in CUDA_ARCHES]}")
    return names


def nvcc_arch_flags(nvcc: str, requested: list[str] | None) -> tuple[list[str], list[str]]:
    """-gencode flags for the arches this nvcc supports → (flags, arch names)."""
    names = cuda_arches(nvcc, requested)
    return [gencode(n) for n in names], names


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
    if not args.cpu_only:
        set_cuda_home()  # before torch.utils.cpp_extension reads it
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
    package = pathlib.Path(args.package_dir).resolve() if args.package_dir else PACKAGE
    for old in package.glob("_C*.so"):
        old.unlink()
    target = package / f"_C{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    shutil.copy2(built, target)
    names = [str(s.relative_to(ROOT)) for s in sources]
    log(f"ext: sources {', '.join(names)}")
    log(
        f"ext: {'CUDA (' + ', '.join(arches) + ')' if use_cuda else 'CPU'} build → "
        f"{_shown(target)} in {time.time() - t0:.1f} s"
    )


def _shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ----------------------------------------------------------------------------------------------------------
# standalone checks
# ----------------------------------------------------------------------------------------------------------


_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_FUNCTION = re.compile(r"Function properties for (\S+)")


def ptxas_spills(output: str) -> list[tuple[str, int, int]]:
    """(kernel, spill store bytes, spill load bytes) of every kernel that spills, from ``ptxas -v`` output."""
    spills, kernel = [], None
    for line in output.splitlines():
        m = _FUNCTION.search(line)
        if m:
            kernel = m.group(1)
            continue
        m = _SPILL.search(line)
        if m and kernel is not None and (int(m.group(1)) or int(m.group(2))):
            spills.append((kernel, int(m.group(1)), int(m.group(2))))
    return spills


def check_cuda(args: argparse.Namespace) -> None:
    """nvcc -c on every csrc/ops/*.cu × every arch, alone (no torch), into a temporary directory; no spills."""
    nvcc = shutil.which("nvcc") or (find_nvcc() if _torch_importable() else None)
    if nvcc is None:
        raise BuildError("--check-cuda: nvcc not found")
    cus = sorted((CSRC / "ops").glob("*.cu"))
    if not cus:
        raise BuildError("--check-cuda: no csrc/ops/*.cu files")
    arches = cuda_arches(nvcc, args.arch.split(",") if args.arch else None)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="dg-check-cuda-") as tmp:

        def compile_one(job: tuple[pathlib.Path, str]):
            cu, arch = job
            cmd = [
                nvcc,
                "-c",
                gencode(arch),
                STANDALONE_STD,
                *NVCC_FLAGS,
                "-I",
                str(CSRC),
                str(cu),
                "-o",
                str(pathlib.Path(tmp) / f"{cu.stem}.{arch}.o"),
            ]
            if not arch.startswith("compute_"):
                cmd[2:2] = ["-Xptxas", "-v"]  # resource usage: registers, stack, spills
            if args.verbose:
                log("check-cuda: " + " ".join(cmd))
            t = time.time()
            r = subprocess.run(cmd, capture_output=True, text=True)
            return cu, arch, r, time.time() - t

        jobs = [(cu, arch) for arch in arches for cu in cus]
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs or os.cpu_count() or 2) as pool:
            results = list(pool.map(compile_one, jobs))
    failed = [(cu, arch, r) for cu, arch, r, _ in results if r.returncode != 0]
    for cu, arch, r in failed:
        print(f"[build] {cu.name} ({arch}):\n" + r.stdout + r.stderr, file=sys.stderr)
    if failed:
        raise BuildError("--check-cuda: nvcc failed on " + ", ".join(f"{cu.name} ({a})" for cu, a, _ in failed))
    per_arch = {arch: sum(dt for _, a, _, dt in results if a == arch) for arch in arches}
    log(f"check-cuda: {len(cus)} file(s) ({', '.join(cu.name for cu in cus)})")
    log(
        "check-cuda: compile seconds per arch (summed over files): "
        + ", ".join(f"{a} {dt:.1f}" for a, dt in per_arch.items())
    )
    spills = [(cu, arch, s) for cu, arch, r, _ in results for s in ptxas_spills(r.stdout + r.stderr)]
    over = [x for x in spills if max(x[2][1], x[2][2]) > SPILL_BUDGET_BYTES]
    for cu, arch, (kernel, st, ld) in spills:
        log(
            f"check-cuda: {cu.name} ({arch}): {kernel} spills {st} B stores / {ld} B loads"
            + (" -- over the budget" if max(st, ld) > SPILL_BUDGET_BYTES else "")
        )
    if over:
        raise BuildError(
            f"--check-cuda: {len(over)} kernel(s) spill more than {SPILL_BUDGET_BYTES} B of registers "
            "to local memory (listed above)"
        )
    log(
        f"check-cuda: {len(cus)} file(s) compile with nvcc for {', '.join(arches)}, no spill over "
        f"{SPILL_BUDGET_BYTES} B ({len(spills)} smaller), in {time.time() - t0:.1f} s"
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
        help="comma-separated CUDA arches to build, e.g. sm_90a,sm_100a; compute_XX for PTX; native: the arch "
        "of CUDA device 0 (sm_90a on H100/H200) (default: sm_90a, sm_80, sm_100a, sm_120, sm_121 and PTX compute_80, "
        "each when nvcc supports it)",
    )
    p.add_argument(
        "--package-dir",
        default=None,
        help="the folder the extension is copied into as _C<EXT_SUFFIX> (default python/dgserve); CI builds the "
        "CUDA extension into a copy of the package so the CPU one stays in place",
    )
    p.add_argument(
        "--jobs", type=int, default=None, help="parallel compile jobs, sets MAX_JOBS (default: MAX_JOBS or ninja's)"
    )
    p.add_argument(
        "--check-cuda",
        action="store_true",
        help="only compile each csrc/ops/*.cu with "
        "`nvcc -c` for every arch (or --arch) into a temporary directory (no torch needed), fail on "
        "register spills over SPILL_BUDGET_BYTES, print the seconds per arch, then exit",
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
