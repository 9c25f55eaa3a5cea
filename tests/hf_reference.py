"""transformers' generate() with the dgserve seeded-noise contract patched in (DESIGN Decision 5).

Three swaps, nothing else changed: the sampler's canvas init and renoise return contract noise
(spec §7.4); a last logits processor records the processed logits; and ``torch.multinomial`` returns
``argmax(recorded processed fp32 + Gumbel)`` with the contract's Gumbel noise (spec §7.5).
Batch size 1 (per-request semantics, spec §4.5).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen

from dgserve.ops import reference
from dgserve.sampler import to_signed64


class _Recorder(LogitsProcessor):
    def __init__(self):
        self.processed = None
        self.step = None

    def __call__(self, input_ids, scores, cur_step=None):
        self.processed, self.step = scores, int(cur_step)
        return scores


@contextlib.contextmanager
def contract_noise(model, seed: int):
    """Patch `model.generate` (transformers) so its randomness is the dgserve contract for `seed`."""
    seeds = torch.tensor([to_signed64(seed)])
    rec = _Recorder()
    state = {"block": -1}
    orig_prepare = model._prepare_logits_processor

    def prepare(generation_config, logits_processor=None):
        procs = orig_prepare(generation_config, logits_processor)
        return LogitsProcessorList([*procs, rec])

    def init_canvas(self, batch_size, device):
        state["block"] += 1
        b = torch.tensor([state["block"]])
        return (
            reference.canvas_noise(seeds, b, torch.tensor([0]), self.canvas_length, self.vocab_size)
            .expand(batch_size, -1)
            .clone()
            .to(device)
        )

    def renoise(self, accepted_canvas, cur_step):
        b, k = torch.tensor([state["block"]]), torch.tensor([int(cur_step)])
        noise = reference.canvas_noise(seeds, b, k, self.canvas_length, self.vocab_size)
        return torch.where(~self.accepted_token_mask, noise.to(accepted_canvas.device), accepted_canvas)

    def multinomial(probs, num_samples, *args, **kwargs):
        proc = rec.processed.float()
        B, C, V = proc.shape
        g = reference.gumbel_noise(
            seeds.expand(B), torch.tensor([state["block"]] * B), torch.tensor([rec.step] * B), C, V
        )
        return torch.argmax(proc + g, dim=-1).view(B * C, 1)

    with (
        mock.patch.object(model, "_prepare_logits_processor", prepare),
        mock.patch.object(gen.EntropyBoundSampler, "initialize_canvas", init_canvas),
        mock.patch.object(gen.EntropyBoundSampler, "renoise_canvas", renoise),
        mock.patch.object(gen.torch, "multinomial", multinomial),
    ):
        yield


def hf_generate(
    model,
    prompt_ids,
    seed: int,
    *,
    max_new_tokens,
    steps,
    t_min=0.4,
    t_max=0.8,
    entropy_bound=0.1,
    stability_threshold=1,
    confidence_threshold=0.005,
    eos_ids=(1,),
    pad_id=0,
):
    """Run transformers' generate() under the contract; returns (new token ids list, tokens_per_forward)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    prompt = torch.tensor([list(prompt_ids)])
    with torch.no_grad(), contract_noise(model, seed):
        out = model.generate(
            prompt,
            max_new_tokens=max_new_tokens,
            max_denoising_steps=steps,
            t_min=t_min,
            t_max=t_max,
            sampler_config=EntropyBoundSamplerConfig(entropy_bound=float(entropy_bound)),
            stability_threshold=stability_threshold,
            confidence_threshold=confidence_threshold,
            eos_token_id=list(eos_ids) if eos_ids else None,
            pad_token_id=pad_id,
        )
    return out.sequences[0, prompt.shape[1] :].tolist(), float(out.tokens_per_forward[0])
