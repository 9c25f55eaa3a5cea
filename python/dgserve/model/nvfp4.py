"""NVFP4 (NVIDIA ModelOpt) weights as loading sees them: the format, the ModelOpt-faithful quantizer, the load-time
packing of a layer's experts, and the per-expert checkpoint names.

The format and the quantizer (exact decode, the W4A16 kernel layout, the experts' torch reference; docs/kernels.md)
live in the ops layer, ``dgserve.ops.nvfp4_format``, and ``pack_experts`` in ``dgserve.ops.nvfp4_repack``, because
the ops and their start-up self-check need them; they are re-exported here so loading code has one name for
everything NVFP4. The dependency runs one way: this module imports ``dgserve.ops``, never the reverse
(tests/test_layering.py).
"""

from __future__ import annotations

import re

from dgserve.ops.nvfp4_format import (
    CHUNK_K,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    GROUP,
    PackedExperts,
    cast_e2m1,
    check_scales,
    chunks,
    decode_repacked,
    decode_scale_codes,
    dequantize,
    e2m1_decode,
    encode_scales,
    expert_outputs,
    interleave_rows,
    padded,
    quantize,
    repack,
    unpack,
)
from dgserve.ops.nvfp4_repack import pack_experts

__all__ = [
    "CHUNK_K",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "EXPERT_NAME",
    "GROUP",
    "PROJECTIONS",
    "PackedExperts",
    "cast_e2m1",
    "check_scales",
    "chunks",
    "decode_repacked",
    "decode_scale_codes",
    "dequantize",
    "e2m1_decode",
    "encode_scales",
    "expert_outputs",
    "interleave_rows",
    "pack_experts",
    "padded",
    "quantize",
    "repack",
    "unpack",
]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
EXPERT_NAME = re.compile(
    r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.experts)\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<part>weight|weight_scale|weight_scale_2|input_scale)$"
)
