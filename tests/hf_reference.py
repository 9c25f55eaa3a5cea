"""transformers' generate() with the dgserve seeded-noise contract patched in (docs/exactness.md, "Seeded parity with
transformers").

Three swaps, nothing else changed: the sampler's canvas init and renoise return contract noise
(docs/seeded-noise.md, "Canvas noise"); a last logits processor records the processed logits; and ``torch.multinomial``
returns
``argmax(recorded processed fp32 + Gumbel)`` with the contract's Gumbel noise (docs/seeded-noise.md, "Gumbel noise").
Batch size 1 (per-request semantics, docs/exactness.md, "Seeded parity with transformers").

`hf_generate` also measures how far every decision of the run is from a tie (`Margins`): a fixture whose tokens
are compared exactly with another implementation must not sit on a near-tie (docs/exactness.md, "Near-ties").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from unittest import mock

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen

from dgserve.ops import reference
from dgserve.ops.bits import to_signed64
from dgserve.sampling_params import SamplingParams

# What another implementation may differ by, per decision of a denoising step (the bounds the margins are
# measured against). Our forward is measured ~1e-6 from transformers' in fp32 (tests/test_model_parity.py):
# 1e-5 leaves 10x headroom (the contract's bar is 1e-4, docs/exactness.md, "Near-ties"). The Gumbel noise of the native
# op and the
# torch reference differ by <= 2 ulp of max(|g|, 1) (docs/seeded-noise.md, "dg_logf"). Entropy sums and means:
# docs/exactness.md, "Near-ties" says the
# acceptance and stop decisions may differ where cum - H is within ~1e-6 relative of beta, or mean(H) within ~1e-6
# of tau (the entropies are fp32 reductions whose rounding is the machine's).
LOGIT_TOL = 1e-5
ENTROPY_REL_TOL = 1e-6


@dataclasses.dataclass
class Margins:
    """The smallest distance to a tie over a run, each as a multiple of the discrepancy allowed for it (so > 1
    means no implementation within the tolerances above can decide differently):
    sample  top-2 gap of processed + Gumbel at accepted positions / (2·LOGIT_TOL/T + 2·2 ulp(max(|g|, 1)))
    argmax  top-2 gap of the processed logits / (2·LOGIT_TOL/T), at the steps whose argmax canvas counts: a
            block's last step (it is committed) and the stability window of every step that passed the confidence
            test (stability compares whole argmax canvases)
    accept  entropy-bound slack |cum - H - beta| / (ENTROPY_REL_TOL·max(1, beta)), and the entropy gap between
            neighbours across the accepted/rejected boundary / (ENTROPY_REL_TOL·max(1, H))
    stop    |mean(H) - tau| / (ENTROPY_REL_TOL·max(1, tau)), at every step"""

    sample: float = math.inf
    argmax: float = math.inf
    accept: float = math.inf
    stop: float = math.inf
    _block: list = dataclasses.field(default_factory=list, repr=False)  # [(argmax ratio, confident)] per step

    def end_block(self, window: int) -> None:
        """Fold the finished block's argmax margins at the steps that count (see `argmax`)."""
        steps, self._block = self._block, []
        count = {len(steps) - 1} if steps else set()
        for j, (_, confident) in enumerate(steps):
            if confident:
                count.update(range(max(0, j - window), j + 1))
        for j in count:
            self.argmax = min(self.argmax, steps[j][0])

    def worst(self) -> float:
        return min(self.sample, self.argmax, self.accept, self.stop)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    x = x.abs().clamp_min(1.0).float()
    return torch.nextafter(x, torch.full_like(x, math.inf)) - x


def _top2_gap(z: torch.Tensor) -> torch.Tensor:
    if z.shape[-1] < 2:
        return torch.full(z.shape[:-1], math.inf, dtype=torch.float64)
    top = torch.topk(z.double(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


class _Recorder(LogitsProcessor):
    def __init__(self):
        self.processed = None
        self.step = None

    def __call__(self, input_ids, scores, cur_step=None):
        self.processed, self.step = scores, int(cur_step)
        return scores


@contextlib.contextmanager
def contract_noise(
    model, seed: int, margins: Margins | None = None, temperature=None, bound=None, tau=None, window: int = 1
):
    """Patch `model.generate` (transformers) so its randomness is the dgserve contract for `seed`. With
    `margins`, also record the run's distances to a tie into it; `temperature(k)` gives step k's temperature,
    `bound` and `tau` the entropy bound and confidence threshold, `window` the stability threshold."""
    seeds = torch.tensor([to_signed64(seed)])
    rec = _Recorder()
    state = {"block": -1, "gap": None}
    orig_prepare = model._prepare_logits_processor

    def prepare(generation_config, logits_processor=None):
        procs = orig_prepare(generation_config, logits_processor)
        return LogitsProcessorList([*procs, rec])

    def init_canvas(self, batch_size, device):
        if margins is not None:
            margins.end_block(window)
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
        if margins is not None:
            _measure(
                margins,
                rec.processed.float(),
                state.pop("z"),
                self.accepted_token_mask,
                temperature(int(cur_step)),
                bound,
                tau,
            )
        return torch.where(~self.accepted_token_mask, noise.to(accepted_canvas.device), accepted_canvas)

    def multinomial(probs, num_samples, *args, **kwargs):
        proc = rec.processed.float()
        B, C, V = proc.shape
        g = reference.gumbel_noise(
            seeds.expand(B), torch.tensor([state["block"]] * B), torch.tensor([rec.step] * B), C, V
        )
        state["z"] = (proc + g, g)
        return torch.argmax(proc + g, dim=-1).view(B * C, 1)

    with (
        mock.patch.object(model, "_prepare_logits_processor", prepare),
        mock.patch.object(gen.EntropyBoundSampler, "initialize_canvas", init_canvas),
        mock.patch.object(gen.EntropyBoundSampler, "renoise_canvas", renoise),
        mock.patch.object(gen.torch, "multinomial", multinomial),
    ):
        yield


def _measure(m: Margins, proc: torch.Tensor, zg, accepted: torch.Tensor, T: float, beta: float, tau: float):
    """Fold one denoising step (proc [1, C, V] processed logits, z = proc + g, accepted [1, C]) into `m`."""
    z, g = zg
    dy = LOGIT_TOL / T  # a logit error, in processed units
    top = torch.topk(z.double(), 1, dim=-1).indices
    g_top = torch.maximum(_ulp(g.gather(-1, top)[..., 0]), _ulp(g.max(-1).values)).double()
    sample = _top2_gap(z) / (2 * dy + 4 * g_top)
    if accepted.any():
        m.sample = min(m.sample, sample[accepted].min().item())
    h = reference.entropy(proc).double()[0]  # [C]
    confident = tau is not None and h.mean().item() < tau * (1 + ENTROPY_REL_TOL) + ENTROPY_REL_TOL
    m._block.append(((_top2_gap(proc) / (2 * dy)).min().item(), confident))
    s, order = torch.sort(h, stable=True)
    slack = (torch.cumsum(s, 0) - s - beta).abs() / (ENTROPY_REL_TOL * max(1.0, abs(beta)))
    m.accept = min(m.accept, slack.min().item())
    keep = accepted[0][order]
    edge = (keep[:-1] != keep[1:]).nonzero()[:, 0]  # neighbours on either side of the boundary
    if len(edge):
        gap = (s[edge + 1] - s[edge]) / (ENTROPY_REL_TOL * s[edge + 1].clamp_min(1.0))
        m.accept = min(m.accept, gap.min().item())
    if tau is not None:
        m.stop = min(m.stop, abs(h.mean().item() - tau) / (ENTROPY_REL_TOL * max(1.0, tau)))


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
    margins: Margins | None = None,
    decoder_input_ids=None,
    **model_kwargs,
):
    """Run transformers' generate() under the contract; returns (new token ids list, tokens_per_forward).
    With `margins`, the run's distances to a tie are recorded into it (see `Margins`). `model_kwargs` go to
    generate() (images: pixel_values, image_position_ids, mm_token_type_ids). `decoder_input_ids`: a starting
    canvas of C ids, passed to generate() as is (docs/seeded-noise.md, "A starting canvas")."""
    if decoder_input_ids is not None:
        model_kwargs["decoder_input_ids"] = torch.tensor([list(decoder_input_ids)])
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    prompt = torch.tensor([list(prompt_ids)])

    def temperature(k):  # docs/generation.md, "Temperature schedule": t at remaining-steps counter k
        return t_min + (t_max - t_min) * (k / steps)

    with (
        torch.no_grad(),
        contract_noise(
            model, seed, margins, temperature, float(entropy_bound), float(confidence_threshold), stability_threshold
        ),
    ):
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
            **model_kwargs,
        )
    if margins is not None:
        margins.end_block(stability_threshold)
    return out.sequences[0, prompt.shape[1] :].tolist(), float(out.tokens_per_forward[0])


# ---------------------------------------------------------------------------------------------- parity cases

# A parity case: (max_new_tokens, steps, t_min, t_max, entropy_bound, stability_threshold, confidence_threshold).
Case = tuple[int, int, float, float, float, int, float]


def _case_knobs(case: Case) -> dict:
    """The case as hf_generate's keyword arguments."""
    max_new, steps, t_min, t_max, beta, S, tau = case
    return dict(
        max_new_tokens=max_new,
        steps=steps,
        t_min=t_min,
        t_max=t_max,
        entropy_bound=beta,
        stability_threshold=S,
        confidence_threshold=tau,
    )


def case_params(case: Case, seed: int, **kw) -> SamplingParams:
    """Our SamplingParams for the case (``kw``: further knobs, e.g. ignore_eos)."""
    knobs = _case_knobs(case)
    knobs["max_denoising_steps"] = knobs.pop("steps")
    return SamplingParams(**knobs, seed=seed, **kw)


def clear_reference(model, prompt_ids, seed: int, case: Case, **kw):
    """hf_generate for the case (``kw``: its other arguments: eos_ids, pad_id, decoder_input_ids, ...), asserting
    the run stays clear of near-ties, where exact tokens are not promised (docs/exactness.md, "Near-ties");
    returns what hf_generate returns."""
    margins = Margins()
    out = hf_generate(model, prompt_ids, seed, **_case_knobs(case), margins=margins, **kw)
    assert margins.worst() > 1, f"seed {seed} case {case} prompt {list(prompt_ids)}: near-tie {margins}"
    return out


def first_step_logits(model, hf, prompt_len: int = 11, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers') fp32 logits of one denoising step: a seeded random prompt of ``prompt_len`` ids
    prefilled, then a seeded random canvas, on dgserve's ``model`` and transformers' ``hf``."""
    from transformers.cache_utils import DynamicCache

    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (1, cfg.canvas_length), generator=g)
    with torch.no_grad():
        cache = DynamicCache(config=hf.config.get_text_config(decoder=True))
        hf.model.encoder(input_ids=prompt, past_key_values=cache)
        ref = hf(decoder_input_ids=canvas, past_key_values=cache).logits
    return model.denoise(model.prefill(prompt), canvas), ref
