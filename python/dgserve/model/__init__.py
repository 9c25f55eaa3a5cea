"""The DiffusionGemma model: weights, encoder pass, decoder pass, KV cache."""

from .cache import KVCache, RowCache
from .diffusion_gemma import DiffusionGemma

__all__ = ["DiffusionGemma", "KVCache", "RowCache"]
