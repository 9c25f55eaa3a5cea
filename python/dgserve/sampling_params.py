"""Per-request generation knobs, defined once.

Each knob is a ``SamplingParams`` field whose ``knob`` metadata (a ``Knob``: dgserve.knob, which also checks a
value against it) carries its type, bounds, the dtype that holds it on its way to the sampler, its name in
generation_config.json and doc. The bounds a value must meet are the knob's own narrowed by its dtype's
(``Knob.bounds``: a float32 knob is at most float32's largest finite value, and a positive one at least its
smallest normal), so that a value that passes validation can be written into the engine's tensors without
overflowing or flushing to zero. Everything else derives from that table: validation at construction
(``KnobError``, a ValueError whose message starts with the field and states the bound), the checkpoint's defaults
(``SamplingParams.from_generation_config``), the gRPC and HTTP field lists and GetModelInfo's bounds
(``service/grpc/convert.py``, ``service/http/knobs.py``, through ``KNOBS``). A field without ``knob`` metadata is not
a knob: it is left to its own validation and to the layers that know it. Also here: the seeds of a request's
choices (``choice_seed``) and OpenAI's temperature on the schedule (``with_temperature``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dgserve.config import ConfigError, read_generation_config
from dgserve.knob import (
    KNOB,
    MAX_STOP_TOKEN_IDS,
    STORAGE,
    Bounds,
    Knob,
    KnobError,
    Storage,
    checked,
    finite_number,
    knob,
    shown,
    token_ids,
)
from dgserve.structured.response_format import ResponseFormat

MAX_NEW_TOKENS_LIMIT = 1 << 20
MAX_DENOISING_STEPS_LIMIT = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
SEED_LIMIT = 1 << 64

# re-exported: what one knob accepts lives in dgserve.knob, and callers import it from here too
__all__ = [
    "KNOB",
    "KNOBS",
    "MAX_DENOISING_STEPS_LIMIT",
    "MAX_NEW_TOKENS_LIMIT",
    "MAX_STOP_LENGTH",
    "MAX_STOP_STRINGS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TEMPERATURE",
    "SCALAR_KNOBS",
    "SEED_LIMIT",
    "STORAGE",
    "TEMPERATURE_ZERO_SEED",
    "Bounds",
    "Knob",
    "KnobError",
    "SamplingParams",
    "Storage",
    "choice_seed",
    "with_temperature",
]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is generated (docs/generation.md; defaults are transformers' generate() defaults).

    Construction validates every knob against its ``Knob`` (the `knob=` metadata below) and raises ``KnobError``
    (a ValueError naming the field and the bound). Floats are stored as float, ``stop`` as a tuple.

    The knobs (this list is written from the table when the module loads):
    """

    max_new_tokens: int = knob(
        256,
        int,
        dtype="int64",
        lo=1,
        hi=MAX_NEW_TOKENS_LIMIT,
        config_key="max_new_tokens",
        note="prompt tokens + whole canvases must fit in max_model_len",
        doc="tokens returned at most (generation runs whole canvases; the output is cut)",
    )
    max_denoising_steps: int = knob(
        48,
        int,
        dtype="int64",
        lo=1,
        hi=MAX_DENOISING_STEPS_LIMIT,
        config_key="max_denoising_steps",
        doc="N, the step budget per block; adaptive stopping may use fewer",
    )
    t_min: float = knob(
        0.4,
        float,
        dtype="float32",
        lo=0,
        config_key="t_min",
        note="t_min < t_max",
        doc="the low end of the temperature schedule T(k) = t_min + (t_max - t_min)·k/N, k the steps left",
    )
    t_max: float = knob(
        0.8,
        float,
        dtype="float32",
        lo=0,
        lo_open=True,
        above="t_min",
        config_key="t_max",
        doc="the high end of the schedule (the first step's temperature)",
    )
    entropy_bound: float = knob(
        0.1,
        float,
        dtype="float32",
        lo=0,
        lo_open=True,
        config_key="sampler_config.entropy_bound",
        doc="β, the entropy budget of the positions accepted per step",
    )
    stability_threshold: int = knob(
        1,
        int,
        dtype="int64",
        lo=0,
        hi=MAX_DENOISING_STEPS_LIMIT,
        config_key="stability_threshold",
        doc="S, how many previous argmax canvases must agree to stop a block early",
    )
    confidence_threshold: float = knob(
        0.005,
        float,
        dtype="float32",
        lo=0,
        lo_open=True,
        config_key="confidence_threshold",
        doc="τ, the mean entropy below which a block may stop early",
    )
    seed: int | None = knob(
        None,
        int,
        dtype="uint64",
        lo=0,
        hi=SEED_LIMIT - 1,
        nullable=True,
        note="unset: random, reported in Started",
        doc="64-bit noise seed (docs/seeded-noise.md); None draws a random one, reported in the result",
    )
    ignore_eos: bool = knob(False, bool, doc="keep generating past EOS tokens")
    stop: tuple[str, ...] = knob(
        (),
        str,
        max_items=MAX_STOP_STRINGS,
        max_chars=MAX_STOP_LENGTH,
        doc="strings that end generation (text cut before the match; may span blocks)",
    )
    min_tokens: int = knob(
        0,
        int,
        lo=0,
        hi=MAX_NEW_TOKENS_LIMIT,
        dtype="int64",
        note="min_tokens <= max_new_tokens",
        doc="tokens generated before EOS, a stop token or a stop string may end the output (the sampler never "
        "draws EOS or a stop token there)",
    )
    skip_special_tokens: bool = knob(True, bool, doc="decode the output text without special tokens")
    # not a knob (a list of ids, checked against the vocabulary by the engine): token ids that end generation as
    # EOS does, with finish_reason "stop"; kept in token_ids, never in the text
    stop_token_ids: tuple[int, ...] = ()
    # not a knob (no bounds table): a ``ResponseFormat`` (JSON schema, JSON object, regex, choice) the output
    # follows (docs/structured-output.md); None = free text
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        for name, k in KNOBS.items():
            object.__setattr__(self, name, checked(name, k, getattr(self, name)))
        for name, k in KNOBS.items():
            if k.above and not getattr(self, name) > getattr(self, k.above):
                raise KnobError(name, f"must be > {k.above} ({getattr(self, k.above)}), got {getattr(self, name)}")
        object.__setattr__(self, "stop_token_ids", token_ids("stop_token_ids", self.stop_token_ids))
        if self.min_tokens > self.max_new_tokens:
            raise KnobError("min_tokens", f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_tokens}")
        if self.response_format is not None:
            if not isinstance(self.response_format, ResponseFormat):
                raise ValueError(f"response_format must be a ResponseFormat, got {type(self.response_format).__name__}")
            if self.ignore_eos:
                raise ValueError("response_format: cannot be combined with ignore_eos (EOS ends the document)")
            if self.stop:  # a stop string could end the output mid-document with a "stop" that claims completion
                raise ValueError(
                    "stop: cannot be combined with response_format (the grammar ends the output where the document "
                    "is complete; a stop string could cut it)"
                )
            for name in ("stop_token_ids", "min_tokens"):  # the grammar decides where the document ends
                if getattr(self, name):
                    raise ValueError(f"{name}: cannot be combined with response_format (the grammar ends the output)")

    @classmethod
    def from_generation_config(cls, source: Mapping[str, Any] | str | os.PathLike[str]) -> SamplingParams:
        """The checkpoint's defaults (docs/generation.md, "Configuration"): a generation_config.json dict, or a
        checkpoint directory (its generation_config.json; absent → the defaults above) or the file itself.

        Each knob with a ``config_key`` takes the value there; absent or null keeps the default, other keys are
        ignored. ``sampler_config._cls_name`` must be EntropyBoundSamplerConfig (or absent). A value a request
        could not use either (outside the knob's bounds) → ConfigError naming the JSON field, and the file when
        read from one."""
        if isinstance(source, Mapping):
            return cls._from_config_dict(source)
        data, file = read_generation_config(source)
        try:
            return cls._from_config_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{e} (in {file})") from None

    @classmethod
    def _from_config_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        sampler = d.get("sampler_config")
        if sampler is not None:
            if not isinstance(sampler, Mapping):
                raise ConfigError(f"generation_config.sampler_config: expected an object, got {sampler!r}")
            name = sampler.get("_cls_name", "EntropyBoundSamplerConfig")
            if name != "EntropyBoundSamplerConfig":
                raise ConfigError(
                    f"generation_config.sampler_config._cls_name: {name!r} is not supported "
                    "(only 'EntropyBoundSamplerConfig')"
                )
        keys = {name: k.config_key for name, k in KNOBS.items() if k.config_key}
        kw = {name: v for name, key in keys.items() if (v := _lookup(d, key)) is not None}
        try:
            return cls(**kw)
        except KnobError as e:
            key = keys.get(e.field, e.field)
            raise ConfigError(f"generation_config.{key}: {e.reason}") from None


def _lookup(d: Mapping[str, Any], dotted: str) -> Any:
    """d["a"]["b"] for "a.b"; None when a level is absent, null or not an object."""
    value: Any = d
    for part in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


# name → Knob for every SamplingParams field that declares one, in field order (the single table)
KNOBS: Mapping[str, Knob] = MappingProxyType(
    {f.name: f.metadata[KNOB] for f in dataclasses.fields(SamplingParams) if KNOB in f.metadata}
)
# the knobs with one value per request, in field order (proto `optional` scalars)
SCALAR_KNOBS: tuple[str, ...] = tuple(name for name, k in KNOBS.items() if k.scalar)


def _describe(name: str, k: Knob) -> str:
    limits = [k.range_text(), k.constraint(name)]
    if k.max_items is not None:
        limits.append(f"at most {k.max_items} strings of at most {k.max_chars} characters")
    return f"    {name}: {k.doc}. Accepts: {'; '.join(x for x in limits if x) or k.kind.__name__}."


SamplingParams.__doc__ = (
    (SamplingParams.__doc__ or "").rstrip() + "\n\n" + "\n".join(_describe(n, k) for n, k in KNOBS.items())
)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``n`` choices and seed ``seed`` (docs/seeded-noise.md,
    "Several choices"): choice 0 runs with the request's seed itself, so it equals the n = 1 output; choice i > 0
    with splitmix64 of seed + i·0x9E3779B97F4A7C15 (mod 2^64), a bijection of the sum, so the seeds of one request
    are distinct and no choice's seed is its neighbour's seed + 1."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_MASK64 = (1 << 64) - 1
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
TEMPERATURE_ZERO_SEED = 0  # the seed a temperature-0 request without one runs with


def with_temperature(params: SamplingParams, temperature: object, explicit: Collection[str] = ()) -> SamplingParams:
    """OpenAI's ``temperature`` τ on the diffusion sampler's schedule (docs/generation.md, "Temperature schedule").

    - τ = 1 (OpenAI's default): the model's own schedule, unchanged: the output is the same as without it.
    - τ = 0: deterministic. The schedule is unchanged (a colder schedule accepts more positions per step and
      commits worse blocks; greedy decoding is not this sampler's best output) and a request that gives no seed runs
      with seed ``TEMPERATURE_ZERO_SEED``: the same request always gives the same output, of the default quality.
    - 0 < τ ≤ 2: the schedule scaled, ``t_min · τ`` and ``t_max · τ`` (colder below 1, hotter above).
    - ``t_min`` / ``t_max`` given explicitly (``explicit`` names them) win: the schedule is then not scaled.

    ValueError naming ``temperature`` outside [0, 2] or for a non-number.
    """
    if not finite_number(temperature):
        raise KnobError("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}], got {shown(temperature)}")
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise KnobError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if temperature == 0:
        return params if params.seed is not None else dataclasses.replace(params, seed=TEMPERATURE_ZERO_SEED)
    if temperature == 1 or "t_min" in explicit or "t_max" in explicit:
        return params
    return dataclasses.replace(params, t_min=params.t_min * temperature, t_max=params.t_max * temperature)
