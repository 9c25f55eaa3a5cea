"""Images in chats: every door's image part → one neutral part → ``{"type": "image"}`` parts and ``ImageInput``s
(docs/images.md, "Doors"): the one conversion every door uses.

Public contract:
    part = openai_image(part, where)          # chat image_url / Responses input_image → a neutral part
    part = anthropic_image(block, where)      # Messages API image block → a neutral part
    part = image_bytes(data, where)           # gRPC ContentPart.image → a neutral part
    prompt = await read_images(prompt, reader)  # ChatPrompt with neutral parts → {"type": "image"} parts + images
    call = await with_images(call, reader)      # a door's call (its prompt and its max_new_tokens) with its images

A door maps its own shape to the neutral part (``{"type": "image", "source": ImageSource}``) while it validates
the request, with no decoding; ``read_images`` then checks the model and the caps, admits the images into the
image stage (``image_work``: its own pools, a bounded queue, a pixel budget), reads each header, refuses a request
whose text and images cannot fit the context (the header gives each image's exact soft tokens), and only then
decodes (docs/images.md, "Admission"). Every error is an ImageError (a ValueError, a 400 / INVALID_ARGUMENT) naming
the part, e.g. ``messages[1].content[0]``, or the engine's own context refusal. Remote ``http(s)`` URLs are fetched
(on the fetch pool) only from the domains the operator allows (``media_fetch``), else refused ("send a data URL");
``file://`` and every other scheme always.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from dgserve.engine.prompt import ChatPrompt
from dgserve.media.images import ImageCaps, ImageError, ImageInput, decode_image, open_image, preprocess, soft_tokens
from dgserve.media.processor import ImageProcessorConfig

from .image_work import ImageWork, fallback_work
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
    work: ImageWork | None = None  # the image stage (pools, queue, pixel budget, length check); None: a default
    # the checkpoint's image processor (media/processor.py: resample, rescale, normalize, RGB conversion, the
    # soft-token budgets a request may ask for); None: transformers' defaults
    processor: ImageProcessorConfig | None = None

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
            processor=vc.processor,
        )

    def with_soft_tokens(self, n: int | None, field: str = "mm_processor_kwargs.max_soft_tokens") -> ImageReader:
        """This reader with images of at most ``n`` soft tokens (None: unchanged): one of the budgets the
        checkpoint's processor supports, up to its own (``ImageProcessorConfig.allowed_soft_tokens``); else
        ImageError (a 400) naming ``field`` and the allowed values."""
        if n is None:
            return self
        allowed = (self.processor or ImageProcessorConfig(max_soft_tokens=self.max_soft_tokens)).allowed_soft_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n not in allowed:
            raise ImageError(f"{field} must be one of {', '.join(map(str, allowed))} for this model (got {n!r})")
        return dataclasses.replace(self, max_soft_tokens=n)


MM_KWARGS = "mm_processor_kwargs"  # vLLM's per-request processor settings (a JSON door's body field)


def request_reader(reader: ImageReader | None, kwargs, field: str = MM_KWARGS) -> ImageReader | None:
    """The reader of one request: ``reader`` with the request's ``mm_processor_kwargs`` applied (vLLM's field;
    ``{"max_soft_tokens": n}`` is the one setting; None or {}: ``reader`` as it is). ImageError (a 400) naming the
    field: not an object, another key, a value the model does not allow (docs/images.md, "Per request")."""
    if kwargs is None:
        return reader
    if not isinstance(kwargs, dict):
        raise ImageError(f'{field} must be an object, e.g. {{"max_soft_tokens": 70}}')
    for key in kwargs:
        if key != "max_soft_tokens":
            raise ImageError(f"{field}.{str(key)[:64]}: not supported (supported: max_soft_tokens)")
    n = kwargs.get("max_soft_tokens")
    if reader is None:  # the model is not loaded: images are refused anyway (read_images)
        return None
    return reader.with_soft_tokens(n, f"{field}.max_soft_tokens")


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


async def read_images(prompt, reader: ImageReader | None, max_new_tokens: int | None = None, fill_context=False):
    """A prompt whose chat has neutral image parts → the same chat with ``{"type": "image"}`` parts and its
    ``images`` (any other prompt is returned as is). Checks, in order and before any pixel is decoded: the model
    takes images, the number of images, room in the image queue (QueueFullError), each image's bytes and declared
    pixels (its header), and that the prompt, its images' soft tokens and ``max_new_tokens``' canvases fit the
    context (None: the prompt alone fits; ``fill_context``: one canvas, as the engine's ``make_request``) — for
    remote images, first with the fewest soft tokens an image can take, before fetching, then exactly; then decodes
    and preprocesses each image within the pixel budget. ImageError naming the part (or the engine's context
    refusal, a ValueError)."""
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
    messages = tuple(_placed(m) for m in prompt.messages)
    work = reader.work or fallback_work()
    length = work.length

    async def fits(heads: list[_Head | None]) -> None:
        if length is not None:  # the engine's context check, on its tokenization pool (not the image pools)
            sized = dataclasses.replace(prompt, messages=messages, images=prompt.images + _stand_ins(heads))
            await length(sized, max_new_tokens, fill_context=fill_context, at_least=None in heads)

    async with work.admit(len(found)):
        heads: list[_Head | None] = [
            None if s.url is not None else await work.cpu(_head, s.data, s.where, reader) for s in found
        ]
        await fits(heads)  # before any fetch (a lower bound for remote images) and before any pixel is decoded
        remote = [k for k, s in enumerate(found) if s.url is not None]
        if remote:
            fetched = await asyncio.gather(*(work.io(_fetch, found[k], reader) for k in remote))
            for k, data in zip(remote, fetched, strict=True):
                heads[k] = await work.cpu(_head, data, found[k].where, reader)
            await fits(heads)  # exact now
        images = []
        for head in heads:
            assert head is not None
            w, h = head.img.size
            async with work.pixels.hold(w * h):  # decoded and preprocessed within the pixel budget
                images.append(await work.cpu(_decode, head, reader))
    return dataclasses.replace(prompt, messages=messages, images=prompt.images + tuple(images))


@dataclass(frozen=True)
class _Head:
    """An image with its header read and checked (no pixel decoded) and the soft tokens it will take."""

    img: Any  # a PIL image opened lazily (``open_image``)
    tokens: int
    where: str


def _head(data: bytes | str, where: str, reader: ImageReader) -> _Head:
    """The checks an image's bytes and header allow, before decoding: its bytes, its declared pixels, its soft
    tokens (exact: ``soft_tokens``), its patch grid, and that it fits a prompt chunk."""
    if isinstance(data, str):
        data = decode_base64(data, where, reader.caps.max_bytes)
    img = open_image(data, where, reader.caps)
    w, h = img.size
    tokens = soft_tokens(w, h, reader.patch_size, reader.pooling, reader.max_soft_tokens, where, reader.max_grid)
    if reader.max_tokens is not None and tokens > reader.max_tokens:
        raise ImageError(
            f"{where}: the image takes {tokens} tokens, more than a prompt chunk ({reader.max_tokens}; --prefill-chunk)"
        )
    return _Head(img, tokens, where)


def _fetch(source: ImageSource, reader: ImageReader) -> bytes:
    assert source.url is not None
    return fetch(source.url, reader.remote, reader.caps.max_bytes, source.where)


def _decode(head: _Head, reader: ImageReader) -> ImageInput:
    """The pixels of an image ``_head`` checked, preprocessed for the model."""
    img = decode_image(head.img, head.where)
    return preprocess(
        img, reader.patch_size, reader.pooling, reader.max_soft_tokens, head.where, reader.max_grid, reader.processor
    )


MIN_SOFT_TOKENS = 1  # the fewest soft tokens any image takes (one pooled cell: ``target_size`` never gives less)


def _stand_ins(heads: list[_Head | None]) -> tuple[ImageInput, ...]:
    """Images with no pixels that take the soft tokens of ``heads`` (MIN_SOFT_TOKENS for one not yet fetched): the
    tokenizer places their runs, so the engine counts the prompt as the decoded images will make it."""
    return tuple(
        ImageInput(
            torch.empty(0, 0),
            torch.empty(0, 2, dtype=torch.int64),
            MIN_SOFT_TOKENS if h is None else h.tokens,
            b"",
        )
        for h in heads
    )


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
    """``call`` (a ``Submission`` or a door's call: a dataclass with a ``prompt``, and ``params`` and
    ``fill_context`` when it generates) with its images read (``read_images``, its images counted against the
    context with the output the call asks for)."""
    params = getattr(call, "params", None)
    max_new = params.max_new_tokens if params is not None else None
    prompt = await read_images(call.prompt, reader, max_new, bool(getattr(call, "fill_context", False)))
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
