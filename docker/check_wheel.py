#!/usr/bin/env python3
"""Check that a dgserve wheel carries what the container serves with: the server app (``dgserve.service``, run as
``dgserve serve``; no top-level ``service`` module), the generated gRPC stubs, the small model shipped as the
default, and (``--require-ext``) the compiled extension ``dgserve._C``.

    python docker/check_wheel.py [--require-ext] dist/dgserve-*.whl

Exit status 1 with the missing members listed, 0 otherwise. Used by the Dockerfile right after ``pip wheel``
and by tests/test_container.py.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import zipfile

REQUIRED = [
    "dgserve/__init__.py",
    "dgserve/service/__init__.py",
    "dgserve/service/__main__.py",
    "dgserve/service/server.py",
    "dgserve/service/grpc/servicer.py",
    "dgserve/service/http/app.py",
    "dgserve/v1/__init__.py",
    "dgserve/v1/text_generation_pb2.py",
    "dgserve/v1/text_generation_pb2_grpc.py",
    "dgserve/models/small/config.json",
    "dgserve/models/small/generation_config.json",
    "dgserve/models/small/model.safetensors",
    "dgserve/models/small/tokenizer.json",
]
EXTENSION = "dgserve/_C*.so"
FORBIDDEN = "service/*"  # the app is installed inside our namespace, never as a top-level `service`


def missing_members(wheel: str, require_ext: bool) -> list[str]:
    """The required member names (or glob) that ``wheel`` lacks, and "not service/*" when it has a top-level
    ``service`` package."""
    names = zipfile.ZipFile(wheel).namelist()
    patterns = REQUIRED + ([EXTENSION] if require_ext else [])
    missing = [p for p in patterns if not fnmatch.filter(names, p)]
    return missing + ([f"not {FORBIDDEN}"] if fnmatch.filter(names, FORBIDDEN) else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel")
    p.add_argument("--require-ext", action="store_true", help="also require the compiled dgserve._C")
    args = p.parse_args(argv)
    missing = missing_members(args.wheel, args.require_ext)
    if missing:
        print(
            f"check_wheel: {args.wheel} lacks {', '.join(missing)} "
            "(pyproject.toml [tool.setuptools] packages / package-data; run build.py before building the wheel)",
            file=sys.stderr,
        )
        return 1
    print(
        f"check_wheel: {args.wheel} carries the server, the stubs, the small model"
        f"{' and dgserve._C' if args.require_ext else ''}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
