"""Prometheus metrics (own registry), NVML GPU gauges when a GPU is present, and the HTTP side port:
``/metrics`` (also ``/v1/metrics``), ``/v1/health/live`` and ``/v1/health/ready`` (NIM-style probes: 200/503).

Names follow the NIM / vLLM conventions with a ``dgserve_`` prefix; "first token" is the first committed block.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dgserve.async_engine import EngineObserver, Finished
from dgserve.outputs import BlockOutput

log = logging.getLogger("dgserve.metrics")
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_STEPS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
_TPF = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics(EngineObserver):
    """Every service metric; an EngineObserver for the engine-side ones, ``on_rpc`` for call outcomes."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        p = "dgserve_"
        self.running = Gauge(p + "num_requests_running", "Requests running (holding a slot)", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting for a slot", registry=r)
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
        self.tokens_per_forward = Histogram(
            p + "tokens_per_forward", "Tokens per decoder forward, per block", buckets=_TPF, registry=r
        )
        self.aborted = Counter(p + "request_aborted", "Requests stopped before finishing", ["reason"], registry=r)
        self.drafts_dropped = Counter(p + "drafts_dropped", "Drafts replaced before the reader took them", registry=r)
        self.step_time = Histogram(p + "engine_step_seconds", "Engine iteration time", buckets=_LATENCY, registry=r)
        self.rpcs = Counter(p + "rpc", "Finished RPCs by method and status code", ["method", "code"], registry=r)
        r.register(NvmlCollector())

    def track_engine(self, num_running: Callable[[], int], num_waiting: Callable[[], int], max_num_seqs: int):
        self.running.set_function(num_running)
        self.waiting.set_function(num_waiting)
        self.max_running.set(max_num_seqs)

    # EngineObserver
    def on_started(self, queue_seconds: float) -> None:
        self.queue_time.observe(queue_seconds)

    def on_block(self, block: BlockOutput, first: bool, seconds_since_arrival: float) -> None:
        if first:
            self.ttfb.observe(seconds_since_arrival)
        self.steps_per_block.observe(block.stats.denoising_steps)
        self.tokens_per_forward.observe(block.stats.tokens_per_forward)

    def on_finished(self, f: Finished) -> None:
        self.e2e.observe(f.total_seconds)
        self.prompt_tokens.inc(f.prompt_tokens)
        self.generation_tokens.inc(f.completion_tokens)
        self.finished.labels(f.finish_reason).inc()

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


class HttpSidecar:
    """``/metrics``, ``/v1/metrics``, ``/v1/health/live``, ``/v1/health/ready`` on a thread (port 0: ephemeral)."""

    def __init__(self, host: str, port: int, metrics: Metrics, live: Callable[[], bool], ready: Callable[[], bool]):
        routes = {
            "/metrics": self._metrics,
            "/v1/metrics": self._metrics,
            "/v1/health/live": lambda: self._health(live(), "live"),
            "/v1/health/ready": lambda: self._health(ready(), "ready"),
        }
        self.metrics = metrics

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # the http.server API's name
                route = routes.get(self.path.split("?")[0])
                status, ctype, body = route() if route else (404, "text/plain", b"not found\n")
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # keep probes out of the logs
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="dgserve-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _metrics(self):
        return 200, CONTENT_TYPE_LATEST, generate_latest(self.metrics.registry)

    @staticmethod
    def _health(ok: bool, what: str):
        body = {
            "object": "health.response",
            "status": what if ok else f"not {what}",
            "message": f"service is {what}" if ok else f"service is not {what}",
        }
        return (200 if ok else 503), "application/json", json.dumps(body).encode()
