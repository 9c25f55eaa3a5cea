"""The built-in pages on the HTTP port (service/http/playground.py, docs/playground.md), over HTTP: served from the
package with a same-origin Content-Security-Policy, small, off with --no-playground; the token-pieces route is an
API route like the others (auth, JSON only, same origin, 400 naming ``ids``); the draft route tokenizes a draft
as the engine tokenizes ``initial_canvas`` text (400 naming ``text``); streamed blocks carry the token ids the page
draws. The browser test is test_playground_browser.py."""

from __future__ import annotations

import hashlib
import json
import pathlib

import httpx
import pytest
from service_helpers import auth_config, base_config, running

from dgserve.service.__main__ import build_config
from dgserve.service.http import playground

STATIC = pathlib.Path(playground.__file__).parent / "static"
# the vendored chart library, pinned (static/README.md)
UPLOT_SHA256 = {
    "uPlot.iife.min.js": "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f",
    "uPlot.min.css": "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04",
}
BUDGET_BYTES = 100_000  # every file the pages load, together (they ship with every install)


def test_pages_and_assets_are_served_with_a_self_only_csp(http):
    r = http.get("/", timeout=30)
    assert r.status_code == 307 and r.headers["location"] == "/playground"
    for path in ("/playground", "/dashboard"):
        r = http.get(path, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert "frame-ancestors 'none'" in csp and "unsafe" not in csp
        # every script and style the page loads is one of ours, by a same-origin path (no CDN)
        for ref in _refs(r.text):
            assert ref.startswith("/playground/static/") or ref in ("/playground", "/dashboard", "/metrics", "data:,")
            if ref.startswith("/playground/static/"):
                a = http.get(ref, timeout=30)
                assert a.status_code == 200 and a.content == (STATIC / ref.rsplit("/", 1)[1]).read_bytes()
                assert a.headers["content-security-policy"] == csp
                assert a.headers["x-content-type-options"] == "nosniff"
        assert "<script>" not in r.text and "style=" not in r.text  # nothing inline: the CSP would block it
    for name in ("README.md", "uPlot.LICENSE", "..%2Fplayground.py", "nope.js"):
        assert http.get("/playground/static/" + name, timeout=30).status_code == 404


def _refs(html: str) -> list[str]:
    import re

    return re.findall(r'(?:src|href)="([^"]+)"', html)


def test_the_assets_are_small_and_the_vendored_library_is_pinned():
    served = [*playground.ASSETS, *playground.PAGES.values()]
    sizes = {name: (STATIC / name).stat().st_size for name in served}
    assert sum(sizes.values()) < BUDGET_BYTES, sizes
    for name, digest in UPLOT_SHA256.items():
        assert hashlib.sha256((STATIC / name).read_bytes()).hexdigest() == digest, name
    assert "MIT License" in (STATIC / "uPlot.LICENSE").read_text()
    assert "1.6.32" in (STATIC / "README.md").read_text()


def test_no_playground_flag_and_env():
    assert build_config(["--no-playground"], {})[0].playground is False
    assert build_config([], {"DGSERVE_NO_PLAYGROUND": "1"})[0].playground is False
    assert build_config([], {})[0].playground is True


def test_without_the_playground_its_routes_are_404(model_dir):
    with running(base_config(model_dir, playground=False)) as s:
        for path in ("/", "/playground", "/dashboard", "/playground/static/playground.js"):
            assert httpx.get(s.http_url + path, timeout=30).status_code == 404, path
        assert httpx.get(s.http_url + "/metrics", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def guarded(model_dir, tmp_path_factory):
    """A server of its own behind one token."""
    with running(auth_config(model_dir, tmp_path_factory.mktemp("auth"), ("secret-a",))) as s:
        yield s


def test_pieces_is_an_api_route_behind_auth_and_the_site_guard(guarded):
    base, ok = guarded.http_url, {"Authorization": "Bearer secret-a"}
    # the page itself is public (it holds no data); what it calls is not
    assert httpx.get(base + "/playground", timeout=30).status_code == 200
    r = httpx.post(base + "/playground/pieces", json={"ids": [1, 2]}, timeout=30)
    assert r.status_code == 401
    r = httpx.post(base + "/playground/pieces", json={"ids": [1, 2]}, headers=ok, timeout=30)
    assert r.status_code == 200 and len(r.json()["pieces"]) == 2
    text = httpx.post(base + "/playground/pieces", content=b'{"ids":[1]}', timeout=30, headers=ok)
    assert text.status_code == 415  # (no Content-Type: not JSON)
    foreign = {**ok, "Origin": "http://evil.example"}
    assert httpx.post(base + "/playground/pieces", json={"ids": [1]}, headers=foreign, timeout=30).status_code == 403
    same = {**ok, "Origin": base}
    assert httpx.post(base + "/playground/pieces", json={"ids": [1]}, headers=same, timeout=30).status_code == 200
    for bad in ({"ids": [10**9]}, {"ids": "1"}, {"ids": [True]}, {"ids": [1], "x": 1}, [1], {"ids": [0] * 5000}):
        r = httpx.post(base + "/playground/pieces", json=bad, headers=ok, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("ids"), (bad, r.text)
    # the draft route too: authorized, JSON only, same origin, 400 naming text
    assert httpx.post(base + "/playground/draft", json={"text": "a"}, timeout=30).status_code == 401
    r = httpx.post(base + "/playground/draft", json={"text": "a"}, headers=foreign, timeout=30)
    assert r.status_code == 403
    assert httpx.post(base + "/playground/draft", content=b'{"text":"a"}', headers=ok, timeout=30).status_code == 415
    for bad in ({"text": 1}, {"text": ""}, {"ids": [1]}, {"text": "a", "x": 1}, ["a"], {"text": "word " * 100_000}):
        r = httpx.post(base + "/playground/draft", json=bad, headers=ok, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("text"), (str(bad)[:40], r.text)


def test_draft_is_tokenized_as_the_engine_tokenizes_initial_canvas(http):
    """Special-token texts stay characters and no BOS is added, as for an initial_canvas text (and unlike
    /tokenize with add_special_tokens false, which parses them): a request with the text pinned whole returns
    exactly the ids the page showed."""
    text = "a <bos> b <|turn> c"
    got = http.post("/playground/draft", json={"text": text}, timeout=30).json()
    tokenize = {"prompt": text, "add_special_tokens": False}
    parsed = http.post("/tokenize", json=tokenize, timeout=30).json()["tokens"]
    assert got["ids"] != parsed and len(got["ids"]) > len(parsed)
    assert "".join(got["pieces"]) == text
    body = {"prompt": "Once", "max_tokens": 32, "seed": 3, "max_denoising_steps": 4, "ignore_eos": True}
    ids = _streamed_ids(http, {**body, "initial_canvas": text, "pinned": True})
    assert ids[: len(got["ids"])] == got["ids"]


def test_pieces_are_each_ids_own_text(http):
    ids = [5, 17, 40]
    r = http.post("/playground/pieces", json={"ids": ids}, timeout=30)
    assert r.status_code == 200, r.text
    got = r.json()["pieces"]
    for i, piece in zip(ids, got, strict=True):
        one = http.post("/detokenize", json={"tokens": [i]}, timeout=30).json()["prompt"]
        assert piece == one


def test_streamed_blocks_carry_their_token_ids(http):
    body = {"prompt": "Once", "max_tokens": 40, "seed": 3, "max_denoising_steps": 4}
    blocks = _streamed_blocks(http, body)
    ids = [t for b in blocks for t in b["token_ids"]]
    assert blocks and all(len(b["token_ids"]) == b["tokens"] for b in blocks)
    whole = http.post("/v1/completions", json=body, timeout=60).json()
    assert len(ids) == whole["usage"]["completion_tokens"]
    text = http.post("/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == whole["choices"][0]["text"]


def _streamed_blocks(http, body: dict) -> list[dict]:
    """The ``dgserve.block`` objects of the completion streamed."""
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        raw = r.read().decode()
    return [
        json.loads(line[6:])["dgserve"]["block"]
        for line in raw.split("\n")
        if line.startswith("data: {") and '"block":' in line
    ]


def _streamed_ids(http, body: dict) -> list[int]:
    return [t for b in _streamed_blocks(http, body) for t in b["token_ids"]]


# ---------------------------------------------------------------------------------------------- the 64-bit seed

BIG_SEED = 12345678901234567891  # above 2^53: a JS number would round it to 12345678901234567168


def _node_json(bodies: list[dict]) -> list[str]:
    """common.js's ``dg.json`` of each body, run under node (bodies travel in as JSON: a seed given as a string)."""
    import shutil
    import subprocess

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = (
        "const vm = require('vm'), fs = require('fs');"
        "const dg = vm.runInNewContext(fs.readFileSync(process.argv[1], 'utf8') + ';dg', {});"
        "const out = JSON.parse(fs.readFileSync(0, 'utf8')).map((b) => dg.json(b));"
        "process.stdout.write(JSON.stringify(out));"
    )
    done = subprocess.run(
        [node, "-e", script, str(STATIC / "common.js")],
        input=json.dumps(bodies),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


def test_the_pages_write_a_seed_above_2_53_with_its_exact_digits():
    bodies = [
        {"stream": True, "prompt": "it's", "seed": str(BIG_SEED)},
        {"seed": "18446744073709551615"},  # 2^64 - 1, the largest seed
        {"prompt": "x", "seed": "007"},
        {"prompt": "x", "seed": 11},  # a number (what the seed box's non-digits give) as JSON.stringify writes it
        {"prompt": "x"},
    ]
    texts = _node_json(bodies)
    assert texts[0].endswith(f',"seed":{BIG_SEED}}}') and json.loads(texts[0]) == {**bodies[0], "seed": BIG_SEED}
    assert json.loads(texts[1]) == {"seed": 2**64 - 1} and texts[1] == '{"seed":18446744073709551615}'
    assert json.loads(texts[2])["seed"] == 7 and json.loads(texts[3])["seed"] == 11
    assert json.loads(texts[4]) == {"prompt": "x"}
    # the playground sends, copies and replays through it, and never reads the seed as a JS number
    js = (STATIC / "playground.js").read_text()
    assert "body: dg.json(b)" in js and "dg.json(b).replace" in js and "JSON.stringify(b)" not in js
    assert 'Number(r.headers.get("X-Dgserve-Seed"))' not in js and '"seed"]' not in js
