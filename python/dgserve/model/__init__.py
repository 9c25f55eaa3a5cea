"""The DiffusionGemma model: weights, encoder pass, decoder pass, KV cache."""

from .cache import SlotCache, SlotView
from .diffusion_gemma import DiffusionGemma

__all__ = ["DiffusionGemma", "SlotCache", "SlotView"]
