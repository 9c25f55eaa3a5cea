"""``dgserve serve`` (also ``python -m dgserve.service``): flags, each with one environment fallback (read here and
nowhere else), → ServiceConfig → run the gRPC and OpenAI-compatible HTTP server until SIGTERM (graceful drain).
``--dry-run`` prints the resolved config as JSON and exits. ``download_main`` is ``dgserve download``: it fetches a
model named by Hub id ahead of serving and prints its snapshot directory (docs/deployment.md, "Models by name").

Precedence: a flag given on the command line, then its environment variable, then the default (ServiceConfig's;
the flags, their variables and their help are the table in ``flags.py``).

Exit status: 0 after a graceful drain; 2 when startup cannot succeed (a bad flag or env value, a port in use, a
missing or unreadable model, auth or TLS file, a model that fails to load), with one line on stderr naming the
problem and the flag / env var that fixes it (the traceback too only with ``--log-level debug``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import traceback

from .config import ServiceConfig
from .flags import FLAGS, SWITCHES, flag_help

_TRUE = {"1", "true", "yes", "on"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgserve serve", description=__doc__.split("\n\n")[0])
    for flag, env, field, _, help_ in FLAGS:
        p.add_argument(flag, default=None, help=f"{flag_help(field, help_)} [env {env}]")
    for flag, env, _, _, help_ in SWITCHES:
        p.add_argument(flag, action="store_true", default=None, help=f"{help_} [env {env}=1]")
    p.add_argument("--dry-run", action="store_true", help="print the resolved configuration as JSON and exit")
    return p


def build_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> tuple[ServiceConfig, bool]:
    """(config, dry_run) from the command line and the environment (os.environ by default). ValueError naming the
    field, then the flag and env var that set it."""
    env = dict(os.environ if environ is None else environ)
    args = _parser().parse_args(argv)
    try:
        kw: dict = {}
        for flag, var, field, parse, _ in FLAGS:
            raw = getattr(args, flag[2:].replace("-", "_"))
            raw = raw if raw is not None else env.get(var)
            if raw is not None and raw != "":
                kw[field] = _convert(field, raw, parse)
        if "model" not in kw and env.get("NIM_MODEL_NAME"):  # NIM's name for a model given by Hub id
            kw["model"] = env["NIM_MODEL_NAME"]
        kw.update(
            {
                field: value
                for flag, var, field, value, _ in SWITCHES
                if getattr(args, flag[2:].replace("-", "_")) or env.get(var, "").strip().lower() in _TRUE
            }
        )
        config = ServiceConfig(**kw)
        _check_revision(config)
        return config, args.dry_run
    except ValueError as e:
        raise ValueError(f"{e}{_fix_hint(str(e))}") from None


def _check_revision(config: ServiceConfig) -> None:
    """ValueError when --revision is given with a model that is a local directory (a revision pins a Hub id only)."""
    from .hub import is_hub_id

    if config.revision and config.model is not None and not is_hub_id(config.model):
        raise ValueError(
            f"revision {config.revision!r} applies to a model given by Hub id (org/name), but model {config.model!r} "
            "is a local path: drop the revision or name the model by id"
        )


def _fix_hint(message: str) -> str:
    """ " (set --flag / env VAR)" for each config field a ServiceConfig message names; "" when none."""
    hints = [f"{flag} / env {var}" for flag, var, field, *_ in FLAGS + SWITCHES if re.search(rf"\b{field}\b", message)]
    return f" (set {'; '.join(hints)})" if hints else ""


def _convert(field: str, raw: str, parse):
    if field in ("served_model_name", "allowed_hosts", "allowed_origins", "allowed_media_domains"):
        return tuple(n.strip() for n in raw.split(",") if n.strip())
    if field == "http_port":
        return None if raw.strip().lower() in ("off", "none", "-1") else int(raw)
    if field == "hf_overrides":  # a JSON object; a bad one is a one-line error naming the flag
        from dgserve.config import parse_hf_overrides

        return parse_hf_overrides(raw, "--hf-overrides")
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"{field}: cannot parse {raw!r} as {parse.__name__}") from None


def _runtime(config: ServiceConfig) -> dict:
    """The resolved device, dtype, expert format and native ops (dgserve.model.runtime), for --dry-run."""
    from dgserve.model.default_model import default_model_path
    from dgserve.model.runtime import describe, plan_runtime

    from .hub import HubError, is_hub_id, probe

    model = config.model or default_model_path()
    try:
        if is_hub_id(model):  # by id: the cached snapshot or its config.json alone (no weights are fetched)
            model = probe(model, config.revision, config.download_dir)
        return describe(plan_runtime(model, config.device, config.dtype, config.native_ops))
    except HubError as e:
        return {"problem": str(e)}
    except Exception as e:  # noqa: BLE001 - a dry run reports, it does not fail
        return {"problem": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    try:
        config, dry_run = build_config(argv)
    except ValueError as e:
        print(f"dgserve serve: error: {e}", file=sys.stderr)
        return 2
    if dry_run:
        from dgserve.engine.cpu_threads import choose_cpu_threads

        runtime = _runtime(config)
        runtime["cpu_threads"] = choose_cpu_threads(config.cpu_threads, os.environ.get("OMP_NUM_THREADS")).describe()
        print(json.dumps({**config.to_dict(), "runtime": runtime}, indent=2, sort_keys=True))
        return 0
    from dgserve.engine.cpu_threads import apply_cpu_threads

    from .logs import setup_logging
    from .server import Server, StartupError

    setup_logging(config.log_level, config.json_logs)
    # before any thread runs torch: the process's CPUs, not the host's (docs/deployment.md, "CPU threads"); the
    # server logs the choice once it listens (a start-up failure stays one line)
    threads = apply_cpu_threads(config.cpu_threads, os.environ.get("OMP_NUM_THREADS"))
    try:
        asyncio.run(Server(config, cpu_threads=threads).run())
    except StartupError as e:
        if config.log_level.upper() == "DEBUG":
            traceback.print_exception(e.__cause__ or e)
        print(f"dgserve serve: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def download_main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    """``dgserve download MODEL [--revision R] [--download-dir D]``: fetch a model named by Hub id into the
    huggingface_hub cache and print its snapshot directory. Exit 2 with one line on stderr when it cannot."""
    env = dict(os.environ if environ is None else environ)
    p = argparse.ArgumentParser(prog="dgserve download", description="fetch a model by Hub id ahead of serving")
    p.add_argument("model", help="Hub id (org/name)")
    p.add_argument("--revision", default=env.get("DGSERVE_REVISION") or None, help="branch, tag or commit "
                   "(default: the default branch) [env DGSERVE_REVISION]")  # fmt: skip
    p.add_argument("--download-dir", default=env.get("NIM_CACHE_PATH") or None, help="huggingface_hub cache "
                   "(default: HF_HUB_CACHE) [env NIM_CACHE_PATH]")  # fmt: skip
    json_logs = env.get("NIM_JSONL_LOGGING", "").strip().lower() in _TRUE
    p.add_argument("--json-logs", action="store_true", default=json_logs,
                   help="JSON-lines logs: a line per file started and finished [env NIM_JSONL_LOGGING=1]")  # fmt: skip
    args = p.parse_args(argv)
    from .hub import HubError, fetch, is_hub_id
    from .logs import setup_logging

    if not is_hub_id(args.model):
        print(f"dgserve download: error: {args.model!r} is not a Hub id (org/name)", file=sys.stderr)
        return 2
    setup_logging("INFO", args.json_logs)
    try:
        path = fetch(args.model, args.revision, args.download_dir, log_progress=args.json_logs)
    except HubError as e:
        print(f"dgserve download: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
