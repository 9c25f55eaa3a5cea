"""The ``dgserve`` command line.

    dgserve serve [FLAGS]                                  serve gRPC + OpenAI-compatible HTTP (dgserve.service)
    dgserve download ORG/NAME [--revision R] [--download-dir D]   fetch a Hub model ahead; prints its directory
    dgserve generate "PROMPT" --server HOST:PORT [knobs]   stream blocks from a running server (dgserve serve)
    dgserve generate "PROMPT" [--model DIR] [knobs]        generate in this process (no server)
    dgserve info --server HOST:PORT                        the served model, its defaults and bounds
    dgserve make-random DIR [--preset tiny|mid] [--seed S] [--tokenizer]

``generate`` prints each block's text as it arrives on stdout and one progress line per block on stderr
(``--json``: one JSON line per event instead). Without ``--model`` the local mode uses the default model
(``dgserve.model.default_model.default_model_path``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

_DTYPES = ("float32", "bfloat16")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dgserve", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve",
        add_help=False,
        help="run the server (gRPC + OpenAI-compatible HTTP); `dgserve serve --help` lists its flags",
    )
    sub.add_parser(
        "download",
        add_help=False,
        help="fetch a model by Hub id into the huggingface_hub cache; `dgserve download --help` lists its flags",
    )
    g = sub.add_parser("generate", help="generate from a prompt, streaming each committed block")
    g.add_argument("text", nargs="?", help="prompt text")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (same as the positional argument)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    g.add_argument("--chat", action="store_true", help="send the prompt as one user chat message")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--max-denoising-steps", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON line per event")
    _remote_args(g)
    g.add_argument("--timeout", type=float, default=None, help="deadline in seconds (remote)")
    g.add_argument("--model", help="local mode: checkpoint directory (default: the default model)")
    g.add_argument("--device", default="cpu", help="local mode: torch device")
    g.add_argument("--dtype", choices=_DTYPES, default="float32", help="local mode: precision")
    g.add_argument("--hf-overrides", help="local mode: JSON object deep-merged into the model's config.json")
    i = sub.add_parser("info", help="show the served model's info")
    _remote_args(i)
    m = sub.add_parser("make-random", help="write a random checkpoint directory")
    m.add_argument("path")
    m.add_argument("--preset", default="tiny")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--tokenizer", action="store_true", help="also write a tiny BPE tokenizer (tiny preset)")
    return p


def _remote_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", help="HOST:PORT of a dgserve server's gRPC port (dgserve serve)")
    p.add_argument("--token-file", help="file holding a bearer token")
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--ca", help="CA certificate (PEM) to verify the server with")
    p.add_argument("--cert", help="client certificate (PEM), for mTLS")
    p.add_argument("--key", help="client private key (PEM), for mTLS")


def _knobs(args) -> dict:
    kw = dict(max_new_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.max_denoising_steps is not None:
        kw["max_denoising_steps"] = args.max_denoising_steps
    return kw


def _progress(index: int, n_tokens: int, steps: int, ms: float) -> None:
    print(f"\n[block {index}: {n_tokens} tokens, {steps} steps, {ms:.0f} ms]", file=sys.stderr, flush=True)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _client(args):
    from dgserve.client import Client

    raw_token = _read(args.token_file) if args.token_file else None
    token = raw_token.decode().strip() if raw_token is not None else None
    return Client(
        args.server,
        token=token,
        tls=args.tls or bool(args.ca or args.cert),
        root_certificates=_read(args.ca),
        client_cert=_read(args.cert),
        client_key=_read(args.key),
    )


def _remote_generate(args, prompt_text: str | None, prompt_ids: list[int] | None) -> int:
    from google.protobuf.json_format import MessageToDict

    from dgserve.client import RpcError, error_text

    kw = dict(prompt=prompt_text, token_ids=prompt_ids, stop=args.stop or None, timeout=args.timeout, **_knobs(args))
    if args.chat:
        kw.update(prompt=None, messages=[{"role": "user", "content": prompt_text or ""}])
    t_last = time.perf_counter()
    try:
        with _client(args) as client:
            for event in client.generate(**kw):
                if args.json:
                    print(json.dumps(MessageToDict(event, preserving_proto_field_name=True)), flush=True)
                elif event.HasField("block"):
                    b, now = event.block, time.perf_counter()
                    print(b.text, end="", flush=True)
                    _progress(b.index, len(b.token_ids), b.stats.denoising_steps, (now - t_last) * 1e3)
                    t_last = now
                elif event.HasField("finished"):
                    _print_finished(event.finished)
    except RpcError as e:
        print(f"error: {error_text(e)}", file=sys.stderr)
        return 1
    return 0


def _print_finished(f) -> None:
    from dgserve.client import FINISH_REASONS

    u = f.usage
    print(
        f"\n# finished: {FINISH_REASONS[f.finish_reason]}; {u.prompt_tokens} prompt + {u.completion_tokens} "
        f"generated tokens in {u.blocks} blocks ({u.denoising_steps} denoising steps); first block "
        f"{f.timing.first_block_ms:.0f} ms, total {f.timing.total_ms:.0f} ms",
        file=sys.stderr,
    )


def _local_generate(args, prompt_text: str | None, prompt_ids: list[int] | None) -> int:
    import torch

    from dgserve import Engine
    from dgserve.config import ConfigError, parse_hf_overrides
    from dgserve.engine.prompt import ChatPrompt, Prompt
    from dgserve.model.default_model import default_model_path

    try:
        engine = Engine.from_pretrained(
            args.model or default_model_path(),
            device=args.device,
            dtype=getattr(torch, args.dtype),
            hf_overrides=parse_hf_overrides(args.hf_overrides, "--hf-overrides"),
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt: Prompt | None = prompt_ids if prompt_ids is not None else prompt_text
    if args.chat:
        prompt = ChatPrompt(({"role": "user", "content": prompt_text or ""},))
    if prompt is None:
        prompt = [engine.model.config.bos_token_id or 2]
    try:
        params = engine.default_params(stop=tuple(args.stop), **_knobs(args))
        t_last = time.perf_counter()
        for block in engine.stream(prompt, params):
            now = time.perf_counter()
            if args.json:
                print(
                    json.dumps(
                        {
                            "block": block.index,
                            "token_ids": block.token_ids,
                            "text": block.text,
                            "denoising_steps": block.stats.denoising_steps,
                            "finish_reason": block.finish_reason,
                        }
                    ),
                    flush=True,
                )
            else:
                print(block.text, end="", flush=True)
                _progress(block.index, len(block.token_ids), block.stats.denoising_steps, (now - t_last) * 1e3)
            t_last = now
    except (ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _info(args) -> int:
    from google.protobuf.json_format import MessageToDict

    from dgserve.client import RpcError, error_text

    if not args.server:
        print("error: info needs --server HOST:PORT", file=sys.stderr)
        return 2
    try:
        with _client(args) as client:
            info = client.model_info(timeout=10)
    except RpcError as e:
        print(f"error: {error_text(e)}", file=sys.stderr)
        return 1
    print(json.dumps(MessageToDict(info, preserving_proto_field_name=True), indent=2))
    return 0


def _make_random(args) -> int:
    from dgserve.model.tiny import make_random_checkpoint

    path = make_random_checkpoint(args.path, args.preset, args.seed)
    if args.tokenizer:
        from dgserve.model.default_model import train_tokenizer

        train_tokenizer(300).save(f"{path}/tokenizer.json")
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # the server owns its flags (dgserve/service/__main__.py)
        # service/ is installed as dgserve.service (pyproject package-dir); mypy checks it from source as `service`
        from dgserve.service.__main__ import main as serve  # type: ignore[import-not-found]

        return serve(argv[1:])
    if argv[:1] == ["download"]:
        from dgserve.service.__main__ import download_main

        return download_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "info":
        return _info(args)
    if args.command == "make-random":
        return _make_random(args)
    text = args.text if args.text is not None else args.prompt
    ids = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else None
    if text is not None and ids is not None:
        print("error: give prompt text or --prompt-ids, not both", file=sys.stderr)
        return 2
    if args.server:
        if text is None and ids is None:
            print("error: generate --server needs a prompt", file=sys.stderr)
            return 2
        return _remote_generate(args, text, ids)
    return _local_generate(args, text, ids)


if __name__ == "__main__":
    sys.exit(main())
