"""What an engine is built from and runs on: a checkpoint directory's model, tokenizer, defaults and EOS ids, and the
runtime they were placed on (docs/architecture.md, "Configuration").

Public contract:
    ckpt = load_checkpoint(path, device, dtype, native_ops)  # Checkpoint; ConfigError before the weights load
    info = runtime_info(model, plan, native_ops_mode)          # device, dtype, experts, native ops (on and off)
    ids = eos_ids(eos_token_ids, config_eos)                   # the engine's EOS ids: the given ones, else config's

The runtime plan (``dgserve.model.runtime``) and the tokenizer are imported when a checkpoint is loaded, not at
import time.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dgserve.config import generation_eos_token_ids
from dgserve.generation_config import generation_output_limits
from dgserve.model import DiffusionGemma
from dgserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dgserve.model.runtime import RuntimePlan
    from dgserve.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the model on its device, its tokenizer (None: the directory has no tokenizer.json),
    generation_config.json's defaults and EOS ids, and the runtime plan it was loaded by."""

    model: DiffusionGemma
    tokenizer: Tokenizer | None
    defaults: SamplingParams
    eos_token_ids: tuple[int, ...]
    plan: RuntimePlan
    # generation_config.json's (max_new_tokens, max_length), None where it sets none: the default output limit
    output_limits: tuple[int | None, int | None] = (None, None)


def load_checkpoint(
    path: str | os.PathLike[str],
    device: torch.device | str,
    dtype: torch.dtype | str | None,
    native_ops: str,
    hf_overrides: dict[str, Any] | str | None = None,
) -> Checkpoint:
    """Load ``path`` for ``Engine.from_pretrained``. The defaults are read and the runtime planned first, so a
    default outside its knob's bounds (ConfigError naming the field and the file) or a dtype whose weights do not
    fit the GPU (ConfigError) fails before any weight is loaded. dtype None or "auto": bfloat16 on CUDA, float32 on
    the CPU. hf_overrides: a JSON object deep-merged into config.json (docs/generation.md, "Configuration")."""
    from dgserve.model.runtime import check_plan, plan_runtime
    from dgserve.text.tokenizer import Tokenizer

    defaults = SamplingParams.from_generation_config(path)
    eos = generation_eos_token_ids(path)
    plan = plan_runtime(path, str(device), dtype, native_ops)
    check_plan(plan)
    model = DiffusionGemma.from_pretrained(path, device=device, dtype=plan.torch_dtype, hf_overrides=hf_overrides)
    tok = Tokenizer.from_pretrained(path) if os.path.exists(os.path.join(path, "tokenizer.json")) else None
    return Checkpoint(model, tok, defaults, eos, plan, generation_output_limits(path))


def eos_ids(eos_token_ids: Sequence[int] | None, config_eos: object) -> frozenset[int]:
    """The ids that end an output: ``eos_token_ids`` (generation_config.json's), or when empty or None config.json's
    ``eos_token_id`` (one id, a list of them, or None)."""
    if eos_token_ids:
        return frozenset(int(e) for e in eos_token_ids)
    if config_eos is None:
        return frozenset()
    ids = config_eos if isinstance(config_eos, (list, tuple)) else (config_eos,)
    return frozenset(int(e) for e in ids)


def runtime_info(model: DiffusionGemma, plan: RuntimePlan | None, native_ops_mode: str) -> dict[str, Any]:
    """device, dtype, expert format (``plan``'s; without a plan, dense in the model's dtype), native-ops mode, the
    native ops active on the device (after the self-check) and those switched off with why: for the start-up log
    and GetModelInfo."""
    from dgserve import ops

    off = ops.switched_off()
    active = list(ops.active_native_ops(model.device))
    fmt = plan.expert_format if plan is not None else f"dense {str(model.dtype)[6:]}"
    return {
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "expert_format": fmt,
        "native_ops_mode": native_ops_mode,
        "native_ops": active,
        "native_ops_disabled": {op: why for op, why in off.items() if op in ops.NATIVE_OPS},
    }
