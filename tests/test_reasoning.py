"""Gemma 4's thinking channel (docs/tools.md, "Reasoning"): the splitter at every split point, together with the
tool-call parser (reasoning first, then content and calls), the grammar's optional thought before forced calls,
and outputs of thinking requests decoded with their markers kept."""

from __future__ import annotations

import itertools
import random

import pytest

from dgserve.engine.prompt import ChatPrompt, Submission
from dgserve.outputs import OutputTracker
from dgserve.structured.chat_output import ChatOutputParser, parse_chat_output
from dgserve.structured.tools import ToolSet
from dgserve.text.gemma4 import CHANNEL_BEGIN, CHANNEL_END
from dgserve.text.reasoning import ReasoningSplitter, split_reasoning

CASES = [
    ("no channel at all", "", "no channel at all"),
    ("<|channel>thought\nplan it<channel|>The answer.", "plan it", "The answer."),
    ("<|channel>thought\n<channel|>Empty thought.", "", "Empty thought."),
    ("<|channel>other name<channel|>x", "other name", "x"),
    ("<|channel>thought\nstill thinking", "still thinking", ""),
    ("<|channel>thou", "thou", ""),
    ("a<|channel>thought\nb<channel|>c<|channel>thought\nd<channel|>e", "bd", "ace"),
    ("text with <|chan and <channel|> alone", "", "text with <|chan and <channel|> alone"),
    ("ends in <|channe", "", "ends in <|channe"),
    ("<|channel>thought\nends in <channel", "ends in <channel", ""),
]


def _splits(n: int) -> list[list[int]]:
    """Two pieces at every point, one character at a time, and a few random cuts."""
    rng = random.Random(0)
    out = [[i] for i in range(1, n)] + [list(range(1, n))]
    return out + [sorted(rng.sample(range(1, n), min(n - 1, 4))) for _ in range(5)]


@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_splitter_at_every_split_point(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)
    for cuts in _splits(len(text)):
        s = ReasoningSplitter()
        outs = [s.push(text[a:b]) for a, b in itertools.pairwise([0, *cuts, len(text)])]
        # what is streamed stays: each side grows by prefixes of its final text (no piece of a marker shows)
        assert reasoning.startswith("".join(r for r, _ in outs)) and content.startswith("".join(c for _, c in outs))
        outs.append(s.finish())
        assert ("".join(r for r, _ in outs), "".join(c for _, c in outs)) == (reasoning, content), cuts
        assert (s.reasoning, s.content) == (reasoning, content)


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("ends in <|channe", "", "ends in "),
        ("<|channel>thought\nends in <channel", "ends in ", ""),
        ("<|channel>thou", "", ""),
        ("<|channel>thought\nplan<channel|>ans <", "plan", "ans "),
        ("<|channel>thought\nplan<channel|>a < b", "plan", "a < b"),
    ],
)
def test_a_cut_output_drops_the_piece_of_a_marker(text, reasoning, content):
    """finish(cut=True): the budget or the context ended the output inside a marker, which never shows."""
    for cuts in [[], *_splits(len(text))]:
        s = ReasoningSplitter()
        outs = [s.push(text[a:b]) for a, b in itertools.pairwise([0, *cuts, len(text)])]
        outs.append(s.finish(cut=True))
        assert ("".join(r for r, _ in outs), "".join(c for _, c in outs)) == (reasoning, content), cuts


def test_splitter_can_start_inside_the_channel():
    assert split_reasoning("still thinking<channel|>done", in_reasoning=True) == ("still thinking", "done")
    assert split_reasoning("<|channel>x", in_reasoning=True) == ("<|channel>x", "")


CALL = '<|tool_call>call:get_time{"zone":"UTC"}<tool_call|>'
CHAT = "<|channel>thought\nThe user wants the time.<channel|>Checking." + CALL


@pytest.mark.parametrize(
    "tools, thinking, reasoning, content, calls",
    [
        (True, True, "The user wants the time.", "Checking.", ['{"zone":"UTC"}']),
        (False, True, "The user wants the time.", "Checking." + CALL, []),
        (True, False, "", "<|channel>thought\nThe user wants the time.<channel|>Checking.", ['{"zone":"UTC"}']),
        (False, False, "", CHAT, []),
    ],
)
def test_reasoning_then_content_and_calls_at_every_split_point(tools, thinking, reasoning, content, calls):
    whole = parse_chat_output(CHAT, tools, thinking, b"k")
    assert (whole.reasoning_content, whole.content) == (reasoning, content)
    assert [c.arguments for c in whole.tool_calls] == calls
    for cuts in _splits(len(CHAT)):
        p = ChatOutputParser(tools, thinking, b"k")
        deltas = [p.push(CHAT[a:b]) for a, b in itertools.pairwise([0, *cuts, len(CHAT)])]
        deltas.append(p.finish())
        assert "".join(d.reasoning_content for d in deltas) == reasoning, cuts
        assert "".join(d.content for d in deltas) == content, cuts
        args = "".join(t.arguments for d in deltas for t in d.tool_calls)
        assert args == "".join(calls) and p.message() == whole, cuts
        # reasoning first: no reasoning after the first content or call delta
        started = [bool(d.content or d.tool_calls) for d in deltas]
        first = started.index(True) if True in started else len(deltas)
        assert not any(d.reasoning_content for d in deltas[first + 1 :]), cuts


def test_thinking_requests_keep_their_markers(special_marker_engine):
    """With thinking (or tools) the output is decoded with special tokens kept, so the parsers see the markers; a
    plain chat request drops them, as before."""
    e = special_marker_engine
    tok = e.tokenizer
    assert tok is not None
    block = [
        tok.token_to_id(CHANNEL_BEGIN),
        *tok.encode("thought\nplan"),
        tok.token_to_id(CHANNEL_END),
        *tok.encode("ok"),
    ]
    ask = ({"role": "user", "content": "time?"},)
    kept = e.make_request(Submission(ChatPrompt(ask, enable_thinking=True), e.default_params(max_new_tokens=32)))
    _, text = kept.tracker.add_block(block)
    assert text == "<|channel>thought\nplan<channel|>ok"
    assert ChatPrompt(ask, enable_thinking=True).output_parser(kept).push(text).reasoning_content == "plan"
    plain = e.make_request(Submission(ChatPrompt(ask), e.default_params(max_new_tokens=32)))
    assert plain.tracker.add_block(block)[1] == "thought\nplanok"
    no_calls = ChatPrompt(ask, tools=ToolSet.from_openai([{"type": "function", "function": {"name": "f"}}], "none"))
    assert (
        e.make_request(Submission(no_calls, e.default_params(max_new_tokens=32))).tracker.add_block(block)[1]
        == "thought\nplanok"
    )
    tracker = OutputTracker(32, frozenset({1}), False, (), tok, skip_special_tokens=False)
    assert tracker.add_block([*block, 1])[1] == "<|channel>thought\nplan<channel|>ok"  # EOS still cut, never shown


def test_grammar_allows_a_thought_before_forced_calls(special_marker_engine):
    e = special_marker_engine
    tok = e.tokenizer
    assert tok is not None
    tools = ToolSet.from_openai(
        [{"type": "function", "function": {"name": "ping"}}],
        "required",
    )
    assert tools is not None
    compiler = e._grammar_compiler()
    thought = [tok.token_to_id(CHANNEL_BEGIN), *tok.encode("thought\nplan"), tok.token_to_id(CHANNEL_END)]
    call = [tok.token_to_id("<|tool_call>"), *tok.encode("call:ping{}"), tok.token_to_id("<tool_call|>")]
    for thinking, ok in ((True, True), (False, False)):
        m = compiler.matcher(tools.response_format(thinking=thinking))
        assert all(m.consume_token(t) for t in thought + call) == ok
        assert m.is_accepting() == ok
    m = compiler.matcher(tools.response_format(thinking=True))
    assert all(m.consume_token(t) for t in call) and m.is_accepting()  # the thought is optional
