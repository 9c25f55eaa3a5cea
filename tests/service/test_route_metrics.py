"""/metrics counts each HTTP route under its own ``route`` label (its path template), whatever the answer: the
agent doors, count_tokens, the token routes and the pages alike; a path no route has is ``other``, so the labels
stay a bounded set whatever paths clients send."""

from __future__ import annotations

import pytest
from service_helpers import metric_value, scrape_metrics

COUNTER = "dgserve_http_requests_total"
HI = [{"role": "user", "content": "hi"}]

# (method, path, JSON body or None, the route label it is counted under)
CALLS = [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4}, "/v1/completions"),
    ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 4}, "/v1/chat/completions"),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 4, "store": False}, "/v1/responses"),
    ("GET", "/v1/responses/resp_nope", None, "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/resp_nope", None, "/v1/responses/{response_id}"),
    ("POST", "/v1/messages", {"messages": HI, "max_tokens": 4}, "/v1/messages"),
    ("POST", "/v1/messages/count_tokens", {"messages": HI}, "/v1/messages/count_tokens"),
    ("POST", "/tokenize", {"prompt": "hi"}, "/tokenize"),
    ("POST", "/detokenize", {"tokens": [1, 2]}, "/detokenize"),
    ("GET", "/v1/models", None, "/v1/models"),
    ("GET", "/v1/models/tiny", None, "/v1/models/{model_id}"),
    ("GET", "/version", None, "/version"),
    ("GET", "/health", None, "/health"),
    ("GET", "/v1/health/ready", None, "/v1/health/ready"),
    ("GET", "/", None, "/"),
    ("GET", "/playground", None, "/playground"),
    ("GET", "/dashboard", None, "/dashboard"),
    ("POST", "/playground/pieces", {"text": "hi"}, "/playground/pieces"),
    ("GET", "/v1/messages", None, "/v1/messages"),  # a method the route lacks (405): still its route
    ("GET", "/no/such/route", None, "other"),
]


def _counts(port: int, label: str) -> dict[str, float]:
    """The counter's samples of one route label, by status."""
    return {
        s.labels["status"]: s.value
        for s in scrape_metrics(port)
        if s.name == COUNTER and s.labels.get("route") == label
    }


@pytest.mark.parametrize("method, path, body, label", CALLS, ids=[f"{c[0]} {c[1]}" for c in CALLS])
def test_each_route_is_counted_under_its_own_label(server, http, method, path, body, label):
    port = server.server.http_port
    before = _counts(port, label)
    r = http.request(method, path, json=body)
    status = str(r.status_code)
    after = _counts(port, label)
    assert after.get(status, 0) == before.get(status, 0) + 1, (label, status, before, after)
    if label != "other":
        assert metric_value(scrape_metrics(port), COUNTER, route=label, status=status) >= 1


def test_a_refusal_before_routing_is_counted_under_the_route_asked_for(server, http):
    """A bad X-Request-Id is refused before the router runs: counted under the route its path names."""
    port = server.server.http_port
    before = _counts(port, "/v1/messages/count_tokens").get("400", 0)
    r = http.post("/v1/messages/count_tokens", json={"messages": HI}, headers={"x-request-id": "bad\x7fid"})
    assert r.status_code == 400
    assert _counts(port, "/v1/messages/count_tokens").get("400", 0) == before + 1


def test_unknown_paths_share_one_label(server, http):
    port = server.server.http_port
    labels_before = {s.labels["route"] for s in scrape_metrics(port) if s.name == COUNTER}
    for i in range(5):
        http.get(f"/unknown-{i}")
    labels_after = {s.labels["route"] for s in scrape_metrics(port) if s.name == COUNTER}
    assert labels_after - labels_before <= {"other"}
