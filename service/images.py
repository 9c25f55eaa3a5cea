"""Images in chats: every door's image part → one neutral part → ``{"type": "image"}`` parts and ``ImageInput``s
(docs/images.md, "Doors"): the one conversion every door uses.

Public contract:
    part = openai_image(part, where)          # chat image_url / Responses input_image → a neutral part
    part = anthropic_image(block, where)      # Messages API image block → a neutral part
    part = image_bytes(data, where)           # gRPC ContentPart.image → a neutral part
    prompt = await read_images(prompt, reader)  # ChatPrompt with neutral parts → {"type": "image"} parts + images

A door maps its own shape to the neutral part (``{"type": "image", "source": ImageSource}``) while it validates
the request, with no decoding; ``read_images`` then checks the model and the caps and decodes each image in a
worker thread (decoding and preprocessing are CPU work, never on the event loop). Every error is an ImageError (a
ValueError, a 400 / INVALID_ARGUMENT) naming the part, e.g. ``messages[1].content[0]``. Remote ``http(s)`` URLs
are fetched (in the worker thread) only from the domains the operator allows (``media_fetch``), else refused
("send a data URL"); ``file://`` and every other scheme always.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
from dataclasses import dataclass

from dgserve.engine.prompt import ChatPrompt
from dgserve.media.images import ImageCaps, ImageError, ImageInput, load_image, preprocess

from .media_fetch import FetchPolicy, fetch

NO_FETCH = FetchPolicy()  # no domain: remote images are refused
# the media types a data URL or a base64 block may name (the decoder reads the bytes' own format, whatever is named)
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")


@dataclass(frozen=True)
class ImageSource:
    """A neutral image part's content: the encoded image as sent, bytes or base64 text (decoded in the worker
    thread too, as a data URL of up to the body limit is tens of milliseconds of CPU), and where it stands."""

    data: bytes | str
    where: str
    url: str | None = None  # a remote http(s) URL, fetched by ``read_images`` (then ``data`` is empty)


@dataclass(frozen=True)
class ImageReader:
    """What ``read_images`` needs of the served model and the server: the caps (server flags), the model's
    preprocessing (patch size, pooling, soft tokens per image) and why it cannot take images (None when it can)."""

    caps: ImageCaps
    patch_size: int = 16
    pooling: int = 3
    max_soft_tokens: int = 280
    unsupported: str | None = None
    remote: FetchPolicy = NO_FETCH  # where remote images may be fetched from (none: every URL is refused)
    max_tokens: int | None = None  # soft tokens one image may take (a prompt chunk: an image is encoded in one pass)
    max_grid: int | None = None  # patches per side the tower's position table holds (position_embedding_size)

    @classmethod
    def for_model(
        cls, model, caps: ImageCaps, remote: FetchPolicy = NO_FETCH, max_tokens: int | None = None
    ) -> ImageReader:
        """The reader of a ``DiffusionGemma`` (its vision config) under ``caps`` and ``remote``; ``max_tokens``:
        the engine's prompt chunk."""
        why = model.images_unsupported()
        if model.vision is None:
            return cls(caps, unsupported=why, remote=remote)
        vc = model.vision.config
        return cls(
            caps,
            vc.patch_size,
            vc.pooling_kernel_size,
            vc.max_soft_tokens,
            why,
            remote,
            max_tokens,
            vc.position_embedding_size,
        )


def neutral(data: bytes | str, where: str) -> dict:
    """The neutral part every door makes: encoded bytes, to be decoded by ``read_images``."""
    return {"type": "image", "source": ImageSource(data, where)}


def image_bytes(data: bytes, where: str) -> dict:
    """gRPC: ``ContentPart.image.data`` (PNG, JPEG, WebP or GIF bytes) → a neutral part."""
    if not data:
        raise ImageError(f"{where}.data: empty image")
    return neutral(bytes(data), where)


def openai_image(part: dict, where: str) -> dict:
    """OpenAI chat ``{"type": "image_url", "image_url": {"url"}}`` (or ``"image_url": "<url>"``) and the Responses
    API's ``{"type": "input_image", "image_url": "<url>"}`` → a neutral part. Only data URLs are read."""
    url = part.get("image_url")
    field = f"{where}.image_url"
    if isinstance(url, dict):
        url, field = url.get("url"), f"{field}.url"
    if url is None and part.get("type") == "input_image" and part.get("file_id") is not None:
        raise ImageError(f"{where}.file_id: files are not stored here: send the image as a data URL in image_url")
    if not isinstance(url, str):
        raise ImageError(f"{field} must be a string (a data URL: data:image/png;base64,...)")
    return _url_part(url, field, where)


def _url_part(url: str, field: str, where: str) -> dict:
    """A data URL's bytes, or an http(s) URL to fetch, as a neutral part."""
    if url.split(":", 1)[0].lower() in ("http", "https"):
        return {"type": "image", "source": ImageSource(b"", where, url)}
    return neutral(data_url(url, field), where)


def anthropic_image(block: dict, where: str) -> dict:
    """Messages API ``{"type": "image", "source": {"type": "base64", "media_type", "data"}}`` (or a ``url`` source,
    read as a URL) → a neutral part."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise ImageError(f"{where}.source must be an object")
    kind = source.get("type")
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str):
            raise ImageError(f"{where}.source.url must be a string")
        return _url_part(url, f"{where}.source.url", where)
    if kind != "base64":
        raise ImageError(f"{where}.source.type must be base64 or url")
    media = source.get("media_type")
    if media not in MEDIA_TYPES:
        raise ImageError(f"{where}.source.media_type must be one of {', '.join(MEDIA_TYPES)}")
    return neutral(_base64(source.get("data"), f"{where}.source.data"), where)


def data_url(url: str, field: str) -> str:
    """The base64 text of a ``data:image/...;base64,`` URL (ImageError naming ``field`` for anything else: http(s) URLs
    are ``_url_part``'s, other schemes are never read)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise ImageError(f"{field}: remote images are not fetched: send a data URL (data:image/png;base64,...)")
    if scheme != "data":
        shown = scheme or "no scheme"
        raise ImageError(f"{field}: {shown!r} URLs are not read: send a data URL (data:image/png;base64,...)")
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError(f"{field}: a data URL needs a ',' before its data")
    media, *params = head.split(";")
    if media.lower() not in MEDIA_TYPES:
        raise ImageError(f"{field}: data URL media type {media!r} is not one of {', '.join(MEDIA_TYPES)}")
    if "base64" not in (p.lower() for p in params):
        raise ImageError(f"{field}: the data URL must be base64 (data:{media};base64,...)")
    return _base64(payload, field)


def _base64(value, field: str) -> str:
    """Base64 text, checked for its type only (``decode_base64`` reads it in the worker thread)."""
    if not isinstance(value, str) or not value:
        raise ImageError(f"{field} must be a non-empty base64 string")
    return value


def decode_base64(text: str, where: str, max_bytes: int) -> bytes:
    """The bytes of base64 ``text``; ImageError naming ``where`` when it is not base64 or its bytes would exceed
    ``max_bytes`` (judged on its length, before decoding)."""
    if len(text) // 4 * 3 > max_bytes + 3:
        raise ImageError(f"{where}: the image has about {len(text) // 4 * 3} bytes, more than the limit of {max_bytes}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: not valid base64") from None


def sources(prompt: ChatPrompt) -> list[ImageSource]:
    """The neutral image parts of a chat's messages, in order."""
    out = []
    for m in prompt.messages:  # (not yet validated: the tokenizer names what is malformed)
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, (list, tuple)):
            out += [p["source"] for p in content if isinstance(p, dict) and isinstance(p.get("source"), ImageSource)]
    return out


async def read_images(prompt, reader: ImageReader | None):
    """A prompt whose chat has neutral image parts → the same chat with ``{"type": "image"}`` parts and its
    ``images`` (any other prompt is returned as is). Checks, in order and before any pixel is decoded: the model
    takes images, the number of images, each image's bytes and declared pixels; then decodes and preprocesses
    each image in a worker thread. ImageError naming the part."""
    if not isinstance(prompt, ChatPrompt):
        return prompt
    found = sources(prompt)
    if not found:
        return prompt
    if reader is None or reader.unsupported is not None:
        why = "the model is not loaded" if reader is None else reader.unsupported
        raise ImageError(f"{found[0].where}: this model cannot take images ({why})")
    if len(found) > reader.caps.max_images:
        raise ImageError(
            f"{found[reader.caps.max_images].where}: more than {reader.caps.max_images} images in one request"
        )
    for s in found:
        if s.url is not None and not reader.remote.domains:
            raise ImageError(
                f"{s.where}: remote images are not fetched: send a data URL (data:image/png;base64,...); the "
                "operator can allow domains with --allowed-media-domains"
            )
    images = [await asyncio.to_thread(_decode, s, reader) for s in found]
    messages = tuple(_placed(m) for m in prompt.messages)
    return dataclasses.replace(prompt, messages=messages, images=prompt.images + tuple(images))


def _decode(source: ImageSource, reader: ImageReader) -> ImageInput:
    data = source.data
    if isinstance(data, str):
        data = decode_base64(data, source.where, reader.caps.max_bytes)
    if source.url is not None:
        data = fetch(source.url, reader.remote, reader.caps.max_bytes, source.where)
    img = load_image(data, source.where, reader.caps)
    image = preprocess(img, reader.patch_size, reader.pooling, reader.max_soft_tokens, source.where, reader.max_grid)
    if reader.max_tokens is not None and image.tokens > reader.max_tokens:
        raise ImageError(
            f"{source.where}: the image takes {image.tokens} tokens, more than a prompt chunk ({reader.max_tokens}; "
            "--prefill-chunk)"
        )
    return image


def _placed(message: dict) -> dict:
    """The message with each neutral image part as the tokenizer's ``{"type": "image"}`` place."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, (list, tuple)):
        return message
    parts = [
        {"type": "image"} if isinstance(p, dict) and "source" in p and p.get("type") == "image" else p for p in content
    ]
    return {**message, "content": parts}


async def with_images(call, reader: ImageReader | None):
    """``call`` (a ``Submission`` or a door's call: a dataclass with a ``prompt``) with its images read
    (``read_images``)."""
    prompt = await read_images(call.prompt, reader)
    return call if prompt is call.prompt else dataclasses.replace(call, prompt=prompt)


def openai_messages(messages: list) -> tuple:
    """The chat door's messages with each ``image_url`` part (``messages[i].content[j]``) as a neutral part; the
    rest is left to the tokenizer's checks."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            parts = [
                openai_image(p, f"messages[{i}].content[{j}]")
                if isinstance(p, dict) and p.get("type") == "image_url"
                else p
                for j, p in enumerate(content)
            ]
            m = {**m, "content": parts}
        out.append(m)
    return tuple(out)


def stored_size(messages: list) -> int:
    """The image bytes of neutral parts in ``messages`` (what a JSON size leaves out: they are not JSON)."""
    return sum(
        len(p["source"].data)
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), (list, tuple))
        for p in m["content"]
        if isinstance(p, dict) and isinstance(p.get("source"), ImageSource)
    )
