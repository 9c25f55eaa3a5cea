"""The server in a container-sized memory cgroup (docs/deployment.md, "Memory"): a real `dgserve` process on the
shipped small model, in a child of this process's memory cgroup with a limit, takes a hundred and more distinct prompts
near its context (run with --max-model-len 2048: four slots of the model's own 65,536 positions, 99 MiB each in
fp32, would not fit the limit's budget, and prompts that long would take minutes). Its KV cache budget says the
cgroup bounded it, the prefix cache fills and evicts, the resident set levels off under the limit, and nothing is
killed.

Needs a memory cgroup this process may create children in (root, v1 `memory.limit_in_bytes` or v2 `memory.max`);
skipped with the reason otherwise. The figures are printed (run with -s to see them)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import storm
from service_helpers import child_cgroup, scrape_metrics

from dgserve.model.default_model import SHIPPED
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

MIB = 1 << 20
LIMIT = 640 * MIB
PROMPTS = 120
CONTEXT, CANVAS = 2048, 16
# ordinary text ids of the shipped model: not the control tokens (0-4) nor its image ids (190-192), which a raw prompt
# may not hold
TEXT_IDS = [t for t in range(5, 2000) if t not in (190, 191, 192)]
CLIENTS = 4


def limited_cgroup(limit: int):
    """A new child of this process's memory cgroup with ``limit`` bytes (``child_cgroup``)."""

    def set_limit(d: Path, version: int) -> None:
        (d / ("memory.max" if version == 2 else "memory.limit_in_bytes")).write_text(str(limit))

    return child_cgroup("memory", set_limit)


def oom_kills(d: Path, version: int) -> int:
    name = "memory.events" if version == 2 else "memory.oom_control"
    for line in (d / name).read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def peak_usage(d: Path, version: int) -> int | None:
    f = d / ("memory.peak" if version == 2 else "memory.max_usage_in_bytes")
    return int(f.read_text()) if f.is_file() else None


def anon_mib(pid: int) -> float:
    """The process's anonymous resident memory (RssAnon), MiB: what it allocated, without the file pages of its
    libraries and weights that other cgroups may have been charged for."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


@pytest.mark.slow
def test_long_prompts_in_a_memory_limited_cgroup():
    if not (SHIPPED / "config.json").is_file():
        pytest.skip("no shipped model in this checkout")
    with limited_cgroup(LIMIT) as (cg, version):
        srv = storm.ServerProcess(
            SHIPPED, "--max-num-seqs", str(CLIENTS), "--max-model-len", str(CONTEXT), cgroup=str(cg)
        )
        try:
            (budget,) = [line for line in srv.lines if "kv cache budget" in line]
            assert "bounded by the cgroup" in budget and str(cg) in budget, budget
            stub = pb_grpc.TextGenerationStub(grpc.insecure_channel(srv.target))
            prompt_len = CONTEXT - CANVAS
            rss: list[float] = []

            def one(i: int) -> str:
                rng = random.Random(i)
                ids = [rng.choice(TEXT_IDS) for _ in range(prompt_len)]  # distinct prompts: no reuse
                p = pb.SamplingParams(max_new_tokens=CANVAS, max_denoising_steps=1, seed=i)
                events = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), params=p)))
                rss.append(anon_mib(srv.proc.pid))
                return events[-1].finished.finish_reason

            t0 = time.monotonic()
            with ThreadPoolExecutor(CLIENTS) as pool:
                reasons = list(pool.map(one, range(PROMPTS)))
            seconds = time.monotonic() - t0
            m = {s.name: s.value for s in scrape_metrics(srv.http_port) if s.name.startswith("dgserve_prefix_cache")}
            peak = peak_usage(cg, version)
            print(
                f"\nlimit {LIMIT // MIB} MiB; {budget.split('INFO dgserve [] ')[-1].strip()}\n"
                f"{PROMPTS} prompts of {prompt_len} tokens in {seconds:.1f} s; anonymous RSS first {rss[0]:.0f} MB, "
                f"max {max(rss):.0f} MB, last quarter {min(rss[-PROMPTS // 4 :]):.0f}..{max(rss[-PROMPTS // 4 :]):.0f}"
                f" MB; cgroup peak {peak and peak // MIB} MiB; prefix cache {m['dgserve_prefix_cache_bytes'] / MIB:.0f}"
                f" of {m['dgserve_prefix_cache_capacity_bytes'] / MIB:.0f} MiB, "
                f"{m['dgserve_prefix_cache_blocks']:.0f} blocks, {m['dgserve_prefix_cache_evictions_total']:.0f} "
                f"evicted, {m['dgserve_prefix_cache_sliding_dropped_total']:.0f} stripped"
            )
            assert srv.alive and oom_kills(cg, version) == 0
            assert set(reasons) <= {pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS}, reasons
            assert m["dgserve_prefix_cache_evictions_total"] > 0  # the cache filled and gave way
            assert m["dgserve_prefix_cache_bytes"] <= m["dgserve_prefix_cache_capacity_bytes"]
            # the resident set levels off under the limit: the last half grows no further than the first reached
            half = PROMPTS // 2
            assert max(rss) * MIB < LIMIT
            print(f"RSS (all pages) at the end {srv.stats()['rss_mb']:.0f} MiB")
            assert max(rss[half:]) <= max(rss[:half]) + 32, (max(rss[:half]), max(rss[half:]))
        finally:
            srv.kill()
