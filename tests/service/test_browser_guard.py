"""The HTTP door is not reachable from a web page (docs/deployment.md, "Browsers and Host names"): the requests a
hostile page's browser would send — text/plain, form and multipart POSTs, a cross-origin POST, a foreign
preflight, a DNS-rebinding Host — are refused before any work (415 / 403 / 400 in the door's error shape: OpenAI's,
or Anthropic's on the Messages routes), while JSON clients (the official openai client, curl as the README writes
it), same-origin pages, kubelet probes on the pod IP and the origins and Host names an operator allows are
served."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess

import httpx
import pytest
from service_helpers import base_config, running

from dgserve.service.__main__ import build_config
from dgserve.service.config import ServiceConfig
from dgserve.service.http.body import check_content_type
from dgserve.service.http.errors import HttpError
from dgserve.service.http.site import HostPolicy, OriginPolicy, same_origin, split_host

EVIL = "http://evil.example"
SMALL = {"prompt": "hi", "max_tokens": 8, "max_denoising_steps": 2}
POSTS = {
    "/v1/completions": SMALL,
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
JSON = {"content-type": "application/json"}


def assert_error(r: httpx.Response, status: int, code: str, param: str) -> None:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == param and error["message"], error
    assert not any(k.lower().startswith("access-control-") for k in r.headers), dict(r.headers)


# ---------------------------------------------------------------------------------------------- 415


@pytest.mark.parametrize("path", sorted(POSTS))
def test_a_pages_simple_posts_are_415(http, path):
    body = json.dumps(POSTS[path])
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
        r = http.post(path, content=body, headers={"content-type": content_type})
        assert_error(r, 415, "unsupported_media_type", "Content-Type")
    r = http.post(path, files={"f": ("x.json", body, "application/json")})  # multipart/form-data
    assert_error(r, 415, "unsupported_media_type", "Content-Type")
    r = http.post(path, content=body)  # no Content-Type at all
    assert_error(r, 415, "unsupported_media_type", "Content-Type")
    assert "got none" in r.json()["error"]["message"]


def test_json_with_charset_params_is_served(http):
    for content_type in ("application/json", "Application/JSON; charset=utf-8", 'application/json;charset="UTF-8"'):
        r = http.post("/v1/completions", content=json.dumps(SMALL), headers={"content-type": content_type})
        assert r.status_code == 200, (content_type, r.text[:200])
    r = http.post(
        "/v1/completions", content=json.dumps(SMALL), headers={"content-type": "application/json; charset=latin-1"}
    )
    assert_error(r, 415, "unsupported_media_type", "Content-Type")


def test_get_routes_ignore_the_content_type(http):
    for path in ("/v1/models", "/v1/health/live", "/metrics", "/version"):
        assert http.get(path, headers={"content-type": "text/plain"}).status_code == 200, path


def test_the_openai_client_and_the_readme_curl_still_work(server, openai_client):
    r = openai_client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        extra_body={"max_denoising_steps": 2},
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    if shutil.which("curl") is None:
        pytest.skip("curl not found")
    base = f"localhost:{server.server.http_port}"
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": true}'
    out = subprocess.run(
        ["curl", "-sN", f"{base}/v1/chat/completions", "-H", "Content-Type: application/json", "-d", body],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.rstrip().endswith("data: [DONE]"), out[-300:]
    # curl -d without the header sends a form: refused, and the error says why
    out = subprocess.run(
        ["curl", "-s", f"{base}/v1/completions", "-d", json.dumps(SMALL)], capture_output=True, text=True, timeout=60
    )
    assert json.loads(out.stdout)["error"]["code"] == "unsupported_media_type"


# ---------------------------------------------------------------------------------------------- 403


def test_a_cross_origin_post_is_403_before_any_work(http):
    for path in POSTS:
        r = http.post(path, content=b"{not even json", headers={**JSON, "origin": EVIL})  # refused unread
        assert_error(r, 403, "origin_not_allowed", "Origin")
    r = http.post("/v1/completions", json=SMALL, headers={"origin": "null"})  # a sandboxed page, a file
    assert_error(r, 403, "origin_not_allowed", "Origin")
    r = http.post("/v1/completions", json=SMALL, headers={"origin": f"http://localhost:{http.base_url.port}"})
    assert_error(r, 403, "origin_not_allowed", "Origin")  # another site, though the same machine


def test_a_foreign_preflight_gets_no_allow_headers(http):
    r = http.options(
        "/v1/completions",
        headers={
            "origin": EVIL,
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type",
        },
    )
    assert_error(r, 403, "origin_not_allowed", "Origin")


def test_a_same_origin_page_is_served(http):
    r = http.post("/v1/completions", json=SMALL, headers={"origin": str(http.base_url).rstrip("/")})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# ---------------------------------------------------------------------------------------------- the Messages routes

MESSAGES_POSTS = {
    "/v1/messages": {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
}


def assert_anthropic_error(r: httpx.Response, status: int, kind: str, words: str) -> None:
    """Anthropic's error object (docs/messages-api.md, "Errors"), never OpenAI's, and no CORS headers."""
    assert r.status_code == status, r.text[:300]
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert words in body["error"]["message"], body
    assert not any(k.lower().startswith("access-control-") for k in r.headers), dict(r.headers)


@pytest.mark.parametrize("path", sorted(MESSAGES_POSTS))
def test_the_messages_routes_refuse_in_anthropics_shape(http, path):
    body = json.dumps(MESSAGES_POSTS[path])
    r = http.post(path, content=b"{not even json", headers={**JSON, "origin": EVIL})  # refused unread
    assert_anthropic_error(r, 403, "permission_error", "Origin")
    r = http.post(path, content=body, headers={**JSON, "host": "evil.example:8000"})
    assert_anthropic_error(r, 400, "invalid_request_error", "Host")
    assert r.headers["connection"] == "close"
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        r = http.post(path, content=body, headers={"content-type": content_type})
        assert_anthropic_error(r, 415, "invalid_request_error", "Content-Type")
    r = http.post(path, content=body, headers=JSON)  # the same request, as a JSON client sends it, is served
    assert r.status_code == 200, r.text[:300]
    # the other routes keep OpenAI's shape for the same refusals
    assert_error(
        http.post("/v1/completions", json=SMALL, headers={"origin": EVIL}), 403, "origin_not_allowed", "Origin"
    )


# ---------------------------------------------------------------------------------------------- 400 on Host


def test_a_rebinding_host_is_400(http):
    for host in ("evil.example:8000", "evil.example", "localhost.evil.example", "127.0.0.1.evil.example"):
        r = http.post("/v1/completions", json=SMALL, headers={"host": host})
        assert_error(r, 400, "host_not_allowed", "Host")
    assert_error(http.get("/v1/models", headers={"host": "evil.example:8000"}), 400, "host_not_allowed", "Host")


def test_a_request_without_our_host_is_answered_and_closed(server):
    """No Host, or a foreign one: the 400 comes at once and the connection closes (no keep-alive for it)."""
    for head in (b"GET / HTTP/9.9\r\n\r\n", b"GET /v1/models HTTP/1.1\r\nHost: evil.example\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", server.server.http_port), timeout=10) as s:
            s.sendall(head)
            data = b""
            while more := s.recv(65536):  # a connection left open would time out here
                data += more
        assert data.startswith(b"HTTP/1.1 400"), data[:200]


def test_local_names_ip_literals_and_this_machine_are_served(http):
    port = http.base_url.port
    for host in (
        f"localhost:{port}",
        "LOCALHOST.",
        f"127.0.0.1:{port}",
        "[::1]:8000",
        "10.244.3.17:8000",  # a pod IP, as kubelet and the endpoint picker send it
        socket.gethostname(),
        socket.getfqdn(),
    ):
        r = http.post("/v1/completions", json=SMALL, headers={"host": host})
        assert r.status_code == 200, (host, r.text[:200])


def test_kubelet_probes_on_the_pod_ip_pass(http):
    for path in ("/v1/health/live", "/v1/health/ready", "/health", "/metrics"):
        r = http.get(path, headers={"host": "10.244.3.17:8000", "user-agent": "kube-probe/1.31"})
        assert r.status_code == 200, path


# ---------------------------------------------------------------------------------------------- what operators allow


@pytest.fixture(scope="module")
def allowing(model_dir):
    cfg = base_config(
        model_dir,
        allowed_origins=("https://app.example", "http://localhost:3000"),
        allowed_hosts=("dgserve.example", "*.svc.cluster.local"),
        warm_up=False,
    )
    with running(cfg) as s, httpx.Client(base_url=s.http_url, timeout=60) as c:
        yield c


def test_allowed_origins_get_cors(allowing):
    r = allowing.post("/v1/completions", json=SMALL, headers={"origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    pre = allowing.options(
        "/v1/chat/completions",
        headers={
            "origin": "http://localhost:3000",
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "content-type" in pre.headers["access-control-allow-headers"].lower()
    r = allowing.post("/v1/completions", json=SMALL, headers={"origin": EVIL})
    assert_error(r, 403, "origin_not_allowed", "Origin")
    r = allowing.post("/v1/completions", content=json.dumps(SMALL), headers={"origin": "https://app.example"})
    assert r.status_code == 415  # an allowed page still sends JSON


def test_allowed_hosts_add_to_the_defaults(allowing):
    for host in ("dgserve.example:8000", "dgserve.prod.svc.cluster.local:8000", "127.0.0.1", "localhost"):
        assert allowing.post("/v1/completions", json=SMALL, headers={"host": host}).status_code == 200, host
    for host in ("evil.example", "svc.cluster.local", "dgserve.example.evil.example"):
        r = allowing.post("/v1/completions", json=SMALL, headers={"host": host})
        assert_error(r, 400, "host_not_allowed", "Host")


# ---------------------------------------------------------------------------------------------- the rules


def test_host_policy():
    policy = HostPolicy.build(("api.example", "*.corp.example"), ("0.0.0.0", "box", "box.lan"))
    for ok in ("localhost", "api.example:443", "a.corp.example", "b.a.corp.example.", "box", "BOX.LAN:8000"):
        assert policy.allows(ok), ok
    for ip in ("1.2.3.4", "[2001:db8::1]:8000", "[fe80::1%25eth0]", "0.0.0.0:1"):
        assert policy.allows(ip), ip
    for bad in (None, "", "corp.example", "evil.example", "api.example.evil", "[::1", "a:b:c", "x:99999999"):
        assert not policy.allows(bad), bad
    assert HostPolicy.build(("*",), ()).allows("anything.example")


def test_origin_rules():
    assert same_origin("http://localhost:8000", "localhost:8000")
    assert same_origin("https://api.example", "api.example")  # TLS ended at a proxy: Host has no port
    assert same_origin("http://[::1]:8000", "[::1]:8000")
    assert not same_origin("http://localhost:8001", "localhost:8000")
    assert not same_origin("null", "localhost")
    assert not same_origin("http://api.example/x", "api.example")
    assert split_host("[::1]:80") == ("::1", 80) and split_host("Example.COM.") == ("example.com", None)
    policy = OriginPolicy.build(("https://app.example/",))
    assert policy.allows("https://APP.example", "x") and not policy.allows("http://app.example", "x")
    assert OriginPolicy.build(("*",)).allows(EVIL, "x")


def test_content_type_rule():
    for ok in ("application/json", " application/json ; charset=utf-8", "application/json; foo=bar"):
        check_content_type(ok)
    for bad in (
        None,
        "",
        "text/plain",
        "application/jsonx",
        "application/json-patch+json",
        "application/json; charset=utf-16",
    ):
        with pytest.raises(HttpError) as e:
            check_content_type(bad)
        assert e.value.reason == "UNSUPPORTED_MEDIA_TYPE" and e.value.param == "Content-Type"


def test_flags_and_environment():
    cfg, _ = build_config(
        ["--allowed-hosts", "api.example, *.svc.cluster.local"], {"DGSERVE_ALLOWED_ORIGINS": "https://a.example,*"}
    )
    assert cfg.allowed_hosts == ("api.example", "*.svc.cluster.local")
    assert cfg.allowed_origins == ("https://a.example", "*")
    assert ServiceConfig().allowed_hosts == () and ServiceConfig().allowed_origins == ()
    for argv, field in (
        (["--allowed-hosts", "http://x"], "allowed_hosts"),
        (["--allowed-hosts", "a.*"], "allowed_hosts"),
        (["--allowed-origins", "evil.example"], "allowed_origins"),
        (["--allowed-origins", "ftp://x"], "allowed_origins"),
        (["--allowed-origins", "https://a.example/path"], "allowed_origins"),
    ):
        with pytest.raises(ValueError, match=rf"^{field}: .*--{field.replace('_', '-')}"):
            build_config(argv, {})
