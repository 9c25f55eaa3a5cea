"""Prometheus metrics (own registry) and NVML GPU gauges when a GPU is present; served on the HTTP port as
``/metrics`` (also ``/v1/metrics``) by the HTTP front door (service/http/).

Names follow the NIM / vLLM conventions with a ``dgserve_`` prefix; "first token" is the first committed block.
The three gauges an inference gateway's endpoint picker scores replicas on (requests waiting, requests running, KV
cache utilisation) are also served under the vLLM names the picker reads by default (``VLLM_ALIASES``,
docs/deployment.md "Inference gateway"). vLLM's token counters, latency histograms, prefix-cache counters and the
diffusion counters are served under vLLM's names and labels too, from the same events (``vllm_metrics.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dgserve.engine.async_engine import EngineObserver, Finished
from dgserve.engine.prefix_cache import PrefixCacheStats
from dgserve.outputs import BlockOutput

from .vllm_metrics import VllmMetrics

log = logging.getLogger("dgserve.metrics")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STEPS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
_TPF = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)

# The model-server protocol of the Gateway API Inference Extension: the gauges its endpoint picker (llm-d-router's
# EPP) reads when a pod carries no engine-type label, by dgserve gauge. kv_cache_usage_perc is a fraction in [0, 1]
# despite its name; pickers before GAIE v1.3 read gpu_cache_usage_perc instead (docs/deployment.md).
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "dgserve_num_requests_waiting": ("vllm:num_requests_waiting",),
    "dgserve_num_requests_running": ("vllm:num_requests_running",),
    "dgserve_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}


class Metrics(EngineObserver):
    """Every service metric; an EngineObserver for the engine-side ones, ``on_rpc`` for call outcomes."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        p = "dgserve_"
        engine_gauges = {  # read from the engine at scrape time (track_engine)
            p + "num_requests_running": "Requests running (holding a slot)",
            p + "num_requests_waiting": "Requests waiting for a slot",
            p + "kv_cache_usage_perc": "KV cache utilisation, a fraction in [0, 1]: positions held by the running "
            "requests over the positions of every slot",
        }
        self.gauges = {name: [Gauge(name, doc, registry=r)] for name, doc in engine_gauges.items()}
        for ours, names in VLLM_ALIASES.items():
            self.gauges[ours] += [
                Gauge(n, f"{engine_gauges[ours]} ({ours} under vLLM's name)", registry=r) for n in names
            ]
        self.running, self.waiting, self.kv_cache_usage = (self.gauges[n][0] for n in engine_gauges)
        self.max_running = Gauge(p + "num_request_max", "Running slots (max_num_seqs)", registry=r)
        self.queue_time = Histogram(
            p + "request_queue_time_seconds", "Time waiting for a slot", buckets=_LATENCY, registry=r
        )
        self.ttfb = Histogram(
            p + "time_to_first_block_seconds", "Arrival to first committed block", buckets=_LATENCY, registry=r
        )
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens returned", registry=r)
        self.finished = Counter(p + "request_finish", "Finished requests by finish reason", ["reason"], registry=r)
        self.steps_per_block = Histogram(
            p + "denoise_steps_per_block", "Denoising steps per committed block", buckets=_STEPS, registry=r
        )
        self.block_time = Histogram(
            p + "block_seconds",
            "Wall time of a committed block's denoising steps (shared with the batch)",
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens_per_forward = Histogram(
            p + "tokens_per_forward", "Tokens per decoder forward, per block", buckets=_TPF, registry=r
        )
        self.aborted = Counter(p + "request_aborted", "Requests stopped before finishing", ["reason"], registry=r)
        self.drafts_dropped = Counter(p + "drafts_dropped", "Drafts replaced before the reader took them", registry=r)
        self.step_time = Histogram(p + "engine_step_seconds", "Engine iteration time", buckets=_LATENCY, registry=r)
        self.rpcs = Counter(p + "rpc", "Finished RPCs by method and status code", ["method", "code"], registry=r)
        self.connections_rejected = Counter(
            p + "connections_rejected",
            "Connections the server closed or refused: timeout (no complete request in time), evicted (oldest "
            "connection without a request in flight, for a new one over the cap), limit (over the cap, refused)",
            ["door", "reason"],
            registry=r,
        )
        self.connections = ConnectionsCollector()
        # prefix caching (docs/prefix-caching.md): tokens, as vLLM counts them (hit rate = hits / queries)
        self.prefix_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens found in the prefix cache (their KV reused)", registry=r
        )
        self.prefix_cache = PrefixCacheCollector()
        r.register(self.prefix_cache)
        self.vllm = VllmMetrics(r)
        r.register(self.connections)
        r.register(NvmlCollector())
        r.register(NativeOpsCollector())

    def track_engine(
        self,
        num_running: Callable[[], int],
        num_waiting: Callable[[], int],
        max_num_seqs: int,
        kv_cache_usage: Callable[[], float] | None = None,
        prefix_cache: Callable[[], PrefixCacheStats | None] | None = None,
        model_name: str | None = None,
        canvas_length: int = 0,
    ):
        """Read the engine's gauges at scrape time: each callable runs on the scraping thread, so it may read only
        what is safe there (host ints, Engine.kv_cache_usage, Engine.prefix_cache_stats). ``model_name`` (the first
        served name) labels the vLLM-named metrics, which exist from then on; ``canvas_length`` sizes their
        canvas-positions counter."""
        if model_name is not None:
            self.vllm.bind(model_name, canvas_length)
        sources: dict[str, Callable[[], float]] = {
            "dgserve_num_requests_running": num_running,
            "dgserve_num_requests_waiting": num_waiting,
        }
        if kv_cache_usage is not None:
            sources["dgserve_kv_cache_usage_perc"] = kv_cache_usage
        for name, read in sources.items():
            for g in self.gauges[name]:
                g.set_function(read)
        self.max_running.set(max_num_seqs)
        self.prefix_cache.read = prefix_cache

    # EngineObserver
    def on_started(self, queue_seconds: float) -> None:
        self.queue_time.observe(queue_seconds)
        self.vllm.on_started(queue_seconds)

    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries.inc(queried_tokens)
        self.prefix_hits.inc(hit_tokens)
        self.vllm.on_prefix_cache(queried_tokens, hit_tokens)

    def on_block(self, block: BlockOutput, first: bool, seconds_since_arrival: float) -> None:
        if first:
            self.ttfb.observe(seconds_since_arrival)
        self.steps_per_block.observe(block.stats.denoising_steps)
        self.block_time.observe(block.stats.denoise_seconds)
        self.tokens_per_forward.observe(block.stats.tokens_per_forward)
        self.vllm.on_block(block, first, seconds_since_arrival)

    def on_finished(self, f: Finished) -> None:
        self.e2e.observe(f.total_seconds)
        self.prompt_tokens.inc(f.prompt_tokens)
        self.generation_tokens.inc(f.completion_tokens)
        self.finished.labels(f.finish_reason).inc()
        self.vllm.on_finished(f)

    def on_abort(self, reason: str) -> None:
        self.aborted.labels(reason).inc()

    def on_draft_dropped(self) -> None:
        self.drafts_dropped.inc()

    def on_step(self, seconds: float) -> None:
        self.step_time.observe(seconds)

    def on_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpcs.labels(method.rsplit("/", 1)[-1], code).inc()

    def value(self, name: str, labels: dict | None = None) -> float:
        """A sample's current value (tests, debugging); 0 when absent."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else v


class PrefixCacheCollector:
    """The prefix cache's memory (docs/prefix-caching.md), read from the engine at scrape time:
    dgserve_prefix_cache_bytes (held) and dgserve_prefix_cache_capacity_bytes (what the slots leave of the KV cache
    budget), dgserve_prefix_cache_blocks, and the counters dgserve_prefix_cache_evictions_total (blocks evicted
    whole) and dgserve_prefix_cache_sliding_dropped_total (blocks that gave up their sliding layers' part). Nothing
    without prefix caching or before the engine is loaded."""

    def __init__(self) -> None:
        self.read: Callable[[], PrefixCacheStats | None] | None = None

    def collect(self):
        stats = self.read() if self.read is not None else None
        if stats is None:
            return
        p = "dgserve_prefix_cache_"
        for name, doc, value in (
            ("bytes", "Bytes of KV held by the prefix cache", stats.held_bytes),
            (
                "capacity_bytes",
                "Bytes the prefix cache may hold (the KV cache budget the slots leave)",
                stats.capacity_bytes,
            ),
            ("blocks", "Prompt chunks held by the prefix cache", stats.blocks),
        ):
            yield GaugeMetricFamily(p + name, doc, value=value)
        yield CounterMetricFamily(p + "evictions", "Prefix cache blocks evicted whole", value=stats.evicted_blocks)
        yield CounterMetricFamily(
            p + "sliding_dropped",
            "Prefix cache blocks that dropped their sliding layers' keys and values under pressure",
            value=stats.dropped_sliding,
        )


class ConnectionsCollector:
    """dgserve_connections_open{door} and dgserve_connections_max{door}, read at scrape time. HTTP counts what its
    protocol holds; grpc core tells Python nothing about its connections, so the gRPC figure counts the
    established TCP connections whose local port is the gRPC port (/proc/net/tcp, accept backlog included)."""

    def __init__(self) -> None:
        self.http_open: Callable[[], int] | None = None
        self.grpc_port: int | None = None
        self.caps: dict[str, int] = {}

    def track(self, caps: dict[str, int], grpc_port: int | None, http_open: Callable[[], int] | None) -> None:
        self.caps, self.grpc_port, self.http_open = dict(caps), grpc_port, http_open

    def collect(self):
        open_ = GaugeMetricFamily("dgserve_connections_open", "Open client connections", labels=["door"])
        cap = GaugeMetricFamily("dgserve_connections_max", "Connection cap", labels=["door"])
        if self.grpc_port is not None:
            open_.add_metric(["grpc"], established_on_port(self.grpc_port))
        if self.http_open is not None:
            open_.add_metric(["http"], self.http_open())
        for door, n in sorted(self.caps.items()):
            cap.add_metric([door], n)
        yield from (open_, cap)


def established_on_port(port: int) -> int:
    """Established TCP connections (IPv4 and IPv6) whose local port is ``port``; 0 without /proc."""
    n, local = 0, f":{port:04X}"
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split(None, 4)
                    n += cols[1].endswith(local) and cols[3] == "01"  # 01: TCP_ESTABLISHED
        except OSError:
            continue
    return n


class NativeOpsCollector:
    """dgserve_native_op_disabled{op}: 1 for each native op switched off in this process (a failed start-up
    self-check or --native-ops off, dgserve.ops.native_check), read at scrape time."""

    def collect(self):
        from dgserve import ops

        g = GaugeMetricFamily(
            "dgserve_native_op_disabled", "Native op switched off (its torch reference runs)", labels=["op"]
        )
        for op in sorted(ops.switched_off()):
            g.add_metric([op], 1)
        yield g


class NvmlCollector:
    """GPU utilisation and memory per device via nvidia-ml-py; yields nothing when NVML or a GPU is absent."""

    def __init__(self):
        self._nvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._count = pynvml.nvmlDeviceGetCount()
            self._nvml = pynvml
        except Exception as e:  # noqa: BLE001 - no driver, no library, no GPU: all mean "no GPU metrics"
            log.debug("NVML unavailable (%s): no GPU metrics", e)

    def collect(self):
        if self._nvml is None:
            return
        nv = self._nvml
        util = GaugeMetricFamily("dgserve_gpu_utilization_percent", "GPU utilisation", labels=["gpu"])
        used = GaugeMetricFamily("dgserve_gpu_memory_used_bytes", "GPU memory used", labels=["gpu"])
        total = GaugeMetricFamily("dgserve_gpu_memory_total_bytes", "GPU memory total", labels=["gpu"])
        try:
            for i in range(self._count):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                util.add_metric([str(i)], nv.nvmlDeviceGetUtilizationRates(h).gpu)
                used.add_metric([str(i)], mem.used)
                total.add_metric([str(i)], mem.total)
        except Exception as e:  # noqa: BLE001 - a flaky driver must not break /metrics
            log.warning("NVML query failed: %s", e)
            return
        yield from (util, used, total)
