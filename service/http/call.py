"""A checked request of a JSON door (``Call``): the engine's one submission and what the door itself needs to
answer (the model asked for, streaming, choices); and the edit-in-place fields every JSON door reads the same way.
Each API's parser (``openai/input.py``, ``responses/input.py``, ``messages/input.py``) returns one.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass

from dgserve.engine.prompt import Prompt, Submission
from dgserve.engine.request_checks import MAX_REQUEST_ID_LENGTH
from dgserve.sampling_params import SamplingParams, choice_seed

# edit in place (docs/edit-in-place.md): top-level extension fields of every JSON door
EDIT_FIELDS = ("initial_canvas", "pinned")


@dataclass(frozen=True)
class Call:
    """One checked request: its ``submission`` (prompt, params, drafts, fill-the-context, cache salt, starting
    canvas and pins; the route adds the request id and the owner) and the door's options."""

    submission: Submission
    model: str  # the name asked for ("" = not given)
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices: n requests, seeds derived from the request's (``submissions``)

    @property
    def prompt(self) -> Prompt:
        return self.submission.prompt

    @property
    def params(self) -> SamplingParams:
        assert self.submission.params is not None  # a door's call always has its params
        return self.submission.params

    @property
    def fill_context(self) -> bool:
        """No token limit given: the room left in the context (``events.fills_context``)."""
        return self.submission.fill_context

    def submissions(self, request_id: str, owner: str | None) -> list[Submission]:
        """The ``n`` choices as submissions (``owner``: the caller, None when auth is off), to be submitted
        together so they batch. Choice 0 has the request's id; choice i > 0 runs as ``<request_id>#<i>`` with seed
        ``choice_seed(seed, i)`` (docs/seeded-noise.md, "Several choices"). A request with n > 1 and no seed draws
        its one seed here."""
        first = dataclasses.replace(self.submission, request_id=request_id, owner=owner)
        if self.n == 1:
            return [first]
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(64)
        return [
            dataclasses.replace(
                first,
                request_id=choice_request_id(request_id, i),
                params=dataclasses.replace(self.params, seed=choice_seed(seed, i)),
            )
            for i in range(self.n)
        ]


def choice_request_id(request_id: str, index: int) -> str:
    """The engine id of choice ``index``: the request's for choice 0, ``<id>#<index>`` after it (the id cut so that
    it stays within the 256 characters an id may have)."""
    if index == 0:
        return request_id
    suffix = f"#{index}"
    return request_id[: MAX_REQUEST_ID_LENGTH - len(suffix)] + suffix


def edit_fields(body: dict, max_len: int | None) -> dict:
    """The body's ``initial_canvas`` and ``pinned`` (docs/edit-in-place.md) as ``Submission`` keyword arguments,
    their shape checked with bounded work: lists longer than ``max_len`` (the context window) are refused unread.
    The engine checks the ids against the vocabulary, the ranges against the draft and both against the request's
    canvases (``read_initial_canvas``, engine/initial_canvas.py)."""
    canvas, pinned = body.get("initial_canvas"), body.get("pinned")
    if canvas is not None:
        if isinstance(canvas, list):
            if max_len is not None and len(canvas) > max_len:
                raise ValueError(f"initial_canvas: {len(canvas)} token ids exceed the context window of {max_len}")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in canvas):
                raise ValueError("initial_canvas must be a string or a list of token ids (-1: a blank)")
        elif not isinstance(canvas, str):
            raise ValueError("initial_canvas must be a string or a list of token ids (-1: a blank)")
    if pinned is not None and not isinstance(pinned, bool):
        if not isinstance(pinned, list):
            raise ValueError("pinned must be true, false or a list of [start, end) ranges")
        if max_len is not None and len(pinned) > max_len:
            raise ValueError(f"pinned: {len(pinned)} ranges exceed the context window of {max_len}")
    return {"initial_canvas": canvas, "pinned": pinned}
