"""vLLM's metric names beside ours (service/vllm_metrics.py) and the Grafana dashboard over them
(deploy/grafana/dgserve-dashboard.json): after a request on a real server, each vLLM-named counter and histogram
moved by what the request did, labelled with the served model's name; every metric the dashboard's queries name is
one the server exports."""

from __future__ import annotations

import json
import pathlib
import re

from prometheus_client.parser import text_string_to_metric_families
from service_helpers import ROOT

from dgserve.service.vllm_metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

DASHBOARD = pathlib.Path(ROOT) / "deploy" / "grafana" / "dgserve-dashboard.json"
LABELS = {"model_name": "tiny", "engine": "0"}  # the first served name (service_helpers.base_config)


def scrape(http) -> tuple[dict[tuple[str, tuple], float], set[str], set[str]]:
    """(value by (sample name, labels), sample names, family names) of the server's /metrics."""
    text = http.get("/metrics", timeout=30).text
    values, samples, families = {}, set(), set()
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        for s in fam.samples:
            samples.add(s.name)
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values, samples, families


def get(values, name: str, **extra) -> float:
    return values.get((name, tuple(sorted({**LABELS, **extra}.items()))), 0.0)


def test_vllm_names_move_after_a_request(server, http):
    before, _, _ = scrape(http)
    body = {"prompt": "The sea", "max_tokens": 24, "seed": 5, "max_denoising_steps": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body, timeout=60) as r:
        raw = r.read().decode()
    chunks = [json.loads(x[6:]) for x in raw.split("\n") if x.startswith("data: {")]
    blocks = [c["dgserve"]["block"] for c in chunks if "block" in c.get("dgserve", {})]
    usage = next(c for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"])
    after, _, _ = scrape(http)

    def moved(name):
        return get(after, name) - get(before, name)

    steps = sum(b["denoising_steps"] for b in blocks)
    tokens = sum(b["tokens"] for b in blocks)
    assert steps > 0 and tokens > 0
    assert moved("vllm:generation_tokens_total") == tokens
    assert moved("vllm:prompt_tokens_total") > 0
    assert moved("vllm:diffusion_num_denoising_steps_total") == steps
    assert moved("vllm:diffusion_num_committed_tokens_total") == tokens
    canvas = server.engine.engine.model.config.canvas_length
    assert moved("vllm:diffusion_num_canvas_positions_total") == steps * canvas
    assert moved("vllm:prefix_cache_queries_total") > 0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert moved(name + "_count") == 1, name
    assert moved("vllm:request_queue_time_seconds_count") == 1
    assert usage["dgserve"]["seed"] == 5
    # vLLM's bucket conventions
    assert get(after, "vllm:time_to_first_token_seconds_bucket", le=str(TTFT_BUCKETS[-1])) >= 1
    last = str(REQUEST_LATENCY_BUCKETS[-1])
    assert ("vllm:e2e_request_latency_seconds_bucket", tuple(sorted({**LABELS, "le": last}.items()))) in after


def dashboard_metrics() -> set[str]:
    """Every metric name in the dashboard's queries (panels' expressions and template variables)."""
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in doc["templating"]["list"] if v["type"] == "query"]
    names = set()
    for e in exprs:
        names |= set(re.findall(r"\b(?:dgserve_|vllm:)[A-Za-z0-9_:]*", e))
    return names


def test_grafana_dashboard_queries_only_exported_metrics(http):
    http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
    _, samples, families = scrape(http)
    named = dashboard_metrics()
    assert len(named) >= 15 and any(n.startswith("vllm:diffusion_") for n in named)
    # a histogram's _bucket / _sum / _count and a counter's _total are sample names
    missing = sorted(n for n in named if n not in samples and n not in families)
    assert not missing, f"the dashboard queries metrics the server does not export: {missing}"
