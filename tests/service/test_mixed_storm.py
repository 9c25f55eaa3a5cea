"""A mixed storm over every door with images and several callers (docs/images.md; docs/architecture.md, "Fair
shares between callers"): valid images, decompression bombs, corrupt bytes, remote images from a host that answers
late, ``n`` > 1 choices, streams walked away from, from three callers with their own tokens, all at once. Every
answer is one a client may legitimately get (200, 400, 413, 429: never a 5xx), nothing is logged at ERROR or with
a traceback, the gauges return to 0 and a seeded request gives the same text before and after."""

from __future__ import annotations

import http.server
import logging
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from service_helpers import auth_config, running
from test_image_doors import _bomb_png, _data_url, _png
from tiny_models import write_vision_chat_checkpoint

from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

TOKENS = ("caller-a", "caller-b", "caller-c")
LEGITIMATE = {200, 400, 413, 429}
SLOW_S = 2.0  # the slow image host's delay; the server's fetch timeout is shorter, so some time out (400)
IMG = _png(48, 40, seed=2)


class _Slow(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(SLOW_S if "late" in self.path else 0.2)
        self.send_response(200)
        self.send_header("content-type", "image/png")
        self.send_header("content-length", str(len(IMG)))
        self.end_headers()
        self.wfile.write(IMG)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def storm_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("vis-storm")
    write_vision_chat_checkpoint(path)
    cfg = auth_config(
        path,
        tmp_path_factory.mktemp("tokens"),
        TOKENS,
        max_num_seqs=4,
        max_queue_len=8,
        allowed_media_domains=("127.0.0.1",),
        media_fetch_timeout=1.0,
        max_images_per_request=8,
    )
    with running(cfg) as s:
        yield s


def _image_part(kind: str, host: str) -> dict:
    url = {
        "ok": _data_url(IMG),
        "bomb": _data_url(_bomb_png(6000, 6000)),
        "corrupt": _data_url(IMG[: len(IMG) // 2]),
        "remote": f"{host}/fast.png",
        "late": f"{host}/late.png",
    }[kind]
    return {"type": "image_url", "image_url": {"url": url}}


def _one(base: str, stub, job: tuple) -> str:
    """One request of the storm; its HTTP status (gRPC codes map to their HTTP kin) or "walked away"."""
    kind, token, seed, host = job
    auth = {"authorization": f"Bearer {token}"}
    rng = random.Random(seed)
    if kind == "grpc":
        req = pb.GenerateRequest(
            prompt=f"storm {seed}", params=pb.SamplingParams(max_new_tokens=8, max_denoising_steps=2, seed=seed)
        )
        try:
            for _ in stub.Generate(req, metadata=tuple(auth.items()), timeout=60):
                pass
            return "200"
        except grpc.RpcError as e:
            return {grpc.StatusCode.RESOURCE_EXHAUSTED: "429", grpc.StatusCode.INVALID_ARGUMENT: "400"}.get(
                e.code(), e.code().name
            )
    images = {
        "chat": [],
        "image": ["ok"],
        "bombs": ["bomb"] * 8,
        "corrupt": ["corrupt"],
        "remote": ["remote"],
        "late": ["late"],
        "mixed": ["ok", "remote", "bomb"],
        "n": [],
        "walk": ["ok"],
    }[kind]
    body = {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": f"look {seed}"}, *(_image_part(k, host) for k in images)],
            }
        ],
        "max_tokens": 8,
        "max_denoising_steps": 2,
        "seed": seed,
        "n": 3 if kind == "n" else 1,
        "stream": kind == "walk",
    }
    if kind == "walk":  # a stream read for a moment, then dropped
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
            for _ in r.iter_lines():
                if rng.random() < 0.5:
                    break
            return "walked away" if r.status_code == 200 else str(r.status_code)
    return str(httpx.post(base + "/v1/chat/completions", json=body, headers=auth, timeout=60).status_code)


def test_mixed_storm_with_images_and_callers(storm_server, image_host, caplog):
    s = storm_server
    base = s.http_url
    auth = {"authorization": f"Bearer {TOKENS[0]}"}
    seeded = {"model": "tiny", "messages": [{"role": "user", "content": "same"}], "max_tokens": 8, "seed": 5}
    before = httpx.post(base + "/v1/chat/completions", json=seeded, headers=auth, timeout=60).json()
    kinds = ("chat", "image", "bombs", "corrupt", "remote", "late", "mixed", "n", "walk", "grpc")
    rng = random.Random(0)
    jobs = [(rng.choice(kinds), rng.choice(TOKENS), i, image_host) for i in range(90)]
    caplog.set_level(logging.WARNING)
    with grpc.insecure_channel(s.target) as ch, ThreadPoolExecutor(12) as pool:
        stub = pb_grpc.TextGenerationStub(ch)
        seen = Counter(pool.map(lambda job: (job[0], _one(base, stub, job)), jobs))
    statuses = {st for _, st in seen}
    assert statuses <= {str(c) for c in LEGITIMATE} | {"walked away"}, seen
    assert ("chat", "200") in seen and ("bombs", "400") in seen, seen
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]
    deadline = time.monotonic() + 30
    while (s.engine.num_running or s.engine.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.engine.num_running == 0 and s.engine.num_waiting == 0
    after = httpx.post(base + "/v1/chat/completions", json=seeded, headers=auth, timeout=60).json()
    assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
    assert httpx.get(base + "/v1/health/ready", timeout=10).status_code == 200
