"""Images through every door (docs/images.md, "Doors"): OpenAI chat image_url, Responses input_image, Messages
image blocks and gRPC image parts on a tiny random checkpoint with a working vision tower give the engine's tokens
for the same ChatPrompt; caps, bad images and remote URLs are 400s naming the part."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import grpc
import httpx
import pytest
from service_helpers import base_config, params, running
from tiny_models import write_vision_chat_checkpoint

from dgserve import Engine, SamplingParams
from dgserve.engine.prompt import ChatPrompt
from dgserve.media.images import ImageCaps, load_image, preprocess
from dgserve.v1 import text_generation_pb2 as pb
from dgserve.v1 import text_generation_pb2_grpc as pb_grpc

SEED, TOKENS = 11, 16
FETCH_TIMEOUT = 1.5  # the test server's --media-fetch-timeout
SITE_ANSWERED = {"/stall": 0, "/trickle": 0}  # media_site's whole slow answers sent, by path


def _png(w: int, h: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def _bomb_png(w: int, h: int) -> bytes:
    """A PNG whose header declares w x h pixels, with a few bytes of data (it would take w·h·3 bytes decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


IMG = _png(100, 70)


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory):
    """The "vis" tiny checkpoint (image ids 296..298 inside its 300-token vocabulary) with a BPE tokenizer of 296
    tokens: as in the real model, no text encodes to an image id (a continued conversation's text stays text)."""
    path = tmp_path_factory.mktemp("vis-chat")
    write_vision_chat_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def vserver(vision_dir):
    """A server of its own over the vision checkpoint, with image caps and remote fetches on."""
    config = base_config(
        vision_dir,
        max_images_per_request=2,
        max_image_bytes=200_000,
        allowed_media_domains=("127.0.0.1",),
        media_fetch_timeout=FETCH_TIMEOUT,
        media_fetch_max_redirects=2,
    )
    with running(config) as s:
        yield s


@pytest.fixture(scope="module")
def vhttp(vserver):
    """An httpx client on the vision server's HTTP door."""
    with httpx.Client(base_url=vserver.http_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def vstub(vserver):
    ch = grpc.insecure_channel(vserver.target)
    yield pb_grpc.TextGenerationStub(ch)
    ch.close()


@pytest.fixture(scope="module")
def expected(vision_dir):
    """The engine's result for the ChatPrompt every door should make: text, then the image."""
    engine = Engine.from_pretrained(vision_dir)
    image = preprocess(load_image(IMG, "x", ImageCaps()), 16, 3, 70)
    prompt = ChatPrompt(
        ({"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image"}]},), images=(image,)
    )
    p = SamplingParams(**{**engine.default_params().__dict__, "seed": SEED, "max_new_tokens": TOKENS})
    return engine.generate(prompt, p), engine.prompt_ids(prompt)


def _chat(parts: list, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": TOKENS, "seed": SEED, **kw}


def test_every_door_gives_the_engines_tokens(vserver, vhttp, vstub, expected):
    result, ids = expected
    assert 297 in ids  # the image placeholders
    chat = vhttp.post(
        "/v1/chat/completions",
        json=_chat([{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": _data_url(IMG)}}]),
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == result.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)

    responses = vhttp.post(
        "/v1/responses",
        json={
            "model": "tiny",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "what is"},
                        {"type": "input_image", "image_url": _data_url(IMG)},
                    ],
                }
            ],
            "max_output_tokens": TOKENS,
            "seed": SEED,
        },
        timeout=60,
    )
    assert responses.status_code == 200, responses.text
    assert responses.json()["usage"]["input_tokens"] == len(ids)
    assert responses.json()["output"][-1]["content"][0]["text"] == result.text

    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMG).decode()}
    messages = vhttp.post(
        "/v1/messages",
        json={
            "model": "tiny",
            "max_tokens": TOKENS,
            "seed": SEED,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image", "source": source}]}
            ],
        },
        timeout=60,
    )
    assert messages.status_code == 200, messages.text
    assert messages.json()["usage"]["input_tokens"] == len(ids)
    assert "".join(b.get("text", "") for b in messages.json()["content"]) == result.text

    request = pb.GenerateRequest(
        chat=pb.Chat(
            messages=[
                pb.ChatMessage(
                    role="user",
                    parts=[pb.ContentPart(text="what is"), pb.ContentPart(image=pb.Media(data=IMG))],
                )
            ]
        ),
        params=params(max_new_tokens=TOKENS, seed=SEED, max_denoising_steps=result_steps(vserver)),
    )
    got = [t for r in vstub.Generate(request, timeout=60) if r.HasField("block") for t in r.block.token_ids]
    assert got == result.token_ids


def result_steps(server) -> int:
    return server.engine.default_params().max_denoising_steps


def test_tokenize_counts_image_tokens(vhttp, vstub, expected):
    _, ids = expected
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is"},
                    {"type": "image_url", "image_url": {"url": _data_url(IMG)}},
                ],
            }
        ]
    }
    r = vhttp.post("/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids
    chat = pb.Chat(
        messages=[
            pb.ChatMessage(
                role="user", parts=[pb.ContentPart(text="what is"), pb.ContentPart(image=pb.Media(data=IMG))]
            )
        ]
    )
    assert list(vstub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=60).token_ids) == ids


@pytest.mark.parametrize(
    "url, why",
    [
        ("https://example.com/a.png", "'example.com' is not an allowed media domain"),
        ("file:///etc/passwd", "'file' URLs are not read"),
        (_data_url(b"not an image at all"), "not an image"),
        (_data_url(IMG[: len(IMG) // 2]), "corrupt or truncated"),
        (_data_url(_png(600, 400, fmt="PNG")), "bytes, more than the limit"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:text/plain;base64,aGk=", "media type"),
        (_data_url(_bomb_png(8000, 6000)), "declares 8000x6000 pixels, more than the limit of 40000000"),
        # "vis" has a position table of 64: 1000 x 40 resizes to 123 x 3 patches (an IndexError in the tower once)
        (_data_url(_png(1000, 40)), "123x3 patches, more than the vision tower's position table of 64 per side"),
    ],
)
def test_bad_images_are_400_naming_the_part(vhttp, url, why):
    parts = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]
    r = vhttp.post("/v1/chat/completions", json=_chat(parts), timeout=60)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith("messages[0].content[1]") and why in msg, msg


def test_a_declared_40000_square_png_is_refused_in_milliseconds(vhttp, vstub, monkeypatch):
    bomb = _bomb_png(40_000, 40_000)
    parts = [{"type": "image_url", "image_url": {"url": _data_url(bomb)}}]
    # a header read, never a decode (which would allocate 4.8 GB): no image of that size is ever loaded (the server
    # runs in this process), whatever the time it takes
    from PIL import ImageFile

    loaded = []
    real_load = ImageFile.ImageFile.load

    def load(self):
        loaded.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    r = vhttp.post("/v1/chat/completions", json=_chat(parts), timeout=60)
    assert r.status_code == 400 and "declares more pixels than the limit" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["message"].startswith("messages[0].content[0]")
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", parts=[pb.ContentPart(image=pb.Media(data=bomb))])])
    with pytest.raises(grpc.RpcError) as e:
        list(vstub.Generate(pb.GenerateRequest(chat=chat, params=params()), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (40_000, 40_000) not in loaded, loaded
    assert e.value.details().startswith("chat.messages[0].parts[0]: the image declares more pixels")


def test_too_many_images_is_400_naming_the_first_over_the_cap(vhttp):
    part = {"type": "image_url", "image_url": {"url": _data_url(IMG)}}
    r = vhttp.post("/v1/chat/completions", json=_chat([part, part, part]), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].content[2]: more than 2")


def test_the_shipped_size_model_refuses_images_on_every_door(http):
    """The tiny default model's image token ids lie outside its vocabulary: a 400 naming the part, never a 500."""
    url = _data_url(IMG)
    chat = http.post("/v1/chat/completions", json=_chat([{"type": "image_url", "image_url": {"url": url}}]), timeout=60)
    responses = http.post(
        "/v1/responses",
        json={"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]},
        timeout=60,
    )
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMG).decode()}
    messages = http.post(
        "/v1/messages",
        json={
            "model": "tiny",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
        },
        timeout=60,
    )
    tokenize = http.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]},
        timeout=60,
    )
    for r, where in (
        (chat, "messages[0].content[0]"),
        (responses, "input[0].content[0]"),
        (messages, "messages[0].content[0]"),
        (tokenize, "messages[0].content[0]"),
    ):
        assert r.status_code == 400, r.text
        body = r.json()["error"]
        assert body["message"].startswith(f"{where}: this model cannot take images"), body


def test_count_tokens_and_a_continued_response_read_images(vhttp, expected):
    _, ids = expected
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMG).decode()}
    content = [{"type": "text", "text": "what is"}, {"type": "image", "source": source}]
    r = vhttp.post(
        "/v1/messages/count_tokens",
        json={"model": "tiny", "messages": [{"role": "user", "content": content}]},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["input_tokens"] == len(ids), r.text
    first = vhttp.post(
        "/v1/responses",
        json={
            "model": "tiny",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": _data_url(IMG)}]}],
            "max_output_tokens": 8,
        },
        timeout=60,
    )
    assert first.status_code == 200, first.text
    then = vhttp.post(
        "/v1/responses",
        json={"model": "tiny", "input": "and now?", "previous_response_id": first.json()["id"], "max_output_tokens": 8},
        timeout=60,
    )
    assert then.status_code == 200, then.text
    assert then.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]


# ---------------------------------------------------------------------------------------------- remote images


@pytest.fixture(scope="module")
def media_site():
    """http://127.0.0.1:<port>: /a.png the image, /loop redirects to itself, /chain/<n> redirects n times to the
    image, /big more bytes than the cap, /stall answers after 6 s, /trickle sends its body a byte every 0.1 s for
    6 s (each byte well within a socket timeout, the whole past any fetch deadline here)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            try:
                self._answer()
            except OSError:
                pass  # the fetch gave up and closed the connection

        def _answer(self):
            if self.path == "/loop" or self.path.startswith("/chain/"):
                n = int(self.path.rpartition("/")[2]) if self.path != "/loop" else 1
                self.send_response(302)
                self.send_header(
                    "Location", "/loop" if self.path == "/loop" else f"/chain/{n - 1}" if n > 1 else "/a.png"
                )
                self.end_headers()
                return
            if self.path in ("/stall", "/trickle"):
                if self.path == "/stall":
                    time.sleep(6)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                for _ in range(60):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.1)
                SITE_ANSWERED[self.path] += 1  # the whole answer was sent (a cut fetch raises OSError first)
                return
            body = IMG if self.path == "/a.png" else b"\0" * 300_000
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()  # no Content-Length: the cap is checked on the bytes read
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_an_allowed_remote_image_is_fetched_and_gives_the_engines_tokens(vhttp, media_site, expected):
    result, ids = expected
    parts = [{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": media_site + "/a.png"}}]
    r = vhttp.post("/v1/chat/completions", json=_chat(parts), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == result.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    for path, why in (("/loop", "more than 2 redirects"), ("/big", "more than 200000 bytes")):
        parts = [{"type": "image_url", "image_url": {"url": media_site + path}}]
        r = vhttp.post("/v1/chat/completions", json=_chat(parts), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages[0].content[0]: ")
        assert why in r.json()["error"]["message"], r.text


def test_redirects_past_the_flag_are_a_400_naming_the_part(vhttp, media_site):
    """The server follows --media-fetch-max-redirects (2 here): a chain of 2 gives the image, one of 3 a 400."""

    def body(path: str) -> dict:
        return {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": media_site + path}}]}]
        }

    ok = vhttp.post("/tokenize", json=body("/chain/2"), timeout=60)
    assert ok.status_code == 200, ok.text
    r = vhttp.post("/tokenize", json=body("/chain/3"), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "messages[0].content[0]: more than 2 redirects"


@pytest.mark.parametrize("path", ["/stall", "/trickle"])
def test_a_slow_server_is_a_400_at_the_fetch_timeout(vhttp, media_site, path):
    """--media-fetch-timeout (1.5 s here) bounds the whole fetch: a server that says nothing, and one whose body
    comes a byte at a time (each read quick, their sum not), end in a 400 naming the part at about the timeout."""
    parts = [{"type": "image_url", "image_url": {"url": media_site + path}}]
    answered = SITE_ANSWERED[path]
    t0 = time.monotonic()
    r = vhttp.post("/v1/chat/completions", json=_chat(parts), timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        f"messages[0].content[0]: fetching the image took longer than the timeout ({FETCH_TIMEOUT:g} s)"
    )
    assert took >= FETCH_TIMEOUT, took  # not before the deadline (a loaded machine only makes it later)
    # cut at the deadline, not after the site's whole (6 s) answer: the site is still answering when the 400 comes
    assert SITE_ANSWERED[path] == answered, "the fetch waited for the whole answer"


def test_fetch_refuses_non_public_addresses_unless_named(media_site):
    from dgserve.media.images import ImageError
    from dgserve.service.media_fetch import FetchPolicy, fetch

    for policy in (FetchPolicy(("*",)), FetchPolicy(("*.0.0.1",))):
        with pytest.raises(ImageError, match=r"^x: '127.0.0.1' resolves to a non-public address"):
            fetch(media_site + "/a.png", policy, 1 << 20, "x")
    assert fetch(media_site + "/a.png", FetchPolicy(("127.0.0.1",)), 1 << 20, "x") == IMG
    with pytest.raises(ImageError, match="is not an allowed media domain"):
        fetch(media_site + "/a.png", FetchPolicy(("localhost",)), 1 << 20, "x")


def test_remote_urls_are_refused_without_allowed_domains():
    import asyncio

    from dgserve.media.images import ImageError
    from dgserve.service.images import ImageReader, openai_image, read_images

    part = openai_image(
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "messages[0].content[0]"
    )
    prompt = ChatPrompt(({"role": "user", "content": [part]},))
    with pytest.raises(ImageError, match=r"^messages\[0\]\.content\[0\]: remote images are not fetched"):
        asyncio.run(read_images(prompt, ImageReader(ImageCaps())))


@pytest.mark.parametrize(("fmt", "media"), [("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_jpeg_webp_and_gif_data_urls_are_read(vhttp, fmt, media):
    data = _png(150, 100, seed=3, fmt=fmt)
    want = preprocess(load_image(data, "x", ImageCaps()), 16, 3, 70).tokens
    body = {
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(data, media)}}]}]
    }
    r = vhttp.post("/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"].count(297) == want


def test_an_image_over_a_prompt_chunk_is_refused_naming_the_part():
    import asyncio

    from dgserve.media.images import ImageError
    from dgserve.service.images import ImageReader, openai_image, read_images

    part = openai_image({"type": "image_url", "image_url": {"url": _data_url(IMG)}}, "messages[0].content[0]")
    prompt = ChatPrompt(({"role": "user", "content": [{"type": "text", "text": "x"}, part]},))
    reader = ImageReader(ImageCaps(), 16, 3, 70, max_tokens=1)
    with pytest.raises(
        ImageError, match=r"^messages\[0\]\.content\[0\]: the image takes \d+ tokens, more than a prompt"
    ):
        asyncio.run(read_images(prompt, reader))
    read = asyncio.run(read_images(prompt, ImageReader(ImageCaps(), 16, 3, 70, max_tokens=512)))
    assert read.messages[0]["content"][1] == {"type": "image"} and len(read.images) == 1
