"""Service load test: N concurrent streaming clients against a server in this process (CPU by default), over
gRPC and over the OpenAI-compatible HTTP API (SSE), beside the engine alone.

    python bench/bench_service.py [--model DIR] [--clients 1,4,16] [--requests-per-client 2]
                                  [--max-new-tokens 64] [--steps 8] [--prompt-len 16] [--front-doors grpc,http]

For each client count: the same requests (fixed seeds, EOS ignored, no adaptive stop so every block takes
``--steps`` steps) are run (1) through ``Engine.generate_batch`` directly and (2) as concurrent streams through each
front door (grpc.aio clients, or aiohttp streaming ``/v1/completions`` with ``stream: true``; one stream per client
at a time) against a ``dgserve.service.server.Server`` on 127.0.0.1. Prints one JSON line per (front door, client
count): time to first block (p50/p99), inter-block gap (p50/p99), aggregate tokens/s of the front door and of the
direct path, and the overhead per block = (front-door wall − direct wall) / blocks. Warm-up first. The direct path
runs first, on threads that end with it, and the server after: each live thread that ran torch work keeps an OpenMP
pool, and two live pools slow both (docs/deployment.md, "CPU threads").
Default model: dgserve.default_model_path().
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import platform
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _requests(n: int, args) -> list[tuple[list[int], dict]]:
    prompt = [2] + [5 + (i * 7) % 250 for i in range(args.prompt_len - 1)]
    knobs = dict(
        max_new_tokens=args.max_new_tokens, max_denoising_steps=args.steps, ignore_eos=True, confidence_threshold=1e-30
    )
    return [(prompt, dict(knobs, seed=i)) for i in range(n)]


def _direct(engine, reqs) -> float:
    from dgserve import SamplingParams

    t0 = time.perf_counter()
    engine.generate_batch([p for p, _ in reqs], [SamplingParams(**k) for _, k in reqs])
    return time.perf_counter() - t0


async def _grpc_client(target: str, reqs, ttfb: list, gaps: list) -> int:
    from dgserve.client import AsyncClient

    tokens = 0
    async with AsyncClient(target) as c:
        for prompt, knobs in reqs:
            t0 = last = time.perf_counter()
            first = True
            async for ev in c.generate(token_ids=prompt, **knobs):
                if ev.HasField("block"):
                    now = time.perf_counter()
                    (ttfb.append(now - t0) if first else gaps.append(now - last))
                    first, last = False, now
                    tokens += len(ev.block.token_ids)
    return tokens


async def _http_client(url: str, reqs, ttfb: list, gaps: list) -> int:
    # aiohttp (its HTTP parser is C) rather than httpx: the clients share the server's process and its two cores,
    # and 16 httpx streams used ~0.6 s of CPU a run against aiohttp's ~0.05 s (docs/memory.md), which read as the
    # HTTP door's cost
    import aiohttp

    tokens = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as c:
        for prompt, knobs in reqs:
            body = {"prompt": prompt, "stream": True, **knobs, "max_tokens": knobs["max_new_tokens"]}
            del body["max_new_tokens"]
            t0 = last = time.perf_counter()
            first = True
            async with c.post(url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.content:  # one SSE line at a time
                    if not line.startswith(b"data: {"):
                        continue
                    block = (json.loads(line[6:]).get("dgserve") or {}).get("block")
                    if block is not None:
                        now = time.perf_counter()
                        (ttfb.append(now - t0) if first else gaps.append(now - last))
                        first, last = False, now
                        tokens += block["tokens"]
    return tokens


async def _run(front_door: str, address: str, per_client: list) -> tuple[float, int, list, list]:
    client = _grpc_client if front_door == "grpc" else _http_client
    ttfb, gaps = [], []
    t0 = time.perf_counter()
    tokens = await asyncio.gather(*(client(address, reqs, ttfb, gaps) for reqs in per_client))
    return time.perf_counter() - t0, sum(tokens), ttfb, gaps


def _passing(fn):
    """fn() on a thread that ends with it (its OpenMP pool too): ``on_passing_thread``, the server's own helper."""
    from dgserve.engine.cpu_threads import on_passing_thread

    return asyncio.run(on_passing_thread(fn, "bench-direct"))


def _start_server(model: str, max_num_seqs: int):
    from dgserve.service.config import ServiceConfig
    from dgserve.service.server import Server

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cfg = ServiceConfig(
        model=model, host="127.0.0.1", port=0, http_port=0, max_num_seqs=max_num_seqs, max_queue_len=1024
    )

    async def start():
        s = Server(cfg)
        await s.start()
        await s.loaded.wait()
        return s

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(300)
    return server, loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--front-doors", default="grpc,http", help="comma-separated: grpc, http")
    args = ap.parse_args()
    import torch

    from dgserve import Engine
    from dgserve.model.default_model import default_model_path

    model = args.model or default_model_path()
    counts = [int(x) for x in args.clients.split(",")]
    # The direct path first, each piece on a thread that ends with it, then the server: a live thread that ran torch
    # work keeps an OpenMP pool, and a second live pool slows every pool's steps (docs/deployment.md, "CPU threads")
    engine = _passing(lambda: Engine.from_pretrained(model))
    _passing(lambda: _direct(engine, _requests(2, args)))  # warm-up
    plans, direct = {}, {}
    for n in counts:
        reqs = _requests(n * args.requests_per_client, args)
        plans[n] = reqs, [reqs[i::n] for i in range(n)]
        # the direct path runs each client's requests in rounds of n concurrent ones, as the clients do
        rounds = [[pc[r] for pc in plans[n][1]] for r in range(args.requests_per_client)]
        direct[n] = sum(_passing(lambda batch=batch: _direct(engine, batch)) for batch in rounds)
    server, loop = _start_server(model, max(counts))
    addresses = {"grpc": f"127.0.0.1:{server.port}", "http": f"http://127.0.0.1:{server.http_port}"}
    doors = args.front_doors.split(",")
    for door in doors:  # warm-up every door
        asyncio.run(_run(door, addresses[door], [_requests(2, args)]))
    for n in counts:
        reqs, per_client = plans[n]
        for door in doors:
            wall, tokens, ttfb, gaps = asyncio.run(_run(door, addresses[door], per_client))
            blocks = len(ttfb) + len(gaps)
            print(
                json.dumps(
                    {
                        "bench": "service",
                        "front_door": door,
                        "device": "cpu",
                        "cpu": platform.processor() or platform.machine(),
                        "threads": torch.get_num_threads(),
                        "model": pathlib.Path(model).name,
                        "clients": n,
                        "requests": len(reqs),
                        "max_new_tokens": args.max_new_tokens,
                        "steps": args.steps,
                        "ttfb_ms_p50": round(_pct(ttfb, 0.5) * 1e3, 2),
                        "ttfb_ms_p99": round(_pct(ttfb, 0.99) * 1e3, 2),
                        "gap_ms_p50": round(_pct(gaps, 0.5) * 1e3, 2),
                        "gap_ms_p99": round(_pct(gaps, 0.99) * 1e3, 2),
                        "tokens_per_s": round(tokens / wall, 1),
                        "direct_tokens_per_s": round(len(reqs) * args.max_new_tokens / direct[n], 1),
                        "overhead_ms_per_block": round((wall - direct[n]) / blocks * 1e3, 3),
                        "gap_ms_mean": round(statistics.fmean(gaps) * 1e3, 2) if gaps else None,
                    }
                ),
                flush=True,
            )
    asyncio.run_coroutine_threadsafe(server.drain(0), loop).result(60)


if __name__ == "__main__":
    main()
