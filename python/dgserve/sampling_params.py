"""Per-request generation knobs, validated once at construction (ValueError names the field and bound)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dgserve.structured.response_format import ResponseFormat

MAX_NEW_TOKENS_LIMIT = 1 << 20
MAX_DENOISING_STEPS_LIMIT = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
SEED_LIMIT = 1 << 64


def _int_field(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def _float_field(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is generated (spec §4; defaults are transformers' generate() defaults).

    max_new_tokens: tokens returned at most (generation runs whole canvases; the output is cut).
    max_denoising_steps: N, the step budget per block; adaptive stopping may use fewer.
    t_min, t_max: temperature schedule T(k) = t_min + (t_max − t_min)·k/N, 0 ≤ t_min < t_max.
    entropy_bound: β > 0, the entropy budget of the positions accepted per step.
    stability_threshold: S ≥ 0, how many previous argmax canvases must agree to stop early.
    confidence_threshold: τ > 0, the mean entropy below which a block may stop early.
    seed: 64-bit noise seed (spec §7); None draws a random one, reported in the result.
    ignore_eos: keep generating past EOS tokens.
    stop: strings that end generation (text cut before the match; may span blocks).
    response_format: a ``ResponseFormat`` (JSON schema, JSON object, regex, choice): the output follows it
        (docs/structured-output.md); None = free text.
    """

    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    t_min: float = 0.4
    t_max: float = 0.8
    entropy_bound: float = 0.1
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        _int_field("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS_LIMIT)
        _int_field("max_denoising_steps", self.max_denoising_steps, 1, MAX_DENOISING_STEPS_LIMIT)
        t_min = _float_field("t_min", self.t_min)
        t_max = _float_field("t_max", self.t_max)
        if t_min < 0:
            raise ValueError(f"t_min must be >= 0, got {t_min}")
        if not t_max > t_min:
            raise ValueError(f"t_max must be > t_min ({t_min}), got {t_max}")
        if _float_field("entropy_bound", self.entropy_bound) <= 0:
            raise ValueError(f"entropy_bound must be > 0, got {self.entropy_bound}")
        _int_field("stability_threshold", self.stability_threshold, 0, MAX_DENOISING_STEPS_LIMIT)
        if _float_field("confidence_threshold", self.confidence_threshold) <= 0:
            raise ValueError(f"confidence_threshold must be > 0, got {self.confidence_threshold}")
        if self.seed is not None:
            _int_field("seed", self.seed, 0, SEED_LIMIT - 1)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string, got {s!r}")
            if len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"stop[{i}] is {len(s)} characters; at most {MAX_STOP_LENGTH} are allowed")
        if self.response_format is not None:
            if not isinstance(self.response_format, ResponseFormat):
                raise ValueError(f"response_format must be a ResponseFormat, got {type(self.response_format).__name__}")
            if self.ignore_eos:
                raise ValueError("response_format: cannot be combined with ignore_eos (EOS ends the document)")
