"""dgserve: serving DiffusionGemma (block-diffusion Gemma 4 MoE).

Public surface: ``DiffusionGemma`` (the model), ``Engine`` (generation), ``SamplingParams``,
``Tokenizer``. Importing the package does no work: the names are imported on first use (PEP 562), so the light
parts (``dgserve.client``, the ``dgserve generate --server`` CLI) start without importing torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "dgserve.engine.engine",
    "DiffusionGemma": "dgserve.model",
    "BlockOutput": "dgserve.outputs",
    "BlockStats": "dgserve.outputs",
    "GenerationResult": "dgserve.outputs",
    "SamplingParams": "dgserve.sampling_params",
    "Tokenizer": "dgserve.text.tokenizer",
}
__all__ = ["BlockOutput", "BlockStats", "DiffusionGemma", "Engine", "GenerationResult", "SamplingParams", "Tokenizer"]
assert __all__ == sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dgserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
