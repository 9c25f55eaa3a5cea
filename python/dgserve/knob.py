"""What one request knob accepts: its ``Knob`` (type, bounds, the dtype that holds it on its way to the sampler,
its generation_config.json key, its doc) and the check of a value against it (``checked``), the rules
``SamplingParams`` (dgserve.sampling_params) is built from. Pure Python: the dtypes' numbers are restated here
(``STORAGE``), no torch.

Public contract:
    field = knob(default, kind, **Knob fields)   # a dataclass field carrying its Knob (metadata key ``KNOB``)
    value = checked(name, knob, value)           # validated and normalised, else KnobError naming the field
    ids = token_ids(name, value)                 # a tuple of at most MAX_STOP_TOKEN_IDS ids, else KnobError
    ok = finite_number(value); text = shown(value)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeGuard

MAX_STOP_TOKEN_IDS = 64

KNOB = "knob"  # the dataclass field metadata key


@dataclass(frozen=True)
class Storage:
    """What a dtype can hold (torch.finfo / torch.iinfo's numbers, without importing torch): lo, hi the most
    negative and most positive finite values; tiny the smallest positive normal (floats; 0 for integers)."""

    lo: int | float
    hi: int | float
    tiny: float = 0.0


# the dtypes a knob may name (tests/test_sampling_params.py checks them against torch.finfo / torch.iinfo)
STORAGE: Mapping[str, Storage] = MappingProxyType(
    {
        "float32": Storage(-3.4028234663852886e38, 3.4028234663852886e38, 1.1754943508222875e-38),
        "float64": Storage(-1.7976931348623157e308, 1.7976931348623157e308, 2.2250738585072014e-308),
        "int32": Storage(-(1 << 31), (1 << 31) - 1),
        "int64": Storage(-(1 << 63), (1 << 63) - 1),
        "uint64": Storage(0, (1 << 64) - 1),  # the seed: held as the int64 with the same bits (ops.bits.to_signed64)
    }
)


@dataclass(frozen=True)
class Bounds:
    """The values a knob accepts: lo, hi (None: unbounded on that side), excluded when lo_open / hi_open."""

    lo: int | float | None
    hi: int | float | None
    lo_open: bool = False
    hi_open: bool = False

    def text(self) -> str:
        """ "in [1, 1024]", ">= 0", "> 0", "" when unbounded."""
        if self.lo is not None and self.hi is not None:
            return f"in {'(' if self.lo_open else '['}{self.lo!r}, {self.hi!r}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo!r}"
        if self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {self.hi!r}"
        return ""

    def contains(self, v: int | float) -> bool:
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        hi_ok = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return lo_ok and hi_ok


@dataclass(frozen=True)
class Knob:
    """What one SamplingParams field accepts.

    kind: int, float or bool for a scalar; str for a sequence of strings (a str alone becomes a 1-tuple).
    lo, hi: the knob's own bounds (None: unbounded on that side), excluded when lo_open / hi_open. Floats must be
    finite. dtype: the narrowest dtype (a ``STORAGE`` name) that holds the value on its way to the sampler (a knob
    table of the model runner, or the precision an op computes it in); ``bounds`` narrows lo and hi to it.
    above: the name of a field this one must exceed (t_max > t_min), checked after every field's own bounds.
    nullable: None is accepted (seed: None draws one). max_items, max_chars: a string sequence's limits.
    config_key: the (dotted) key in generation_config.json that sets the checkpoint's default; "" = none.
    note: a remark for GetModelInfo (a constraint involving more than this field). doc: one line.
    """

    kind: type
    lo: int | float | None = None
    hi: int | float | None = None
    lo_open: bool = False
    hi_open: bool = False
    dtype: str = ""
    above: str = ""
    nullable: bool = False
    max_items: int | None = None
    max_chars: int | None = None
    config_key: str = ""
    note: str = ""
    doc: str = ""

    def __post_init__(self) -> None:
        if self.dtype and self.dtype not in STORAGE:
            raise ValueError(f"Knob.dtype: {self.dtype!r} is not one of {', '.join(STORAGE)}")

    @property
    def scalar(self) -> bool:
        """One value per request (a proto `optional` scalar), as opposed to a sequence."""
        return self.kind in (int, float, bool)

    @property
    def numeric(self) -> bool:
        return self.kind in (int, float)

    def constraint(self, name: str) -> str:
        """The note, else the cross-field rule of field ``name`` in words ("t_max > t_min"), else ""."""
        return self.note or (f"{name} > {self.above}" if self.above else "")

    @property
    def declared(self) -> Bounds:
        """The knob's own bounds, as the table states them (what the knob means)."""
        return Bounds(self.lo, self.hi, self.lo_open, self.hi_open)

    @property
    def bounds(self) -> Bounds:
        """The values accepted: the knob's own bounds narrowed to what its dtype holds. The largest finite value of
        the dtype caps the top (a float32 knob above 3.4e38 would overflow when written into its tensor), and a
        float whose lower bound is open or positive starts at the dtype's smallest normal (a positive value that
        rounds to zero or to a subnormal is not the positive number it claims to be)."""
        b = self.declared
        if not self.dtype:
            return b
        st = STORAGE[self.dtype]
        lo, lo_open, hi, hi_open = b.lo, b.lo_open, b.hi, b.hi_open
        if hi is None or hi > st.hi:
            hi, hi_open = st.hi, False
        if lo is None or lo < st.lo:
            lo, lo_open = st.lo, False
        if st.tiny and lo is not None and 0 <= lo < st.tiny and (lo_open or lo > 0):
            lo, lo_open = st.tiny, False
        return Bounds(lo, hi, lo_open, hi_open)

    def range_text(self) -> str:
        """The accepted range: "in [1, 1024]", ">= 0", "> 0", "" when unbounded; where the dtype narrows the
        knob's own bounds, both: "> 0, a float32 in [1.1754943508222875e-38, 3.4028234663852886e+38]"."""
        own, held = self.declared, self.bounds
        if held == own:
            return own.text()
        return f"{own.text()}, a {self.dtype} {held.text()}" if own.text() else f"a {self.dtype} {held.text()}"

    def in_range(self, v: int | float) -> bool:
        return self.bounds.contains(v)


class KnobError(ValueError):
    """A knob value outside its Knob: ``str(e)`` is "<field> <reason>" (the field may be indexed: ``stop[2]``)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field} {reason}")
        self.field, self.reason = field, reason


def knob(default: Any, kind: type, **kw: Any) -> Any:
    """A dataclass field with Knob metadata (typed Any so the annotation stays the field's own type)."""
    return field(default=default, metadata={KNOB: Knob(kind, **kw)})


def checked(name: str, k: Knob, value: Any) -> Any:
    """``value`` validated against ``k`` (and normalised: float for floats, a tuple for strings)."""
    if value is None and k.nullable:
        return None
    if k.kind is str:
        return _checked_strings(name, k, value)
    if k.kind is bool:
        if not isinstance(value, bool):
            raise KnobError(name, f"must be a bool, got {value!r}")
        return value
    if k.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise KnobError(name, f"must be an integer, got {value!r}")
    elif not finite_number(value):
        raise KnobError(name, f"must be a finite number, got {shown(value)}")
    else:
        value = float(value)
    if not k.in_range(value):
        raise KnobError(name, f"must be {k.range_text()}, got {shown(value)}")
    return value


def finite_number(value: Any) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or float that is a finite double: an integer beyond the double range (a JSON
    number of 310 digits) is not one (``math.isfinite`` would raise OverflowError converting it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown(value: Any) -> str:
    """``value`` for an error message: an integer too large for a double by its size, not its hundreds of digits
    (which Python would not even print past 4,300)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 1024:
        return f"an integer of {value.bit_length()} bits, beyond the range of a double"
    return repr(value)


def token_ids(name: str, value: Any) -> tuple[int, ...]:
    """``value`` as a tuple of at most MAX_STOP_TOKEN_IDS non-negative ints; KnobError naming ``name[i]``."""
    if not isinstance(value, (list, tuple)):
        raise KnobError(name, f"must be a list of token ids, got {type(value).__name__}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise KnobError(name, f"has {len(value)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise KnobError(f"{name}[{i}]", f"must be a non-negative integer token id, got {t!r}")
    return tuple(value)


def _checked_strings(name: str, k: Knob, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items: tuple[Any, ...] = (value,)
    elif isinstance(value, (list, tuple)):
        items = tuple(value)
    else:
        raise KnobError(name, f"must be a string or a sequence of strings, got {type(value).__name__}")
    if k.max_items is not None and len(items) > k.max_items:
        raise KnobError(name, f"has {len(items)} strings; at most {k.max_items} are allowed")
    for i, s in enumerate(items):
        if not isinstance(s, str) or not s:
            raise KnobError(f"{name}[{i}]", f"must be a non-empty string, got {s!r}")
        if k.max_chars is not None and len(s) > k.max_chars:
            raise KnobError(f"{name}[{i}]", f"is {len(s)} characters; at most {k.max_chars} are allowed")
    return items
