"""dgserve: serving DiffusionGemma (block-diffusion Gemma 4 MoE).

Public surface: ``DiffusionGemma`` (the model), ``Engine`` (generation), ``SamplingParams``,
``Tokenizer``. Importing the package does no work beyond importing its modules.
"""

from dgserve.engine import Engine
from dgserve.model import DiffusionGemma
from dgserve.outputs import BlockOutput, BlockStats, GenerationResult
from dgserve.sampling_params import SamplingParams
from dgserve.tokenizer import Tokenizer

__all__ = ["BlockOutput", "BlockStats", "DiffusionGemma", "Engine", "GenerationResult", "SamplingParams", "Tokenizer"]
__version__ = "0.1.0"
