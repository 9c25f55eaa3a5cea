"""A starting canvas against transformers: a request whose draft fills its first canvas gives exactly
``generate(..., decoder_input_ids=draft)``'s tokens under the noise contract (docs/seeded-noise.md, "A starting
canvas"; docs/edit-in-place.md), alone and batched with requests that start from noise. fp32 tiny checkpoints,
tokens compared exactly, away from near-ties (tests/hf_reference.py, ``Margins``)."""

from __future__ import annotations

import pytest
import torch
from hf_reference import case_params, clear_reference

from dgserve.engine.prompt import Submission

# (max_new_tokens, steps, t_min, t_max, entropy_bound, stability, confidence), as tests/test_generation_parity.py.
# Few steps: on a random tiny model the starting canvas's influence fades after a handful of steps (the committed
# block then equals the one from noise), so these cases keep it visible.
CASES = [
    (16, 1, 0.4, 0.8, 0.1, 1, 0.005),
    (33, 2, 0.4, 0.8, 0.1, 1, 0.005),
    (40, 3, 0.4, 0.8, 0.5, 1, 0.005),
]


def _fixtures(engine, n):
    V, C = engine.model.config.vocab_size, engine.model.config.canvas_length
    g = torch.Generator().manual_seed(43)
    for i in range(n):
        prompt = torch.randint(3, V, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        yield prompt, torch.randint(3, V, (C,), generator=g).tolist(), (0, 5, 2**40 + 3)[i % 3]


@pytest.mark.parametrize("ci", range(len(CASES)))
def test_draft_matches_generate_with_decoder_input_ids(parity_twins, ci):
    hf, engine = parity_twins("base")
    case = CASES[ci]
    changed = 0
    for prompt, draft, seed in _fixtures(engine, 3):
        ref = clear_reference(hf, prompt, seed, case, decoder_input_ids=draft)[0]
        got = _run(engine, [engine.make_request(Submission(prompt, case_params(case, seed), initial_canvas=draft))])[0]
        assert got == ref[: len(got)], f"seed {seed} case {case}"
        changed += engine.generate(prompt, case_params(case, seed)).token_ids != got
    assert changed, "the draft was meant to change the tokens (the same seed from noise gives others)"


def test_draft_batched_with_noise_requests_matches_alone(parity_twins):
    """Drafted requests batched with requests that start from noise (and each other) give their solo tokens, which
    are transformers' own."""
    hf, engine = parity_twins("base")
    case = CASES[0]
    fixtures = list(_fixtures(engine, 3))
    refs = [clear_reference(hf, p, s, case, decoder_input_ids=d)[0] for p, d, s in fixtures]
    reqs = []
    for (p, d, s), _ in zip(fixtures, refs, strict=True):
        reqs.append(engine.make_request(Submission(p, case_params(case, s), initial_canvas=d)))
        reqs.append(engine.make_request(Submission(p, case_params(case, s + 1))))
    got = _run(engine, reqs)
    for i, ref in enumerate(refs):
        assert got[2 * i] == ref[: len(got[2 * i])]
        assert got[2 * i + 1] == engine.generate(fixtures[i][0], case_params(case, fixtures[i][2] + 1)).token_ids


def _run(engine, reqs):
    for r in reqs:
        engine.add(r)
    while not all(r.finished for r in reqs):
        engine.step()
    return [r.result().token_ids for r in reqs]
