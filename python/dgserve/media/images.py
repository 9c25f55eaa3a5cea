"""Image inputs: caps checked on the header, decoding, and transformers' Gemma 4 image preprocessing
(docs/images.md).

Public contract:
    img = load_image(data: bytes, where="messages[0].content[1]", caps=ImageCaps())   # ImageError (a 400)
    img = open_image(data, where, caps); n = soft_tokens(*img.size, 16, 3, 280); img = decode_image(img, where)
    inp = preprocess(img, patch_size=16, pooling=3, max_soft_tokens=280, max_grid=10240)   # an ImageInput
    inp = preprocess(img, 16, 3, 70, where, max_grid, processor=ImageProcessorConfig(...))  # a checkpoint's settings

``preprocess`` reproduces ``Gemma4ImageProcessorPil`` bit for bit (tests/test_vision_parity.py), each step as the
checkpoint's image processor sets it (``processor``, media/processor.py; transformers' defaults when None): RGB with
transparency composited onto white (``do_convert_rgb``), an aspect-preserving resize to multiples of pooling·patch
within the patch budget (``resample``: PIL bicubic by default), ``uint8 → float64 · rescale_factor → float32``
(``do_rescale``), ``(x − image_mean) / image_std`` in float32 (``do_normalize``), then (C, H, W) → patches of
``p·p·3`` values ordered (row, column, channel) with (x, y) patch positions. Images are never padded to the budget:
the tower runs each on its own patches (model/vision.py).
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .processor import ImageProcessorConfig

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


DEFAULT_PROCESSOR = ImageProcessorConfig()


class ImageError(ValueError):
    """An image a request cannot use; the message starts with the part's field (``messages[i].content[j]``)."""


@dataclass(frozen=True)
class ImageCaps:
    """Per-request limits, all checked before any pixel is decoded (docs/images.md, "Limits")."""

    max_images: int = 8
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: ``patches`` [n, 3·p²] fp32, ``positions`` [n, 2] int64 (x, y), ``tokens`` its
    soft-token count (= placeholders in the prompt), ``digest`` a hash of the patches (the prefix cache's key)."""

    patches: torch.Tensor
    positions: torch.Tensor
    tokens: int
    digest: bytes


def load_image(data: bytes, where: str, caps: ImageCaps):
    """Decode ``data`` (PNG, JPEG, WebP, GIF's first frame) to a PIL image in its own mode (``preprocess``
    converts it to RGB as the checkpoint's processor says).

    The byte cap and the declared size are checked on the header before decoding; corrupt, truncated or
    non-image data raises ImageError naming ``where``."""
    return decode_image(open_image(data, where, caps), where)


def open_image(data: bytes, where: str, caps: ImageCaps):
    """``data`` opened as an image with its header read and checked (the byte cap, the declared pixels), no pixel
    decoded: ``img.size`` is what it declares; ``decode_image`` decodes it. ImageError naming ``where``."""
    from PIL import Image

    if len(data) > caps.max_bytes:
        raise ImageError(f"{where}: the image has {len(data)} bytes, more than the limit of {caps.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError:  # PIL's own header check (over 2 · 89 Mpx) came first
        raise ImageError(f"{where}: the image declares more pixels than the limit of {caps.max_pixels}") from None
    except Exception:  # noqa: BLE001  (any decoder failure on client bytes is a bad request)
        raise ImageError(f"{where}: not an image in a supported format ({', '.join(FORMATS)})") from None
    w, h = img.size
    if w <= 0 or h <= 0 or w * h > caps.max_pixels:
        raise ImageError(f"{where}: the image declares {w}x{h} pixels, more than the limit of {caps.max_pixels}")
    return img


def decode_image(img, where: str):
    """An image ``open_image`` opened, decoded (an animation's first frame), in its own mode (``preprocess``
    converts it to RGB as the checkpoint's processor says). ImageError naming ``where``."""
    try:
        img.seek(0)  # an animation's first frame
        img.load()
        return img
    except Exception as e:  # noqa: BLE001  (as above: truncated or corrupt data, whatever the codec raises)
        raise ImageError(f"{where}: the image data is corrupt or truncated ({type(e).__name__})") from None


def to_rgb(img):
    """RGB as transformers' ``convert_to_rgb`` makes it: transparency composited onto white."""
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def target_size(height: int, width: int, patch: int, max_patches: int, pooling: int) -> tuple[int, int]:
    """transformers' ``get_aspect_ratio_preserving_size``: the largest (h, w), multiples of pooling·patch, with at
    most ``max_patches`` patches (ValueError when there is none)."""
    target_px = max_patches * patch**2
    factor = math.sqrt(target_px / (height * width))
    side = pooling * patch
    th = math.floor(factor * height / side) * side
    tw = math.floor(factor * width / side) * side
    if th == 0 and tw == 0:
        raise ValueError("the image resizes to 0x0")
    max_side = (max_patches // pooling**2) * side
    if th == 0:
        th, tw = side, min(math.floor(width / height) * side, max_side)
    elif tw == 0:
        tw, th = side, min(math.floor(height / width) * side, max_side)
    if th * tw > target_px:
        raise ValueError(f"resizing {height}x{width} to {th}x{tw} exceeds {max_patches} patches")
    return th, tw


def soft_tokens(
    width: int,
    height: int,
    patch_size: int,
    pooling: int,
    max_soft_tokens: int,
    where: str = "image",
    max_grid: int | None = None,
) -> int:
    """The soft tokens ``preprocess`` makes of an image of ``width`` x ``height`` pixels (its header's size: the
    count is exact before any pixel is decoded), with ``preprocess``'s refusals (too thin, a grid past
    ``max_grid``): ImageError naming ``where``."""
    try:
        th, tw = target_size(height, width, patch_size, max_soft_tokens * pooling**2, pooling)
    except ValueError as e:
        raise ImageError(f"{where}: {e} (the image is too thin)") from None
    _check_grid(th, tw, patch_size, where, max_grid)
    return (th // patch_size) * (tw // patch_size) // pooling**2


def _check_grid(th: int, tw: int, patch_size: int, where: str, max_grid: int | None) -> None:
    if max_grid is not None and max(th, tw) // patch_size > max_grid:
        raise ImageError(
            f"{where}: the image resizes to {tw // patch_size}x{th // patch_size} patches, more than the vision"
            f" tower's position table of {max_grid} per side (the image is too thin or too wide)"
        )


def preprocess(
    img,
    patch_size: int,
    pooling: int,
    max_soft_tokens: int,
    where: str = "image",
    max_grid: int | None = None,
    processor: ImageProcessorConfig | None = None,
) -> ImageInput:
    """A PIL image → ``ImageInput`` (the module docstring has the steps). ``max_grid``: the vision tower's
    position table (``position_embedding_size``); a resized image more patches wide or tall is an ImageError
    naming ``where``, before any pixel is resized (a thin image under a small table). ``processor``: the
    checkpoint's pixel settings (resample, rescale, normalize, RGB conversion; None: transformers' defaults);
    the patch size, pooling and soft-token budget are the arguments (a request may ask for a smaller budget)."""
    from PIL import Image

    proc = processor or DEFAULT_PROCESSOR
    if proc.do_convert_rgb:
        if img.mode != "RGB" or img.info.get("transparency") is not None:
            img = to_rgb(img)
    elif img.mode != "RGB":  # transformers would hand the tower other than 3 channels
        raise ImageError(
            f"{where}: the image is {img.mode}, not RGB, and the model's image processor does not convert images"
            f" (do_convert_rgb false in {proc.source or 'its settings'})"
        )
    max_patches = max_soft_tokens * pooling**2
    try:
        th, tw = target_size(img.height, img.width, patch_size, max_patches, pooling)
    except ValueError as e:
        raise ImageError(f"{where}: {e} (the image is too thin)") from None
    _check_grid(th, tw, patch_size, where, max_grid)
    if (th, tw) != (img.height, img.width):
        img = img.resize((tw, th), resample=Image.Resampling(proc.resample))
    arr: np.ndarray = np.asarray(img, dtype=np.uint8)  # [H, W, 3]
    if proc.do_rescale:  # transformers' rescale: in float64, then float32
        arr = (arr.astype(np.float64) * proc.rescale_factor).astype(np.float32)
    if proc.do_normalize:  # transformers' normalize: in float32 (the mean and std rounded to it)
        arr = arr.astype(np.float32)
        arr = (arr - np.asarray(proc.image_mean, dtype=np.float32)) / np.asarray(proc.image_std, dtype=np.float32)
    arr = arr.astype(np.float32, copy=False)
    gh, gw = th // patch_size, tw // patch_size
    # (H, W, C) → (gh, p, gw, p, C) → (gh, gw, p, p, C): patch (row, col) holds its pixels row-major, channel last
    patches = arr.reshape(gh, patch_size, gw, patch_size, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, -1)
    gx, gy = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
    positions = np.stack([gx, gy], axis=-1).reshape(gh * gw, 2)
    patches = np.ascontiguousarray(patches)
    digest = hashlib.sha256(np.asarray([th, tw], dtype=np.int64).tobytes() + patches.tobytes()).digest()
    return ImageInput(
        torch.from_numpy(patches), torch.from_numpy(positions.astype(np.int64)), (gh * gw) // pooling**2, digest
    )


def pad_batch(images: list[ImageInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' layout: pixel_values [N, P, 3·p²] zero-padded and image_position_ids [N, P, 2] padded with -1
    (P the most patches of any image). ``unpad`` is the inverse."""
    P = max(i.patches.shape[0] for i in images)
    pv = torch.zeros(len(images), P, images[0].patches.shape[1])
    pos = torch.full((len(images), P, 2), -1, dtype=torch.int64)
    for k, im in enumerate(images):
        pv[k, : im.patches.shape[0]] = im.patches
        pos[k, : im.positions.shape[0]] = im.positions
    return pv, pos


def unpad(pixel_values: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[N, P, 3·p²], [N, P, 2] with (-1, -1) padding → per image (patches [n, 3·p²], positions [n, 2])."""
    out = []
    for k in range(pixel_values.shape[0]):
        real = ~(positions[k] == -1).all(dim=-1)
        out.append((pixel_values[k][real], positions[k][real]))
    return out
