"""Hostile-client load on a real server process: a storm of streams ended at random points, a fuzz of
malformed calls, and huge prompts while a small stream runs. Prints one JSON line per phase with the server's RSS,
threads and open fds before and after.

    python bench/bench_storm.py [--model DIR] [--streams 5000] [--fuzz 10000] [--concurrency 16]
                                [--big-prompts 8] [--big-mb 15]

Phases:
* ``storm``: ``--streams`` streams, ``--concurrency`` at a time, each ended one way (tests/service/storm.py MODES:
  cancel at once / after Started / after a Block / at a random delay, ``break`` out of ``Client.generate``,
  deadline, Abort, or run to the end); then the same seeded request must give the same tokens as before.
* ``fuzz``: ``--fuzz`` malformed calls (random bytes, hostile ids, odd metadata, absurd knobs).
* ``big_prompt``: a 16-token Generate alone (baseline latency), then the same while 4 clients send
  ``--big-prompts`` prompts of ``--big-mb`` MB each (Generate and Tokenize, text and chat; from other processes):
  rejection time per big prompt as the sender sees it (building and sending 15 MB included), the small stream's
  latency under that load, and the server's RSS (and peak RSS) before and after.
* ``http_storm``: ``--http-streams`` streamed chat completions (SSE) over raw sockets, ``--concurrency`` at a time,
  each ended one way (tests/service/storm.py HTTP_MODES: close after sending, after the first event, at a random
  delay, or read to ``[DONE]``).
* ``http_fuzz``: ``--http-fuzz`` malformed HTTP requests (bad JSON, bad fields, odd headers, truncated bodies, not
  HTTP at all); any 5xx is unexpected.
* ``slow_conns``: a small HTTP chat completion and a small gRPC stream alone, then the same while ``--slow``
  connections per port (half silent, half trickling headers) hold both ports, the server run with
  ``--request-timeout`` and ``--max-connections``; the connections the server closed or shed, from /metrics.
Default model: the shipped small one (dgserve.default_model_path()).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "service"))  # the storm driver shared with the test suite


def _emit(**kw) -> None:
    print(json.dumps({"host": platform.node(), **kw}), flush=True)


def _peak_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def run_storm(srv, stub, args) -> None:
    import storm

    tokens = storm.seeded_tokens(stub)
    storm.storm(stub, srv.target, 100, args.concurrency, seed=1)  # warm-up
    before, t0 = srv.stats(), time.perf_counter()
    codes = storm.storm(stub, srv.target, args.streams, args.concurrency, seed=2)
    wall = time.perf_counter() - t0
    alive = srv.alive
    same = alive and storm.seeded_tokens(stub) == tokens
    by_code: dict[str, int] = {}
    for (_, code), n in codes.items():
        by_code[code] = by_code.get(code, 0) + n
    _emit(
        phase="storm",
        streams=args.streams,
        concurrency=args.concurrency,
        seconds=round(wall, 1),
        alive=alive,
        same_seeded_tokens=same,
        codes=by_code,
        unexpected={f"{m}:{c}": n for (m, c), n in codes.items() if c not in storm.STREAM_CODES},
        before=before,
        after=srv.stats() if alive else None,
    )


def run_fuzz(srv, channel, args) -> None:
    import storm

    before, t0 = srv.stats(), time.perf_counter()
    codes = storm.fuzz(channel, args.fuzz, concurrency=8, seed=5)
    wall = time.perf_counter() - t0
    _emit(
        phase="fuzz",
        calls=args.fuzz,
        seconds=round(wall, 1),
        alive=srv.alive,
        codes=dict(codes),
        unexpected={c: n for c, n in codes.items() if c not in storm.FUZZ_CODES},
        before=before,
        after=srv.stats() if srv.alive else None,
    )


def _small_latency(stub, pb) -> float:
    t0 = time.perf_counter()
    list(
        stub.Generate(
            pb.GenerateRequest(prompt="Once upon a time", params=pb.SamplingParams(max_new_tokens=16, seed=3)),
            timeout=120,
        )
    )
    return time.perf_counter() - t0


def _big_call(target: str, kind: str, mb: int) -> tuple[float, str]:
    """One huge prompt (its own process: the client's serialising must not slow the small stream's reader)."""
    import grpc

    from dgserve.v1 import text_generation_pb2 as pb
    from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

    text = ("The quick brown fox jumps over the lazy dog. " * (mb * 30_000))[: mb * 1_000_000]
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=text)])
    with grpc.insecure_channel(target, [("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        t0 = time.perf_counter()
        try:
            if kind == "tokenize":
                stub.Tokenize(pb.TokenizeRequest(prompt=text), timeout=120)
            elif kind == "chat":
                list(stub.Generate(pb.GenerateRequest(chat=chat), timeout=120))
            else:
                list(stub.Generate(pb.GenerateRequest(prompt=text), timeout=120))
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        return time.perf_counter() - t0, code


def run_big_prompt(srv, stub, args) -> None:
    from concurrent.futures import ProcessPoolExecutor

    from dgserve.v1 import text_generation_pb2 as pb

    for _ in range(2):
        _small_latency(stub, pb)  # warm-up
    baseline = [_small_latency(stub, pb) for _ in range(5)]
    before, peak0 = srv.stats(), _peak_mb(srv.proc.pid)
    kinds = [("generate", "tokenize", "chat")[i % 3] for i in range(args.big_prompts)]
    under, done = [], threading.Event()

    def small_loop():
        while not done.is_set():
            under.append(_small_latency(stub, pb))

    with ProcessPoolExecutor(4) as pool:
        list(pool.map(time.sleep, [0.1] * 4))  # the workers are up before timing
        loop = threading.Thread(target=small_loop)
        loop.start()
        big = list(pool.map(_big_call, [srv.target] * len(kinds), kinds, [args.big_mb] * len(kinds)))
    while len(under) < 3:
        time.sleep(0.05)
    done.set()
    loop.join()
    after = srv.stats()
    _emit(
        phase="big_prompt",
        prompt_mb=args.big_mb,
        prompts=len(big),
        codes=sorted({c for _, c in big}),
        reject_seconds_max=round(max(t for t, _ in big), 3),
        reject_seconds_median=round(statistics.median(t for t, _ in big), 3),
        small_stream_seconds_alone=round(statistics.median(baseline), 3),
        small_stream_seconds_under_load=round(statistics.median(under), 3),
        small_stream_seconds_under_load_max=round(max(under), 3),
        small_streams_under_load=len(under),
        rss_mb_before=before["rss_mb"],
        rss_mb_after=after["rss_mb"],
        peak_rss_mb_before=peak0,
        peak_rss_mb_after=_peak_mb(srv.proc.pid),
        alive=srv.alive,
    )


def _stats_delta(srv, before: dict) -> dict:
    return {"before": before, "after": srv.stats() if srv.alive else None, "alive": srv.alive}


def run_http_storm(srv, args) -> None:
    import storm

    before, t0 = srv.stats(), time.perf_counter()
    codes = storm.sse_storm(srv.http_port, args.http_streams, args.concurrency, seed=3)
    by_status: dict[str, int] = {}
    for (_, status), n in codes.items():
        by_status[status] = by_status.get(status, 0) + n
    unexpected = {f"{m}:{c}": n for (m, c), n in codes.items() if c not in ("200", "sent", "closed", "reset")}
    _emit(
        phase="http_storm",
        streams=args.http_streams,
        seconds=round(time.perf_counter() - t0, 1),
        statuses=by_status,
        unexpected=unexpected,
        **_stats_delta(srv, before),
    )


def run_http_fuzz(srv, args) -> None:
    import storm

    before, t0 = srv.stats(), time.perf_counter()
    codes = storm.http_fuzz(srv.http_port, args.http_fuzz, seed=4)
    unexpected = {c: n for c, n in codes.items() if c.startswith("5") or c == "garbled"}
    _emit(
        phase="http_fuzz",
        requests=args.http_fuzz,
        seconds=round(time.perf_counter() - t0, 1),
        statuses=dict(codes),
        unexpected=unexpected,
        **_stats_delta(srv, before),
    )


def _http_small_latency(port: int) -> float:
    import storm

    t0 = time.perf_counter()
    with storm._http_send(port, storm.chat_request(0, stream=False, max_tokens=8)) as s:
        data = b""
        while more := s.recv(65536):
            data += more
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    return time.perf_counter() - t0


def _rejected(port: int) -> dict:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("dgserve_connections_rejected_total{", "dgserve_connections_open{")):
            name, value = line.rsplit(" ", 1)
            out[name.replace("dgserve_connections_", "")] = float(value)
    return out


def run_slow_conns(srv, stub, args) -> None:
    import storm

    from dgserve.v1 import text_generation_pb2 as pb

    alone_http = [_http_small_latency(srv.http_port) for _ in range(5)]
    alone_grpc = [_small_latency(stub, pb) for _ in range(3)]
    before = srv.stats()
    socks = storm.slow_connections((srv.http_port, srv.port), args.slow)
    done = threading.Event()

    def keep_trickling():
        while not done.wait(0.2):
            storm.trickle(socks)

    t = threading.Thread(target=keep_trickling)
    t.start()
    try:
        during = srv.stats()
        under_http = [_http_small_latency(srv.http_port) for _ in range(5)]
        under_grpc = [_small_latency(stub, pb) for _ in range(3)]
    finally:
        done.set()
        t.join()
    time.sleep(args.request_timeout + 0.5)  # the rest time out
    for s in socks:
        s.close()
    _emit(
        phase="slow_conns",
        per_port=args.slow,
        request_timeout=args.request_timeout,
        max_connections=args.max_connections,
        http_small_seconds_alone=round(statistics.median(alone_http), 3),
        http_small_seconds_under_load=round(statistics.median(under_http), 3),
        http_small_seconds_under_load_max=round(max(under_http), 3),
        grpc_small_seconds_alone=round(statistics.median(alone_grpc), 3),
        grpc_small_seconds_under_load=round(statistics.median(under_grpc), 3),
        stats_during=during,
        connections=_rejected(srv.http_port),
        log_lines=len(srv.lines),
        **_stats_delta(srv, before),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, default=5000)
    p.add_argument("--fuzz", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--big-prompts", type=int, default=8)
    p.add_argument("--big-mb", type=int, default=15)
    p.add_argument("--http-streams", type=int, default=2000)
    p.add_argument("--http-fuzz", type=int, default=2000)
    p.add_argument("--slow", type=int, default=400, help="slow connections per port in slow_conns")
    p.add_argument("--request-timeout", type=float, default=2.0)
    p.add_argument("--max-connections", type=int, default=256)
    p.add_argument("--phases", default="storm,fuzz,big_prompt,http_storm,http_fuzz,slow_conns")
    args = p.parse_args()

    import grpc
    import storm

    from dgserve.model.default_model import default_model_path

    model = args.model or default_model_path()
    srv = storm.ServerProcess(
        model,
        *("--max-num-seqs", "8", "--max-queue-len", "64", "--log-level", "INFO"),
        *("--request-timeout", str(args.request_timeout), "--max-connections", str(args.max_connections)),
    )
    try:
        with grpc.insecure_channel(srv.target, [("grpc.max_send_message_length", 64 << 20)]) as ch:
            stub = storm.stub_for(ch)
            _emit(phase="start", model=model, stats=srv.stats())
            for phase in args.phases.split(","):
                {
                    "storm": lambda: run_storm(srv, stub, args),
                    "fuzz": lambda: run_fuzz(srv, ch, args),
                    "big_prompt": lambda: run_big_prompt(srv, stub, args),
                    "http_storm": lambda: run_http_storm(srv, args),
                    "http_fuzz": lambda: run_http_fuzz(srv, args),
                    "slow_conns": lambda: run_slow_conns(srv, stub, args),
                }[phase]()
                if not srv.alive:
                    _emit(phase="died", exit_code=srv.proc.returncode, log_tail=srv.lines[-20:])
                    return 1
    finally:
        srv.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
