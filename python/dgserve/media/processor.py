"""The checkpoint's image processor settings, read as transformers reads them (docs/images.md, "Where the settings
come from").

Public contract:
    proc = ImageProcessorConfig.from_pretrained(path)      # ImageProcessorConfig; ValueError naming file and key
    proc = ImageProcessorConfig.from_dict(d, "preprocessor_config.json")
    proc.check_tower(patch_size=16, pooling_kernel_size=3)  # ValueError where the tower disagrees
    proc.allowed_soft_tokens                                # the per-request max_soft_tokens values

Which file: ``processor_config.json``'s ``"image_processor"`` section when it has one, else the whole of
``preprocessor_config.json`` (transformers' ``ImageProcessingMixin.get_image_processor_dict``), else transformers'
``Gemma4ImageProcessorPil`` defaults. A key that is absent or null takes that default (its ``_set_attributes``);
``max_soft_tokens`` then falls back to config.json's ``vision_soft_tokens_per_image`` (checkpoints from before
processor files were read), then 280. Keys Gemma 4's processor does not read (``size``, ``crop_size``,
``do_center_crop``, ``do_pad``, ...) are ignored as it ignores them; a value it would mis-handle, or that dgserve
cannot serve, is a ValueError naming the file and the key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# transformers' Gemma 4 processor: the soft-token budgets it accepts, and its class defaults
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
DEFAULT_SOFT_TOKENS = 280
PROCESSOR_FILE = "processor_config.json"  # its "image_processor" section wins
PREPROCESSOR_FILE = "preprocessor_config.json"
SECTION = "image_processor"
# PIL's resampling filters by the value transformers' PILImageResampling (and a JSON file) gives them
RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
TYPES = ("Gemma4ImageProcessor", "Gemma4ImageProcessorPil", "Gemma4ImageProcessorFast")


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Gemma 4's image preprocessing (``Gemma4ImageProcessorPil``'s settings; its defaults here), and the file
    they came from (``source``: "" for the defaults)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = DEFAULT_SOFT_TOKENS
    supported_soft_tokens: tuple[int, ...] = SUPPORTED_SOFT_TOKENS
    resample: int = 3  # PIL bicubic
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)
    do_convert_rgb: bool = True
    source: str = ""

    @property
    def allowed_soft_tokens(self) -> tuple[int, ...]:
        """The ``max_soft_tokens`` a request may ask for: the supported budgets up to the checkpoint's own (the
        tower's working memory is set aside for images of that size: docs/images.md, "Memory")."""
        return tuple(n for n in self.supported_soft_tokens if n <= self.max_soft_tokens)

    @classmethod
    def from_pretrained(
        cls, path, config: dict[str, Any] | None = None, tower: tuple[int, int] | None = None
    ) -> ImageProcessorConfig:
        """The settings of checkpoint directory ``path`` (module doc); ``config``: its config.json (read when
        None) for the ``vision_soft_tokens_per_image`` fallback; ``tower``: ``from_dict``'s."""
        path = Path(path)
        if config is None:
            file = path / "config.json"
            config = json.loads(file.read_text()) if file.is_file() else {}
        section, source = None, ""
        if (path / PROCESSOR_FILE).is_file():
            whole = _read(path / PROCESSOR_FILE)
            if SECTION in whole:
                section, source = whole[SECTION], f"{PROCESSOR_FILE}: {SECTION}"
                if not isinstance(section, dict):
                    raise ValueError(f"{PROCESSOR_FILE}: {SECTION} must be an object")
        if section is None and (path / PREPROCESSOR_FILE).is_file():
            section, source = _read(path / PREPROCESSOR_FILE), PREPROCESSOR_FILE
        return cls.from_dict(section or {}, source, config.get("vision_soft_tokens_per_image"), tower)

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], source: str = "", soft_fallback: Any = None, tower: tuple[int, int] | None = None
    ) -> ImageProcessorConfig:
        """From an image processor dict (``source`` names it in errors); ``soft_fallback``: config.json's
        ``vision_soft_tokens_per_image``, used when ``d`` does not set ``max_soft_tokens``; ``tower``: the vision
        tower's (patch_size, pooling_kernel_size), the defaults of those two keys (a processor that states other
        values is refused by ``check_tower``; one that states none cuts patches as the tower does)."""
        where = source or "the image processor"
        default = cls() if tower is None else cls(patch_size=tower[0], pooling_kernel_size=tower[1])

        def get(key: str):
            return d.get(key)  # absent and null alike: the default

        kind = get("image_processor_type")
        if kind is not None and kind not in TYPES:
            raise ValueError(f"{where}: image_processor_type {kind!r} is not Gemma 4's ({', '.join(TYPES)})")
        if get("do_resize") is not None and _bool(get("do_resize"), where, "do_resize") is not True:
            raise ValueError(f"{where}: do_resize false is not supported (images are resized to the patch budget)")
        patch = _int(get("patch_size"), where, "patch_size", default.patch_size)
        pooling = _int(get("pooling_kernel_size"), where, "pooling_kernel_size", default.pooling_kernel_size)
        soft_key, soft = "max_soft_tokens", get("max_soft_tokens")
        if soft is None and soft_fallback is not None:
            soft_key, soft, where_soft = "vision_soft_tokens_per_image", soft_fallback, "config.json"
        else:
            where_soft = where
        soft = _int(soft, where_soft, soft_key, default.max_soft_tokens)
        if soft not in SUPPORTED_SOFT_TOKENS:
            raise ValueError(f"{where_soft}: {soft_key} {soft} is not one of {SUPPORTED_SOFT_TOKENS}")
        resample = get("resample")
        if resample is None:
            resample = default.resample
        if isinstance(resample, bool) or not isinstance(resample, int) or resample not in RESAMPLE:
            names = ", ".join(f"{k} ({v})" for k, v in RESAMPLE.items())
            raise ValueError(f"{where}: resample {resample!r} is not a PIL resampling filter ({names})")
        do_rescale = _flag(get("do_rescale"), where, "do_rescale", default.do_rescale)
        factor = _number(get("rescale_factor"), where, "rescale_factor", default.rescale_factor)
        if do_rescale and not factor > 0:
            raise ValueError(f"{where}: rescale_factor must be a positive number (got {factor!r})")
        do_normalize = _flag(get("do_normalize"), where, "do_normalize", default.do_normalize)
        mean = _channels(get("image_mean"), where, "image_mean", default.image_mean)
        std = _channels(get("image_std"), where, "image_std", default.image_std)
        if do_normalize and any(s == 0 for s in std):
            raise ValueError(f"{where}: image_std must not hold 0 (got {list(std)})")
        return cls(
            patch_size=patch,
            pooling_kernel_size=pooling,
            max_soft_tokens=soft,
            resample=resample,
            do_rescale=do_rescale,
            rescale_factor=factor,
            do_normalize=do_normalize,
            image_mean=mean,
            image_std=std,
            do_convert_rgb=_flag(get("do_convert_rgb"), where, "do_convert_rgb", default.do_convert_rgb),
            source=source,
        )

    def check_tower(self, patch_size: int, pooling_kernel_size: int) -> None:
        """ValueError when the vision tower (config.json's vision_config) cuts or pools patches otherwise: the
        processor's soft-token counts would not be the tower's."""
        where = self.source or "the image processor"
        for key, ours, tower in (
            ("patch_size", self.patch_size, patch_size),
            ("pooling_kernel_size", self.pooling_kernel_size, pooling_kernel_size),
        ):
            if ours != tower:
                raise ValueError(f"{where}: {key} {ours} differs from config.json's vision_config.{key} {tower}")


def _read(file: Path) -> dict:
    try:
        d = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file.name}: not readable JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file.name}: not a JSON object")
    return d


def _int(value, where: str, key: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive integer (got {value!r})")
    return value


def _bool(value, where: str, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be true or false (got {value!r})")
    return value


def _flag(value, where: str, key: str, default: bool) -> bool:
    return default if value is None else _bool(value, where, key)


def _number(value, where: str, key: str, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be a finite number (got {value!r})")
    return value


def _channels(value, where: str, key: str, default: tuple[float, ...]) -> tuple[float, ...]:
    """A number (every channel) or one per RGB channel, as transformers' normalize takes it."""
    if value is None:
        return default
    if not isinstance(value, list):
        value = [_number(value, where, key, 0.0)] * 3
    if len(value) != 3:
        raise ValueError(f"{where}: {key} must be a number or 3 numbers, one per RGB channel (got {value!r})")
    return tuple(_number(v, where, key, 0.0) for v in value)
