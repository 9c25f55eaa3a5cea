"""vLLM's names for what dgserve measures, served on ``/metrics`` beside the ``dgserve_`` metrics, so that vLLM's own
Grafana dashboards and alerts work on a dgserve pool unchanged (docs/playground.md, "Metrics under vLLM's names").

Names, types, the ``model_name`` / ``engine`` labels and the histogram buckets are vLLM's (its v1 Prometheus
logger): a counter declared as ``vllm:prompt_tokens`` is exposed as ``vllm:prompt_tokens_total``. They are fed by the
same engine events as their ``dgserve_`` twins (``Metrics``), never counted separately. "First token" is the first
committed block. The diffusion counters have no vLLM twin; they count per committed block:

- ``vllm:diffusion_num_denoising_steps``: decoder forwards run (the block's denoising steps);
- ``vllm:diffusion_num_canvas_positions``: canvas positions denoised (canvas length × steps: the work done);
- ``vllm:diffusion_num_committed_tokens``: tokens the block returned (cut by EOS, stop or length).

committed / steps is the tokens per forward; committed / positions the share of the canvas work that was kept.
Samples exist once ``bind`` has named the served model (before the engine loads, only HELP and TYPE lines).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from dgserve.engine.async_engine import Finished
from dgserve.outputs import BlockOutput

LABELS = ("model_name", "engine")
ENGINE = "0"  # one engine per process (vLLM numbers its data-parallel engines)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
)  # fmt: skip

COUNTERS = {  # declared name → help (exposed with _total)
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:diffusion_num_denoising_steps": "Denoising steps (decoder forwards) run for committed blocks.",
    "vllm:diffusion_num_canvas_positions": "Canvas positions denoised for committed blocks (canvas length x steps).",
    "vllm:diffusion_num_committed_tokens": "Tokens committed blocks returned.",
}
HISTOGRAMS = {  # name → (help, buckets)
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": (
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_LATENCY_BUCKETS,
    ),
}


class VllmMetrics:
    """The vLLM-named counters and histograms (module doc). Until ``bind`` they have no labelled child, and the
    ``on_*`` calls do nothing (no request runs before the engine is loaded and bound)."""

    def __init__(self, registry: CollectorRegistry):
        self._counters = {n: Counter(n, h, LABELS, registry=registry) for n, h in COUNTERS.items()}
        self._histograms = {
            n: Histogram(n, h, LABELS, buckets=b, registry=registry) for n, (h, b) in HISTOGRAMS.items()
        }
        self._c: dict = {}
        self._h: dict = {}
        self.canvas_length = 0

    def bind(self, model_name: str, canvas_length: int) -> None:
        """Create the samples for the served model (its first name, as vLLM's ``model_name`` label)."""
        self._c = {n: c.labels(model_name, ENGINE) for n, c in self._counters.items()}
        self._h = {n: h.labels(model_name, ENGINE) for n, h in self._histograms.items()}
        self.canvas_length = canvas_length

    def on_started(self, queue_seconds: float) -> None:
        if self._h:
            self._h["vllm:request_queue_time_seconds"].observe(queue_seconds)

    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        if self._c:
            self._c["vllm:prefix_cache_queries"].inc(queried_tokens)
            self._c["vllm:prefix_cache_hits"].inc(hit_tokens)

    def on_block(self, block: BlockOutput, first: bool, seconds_since_arrival: float) -> None:
        if not self._c:
            return
        steps = block.stats.denoising_steps
        if first:
            self._h["vllm:time_to_first_token_seconds"].observe(seconds_since_arrival)
        self._c["vllm:diffusion_num_denoising_steps"].inc(steps)
        self._c["vllm:diffusion_num_canvas_positions"].inc(steps * self.canvas_length)
        self._c["vllm:diffusion_num_committed_tokens"].inc(len(block.token_ids))

    def on_finished(self, f: Finished) -> None:
        if not self._c:
            return
        self._h["vllm:e2e_request_latency_seconds"].observe(f.total_seconds)
        self._c["vllm:prompt_tokens"].inc(f.prompt_tokens)
        self._c["vllm:generation_tokens"].inc(f.completion_tokens)
