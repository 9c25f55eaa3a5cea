"""Gemma 4's thinking channel out of the model's text (docs/tools.md, "Reasoning"), block by block.

With thinking enabled the model writes its reasoning in a channel before its answer:
``<|channel>thought\\n…reasoning…<channel|>answer``. ``ReasoningSplitter`` is fed the committed text in pieces of
any size and returns the reasoning and the content that became final; the markers and the channel's name line
(``thought\\n``) belong to neither. A tail that could still grow into a marker is held back until it does not, so
neither side ever shows a partial marker; feeding the text in any split gives the same result as feeding it whole
(tested at every split point). Every channel in the output is reasoning, wherever it is; one the output ends inside
is reasoning up to the end. At the end, a held piece of a marker (or of the name line) is text when the output
ended on its own, and dropped when it was cut (``finish(cut=True)``: the token budget, the context, a stop string
or a cancel ended it). ``in_reasoning=True`` starts inside a channel (for a prompt that opened one).
"""

from __future__ import annotations

from dgserve.text.gemma4 import CHANNEL_BEGIN, CHANNEL_END, THOUGHT, partial_marker


class ReasoningSplitter:
    """Reasoning and content of a text fed piece by piece (module doc). After ``finish``, ``reasoning`` and
    ``content`` hold all of each."""

    def __init__(self, in_reasoning: bool = False):
        self._state = "reasoning" if in_reasoning else "content"  # content | name (after <|channel>) | reasoning
        self._buf = ""
        self.reasoning = ""
        self.content = ""

    def push(self, text: str) -> tuple[str, str]:
        """Feed the next piece of text; returns (reasoning, content) that became final."""
        return self._run(text, final=False)

    def finish(self, cut: bool = False) -> tuple[str, str]:
        """The end of the output: what was held back is released, or dropped when the output was ``cut``."""
        return self._run("", final=True, cut=cut)

    def _run(self, text: str, final: bool, cut: bool = False) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == "name":
                if THOUGHT.startswith(self._buf) and len(self._buf) < len(THOUGHT) and not final:
                    break  # the name line may still come
                if self._buf.startswith(THOUGHT):
                    self._buf = self._buf[len(THOUGHT) :]
                elif cut and THOUGHT.startswith(self._buf):
                    self._buf = ""  # cut inside the name line
                self._state = "reasoning"
                continue
            inside = self._state == "reasoning"
            marker = CHANNEL_END if inside else CHANNEL_BEGIN
            out = reasoning if inside else content
            k = self._buf.find(marker)
            if k < 0:
                hold = 0 if final and not cut else partial_marker(self._buf, marker)
                out.append(self._buf[: len(self._buf) - hold])
                self._buf = "" if final else self._buf[len(self._buf) - hold :]  # cut: the held piece is dropped
                break
            out.append(self._buf[:k])
            self._buf = self._buf[k + len(marker) :]
            self._state = "content" if inside else "name"
        r, c = "".join(reasoning), "".join(content)
        self.reasoning += r
        self.content += c
        return r, c


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole output: the same as feeding ``ReasoningSplitter`` the text in any pieces."""
    s = ReasoningSplitter(in_reasoning)
    s.push(text)
    s.finish()
    return s.reasoning, s.content
