"""Tool calling (docs/tools.md): the request's tools and the conversation validated with errors naming the field;
the prompt (built-in format, the shipped model's template, a checkpoint's own template); the grammar; the parsers
(at every split point); and generation through ``Engine`` on the shipped small model (calls validate against their
schemas, seeded determinism) and on a tiny random model whose vocabulary has the markers as special tokens."""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest

from dgserve import Engine, SamplingParams
from dgserve.engine.prompt import ChatPrompt, Submission
from dgserve.model.default_model import SHIPPED
from dgserve.structured import ResponseFormat
from dgserve.structured.grammar import GrammarCompiler
from dgserve.structured.tool_parser import ToolCallParser, call_id, call_id_seed, parse_tool_calls
from dgserve.structured.tools import MAX_TOOLS, FunctionTool, ToolSet
from dgserve.text.gemma4 import TOOL_CALL_BEGIN, read_native
from dgserve.text.messages import validate_messages
from dgserve.text.tokenizer import Tokenizer, render_gemma4

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The forecast for a city", "parameters": WEATHER_SCHEMA},
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = ({"role": "user", "content": "What is the weather in Paris?"},)

# a finished tool round: the model called two tools, both answered, then the model answered and the user went on
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Two calls.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
    {"role": "assistant", "content": "Sunny, 20 degrees, noon."},
    {"role": "user", "content": "Thanks"},
]


# ---------------------------------------------------------------------- the request's tools


@pytest.mark.parametrize(
    "tools, choice, parallel, field",
    [
        ({"a": 1}, None, None, r"^tools: must be a list"),
        ([WEATHER, {"type": "custom", "custom": {}}], None, None, r"^tools\[1\]\.type:"),
        ([{"type": "function"}], None, None, r"^tools\[0\]\.function:"),
        ([{"type": "function", "function": {"name": "get weather"}}], None, None, r"^tools\[0\]\.function\.name:"),
        ([{"type": "function", "function": {"name": "f" * 65}}], None, None, r"^tools\[0\]\.function\.name:"),
        ([{"type": "function", "function": {}}], None, None, r"^tools\[0\]\.function\.name:"),
        ([WEATHER, TIME, WEATHER], None, None, r"^tools\[2\]\.function\.name: 'get_weather' is also .* tools\[0\]"),
        (
            [{"type": "function", "function": {"name": "f", "description": 3}}],
            None,
            None,
            r"^tools\[0\]\.function\.desc",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            None,
            r"^tools\[0\]\.function\.par",
        ),
        (
            [TIME, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            None,
            r"^tools\[1\]\.function\.parameters: .*\"object\"",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"properties": {"x": {"$ref": "#"}}, "required": ["x"]}},
                }
            ],
            None,
            None,
            r"^tools\[0\]\.function\.parameters: the schema admits no finite JSON document",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"items": json.loads("[" * 70 + "]" * 70)}}}],
            None,
            None,
            r"^tools\[0\]\.function\.parameters: schema nests",
        ),
        (
            [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
            None,
            None,
            r"^tools\[0\]\.function\.strict",
        ),
        ([WEATHER], "sometimes", None, r"^tool_choice: must be"),
        ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, None, r"^tool_choice\.function\.name:"),
        ([WEATHER], {"type": "function"}, None, r"^tool_choice\.function\.name:"),
        ([WEATHER], {"type": "allowed_tools"}, None, r"^tool_choice\.type:"),
        ([], "required", None, r"^tool_choice: 'required' needs tools"),
        (None, {"type": "function", "function": {"name": "f"}}, None, r"^tool_choice: 'function' needs tools"),
        ([WEATHER], None, "yes", r"^parallel_tool_calls:"),
        ([TIME] * (MAX_TOOLS + 1), None, None, r"^tools: .* at most 128"),
    ],
)
def test_tool_errors_name_the_field(tools, choice, parallel, field):
    with pytest.raises(ValueError, match=field):
        ToolSet.from_openai(tools, choice, parallel)


def test_tool_set_defaults_and_what_it_means():
    assert ToolSet.from_openai(None) is None and ToolSet.from_openai([], "none") is None
    assert ToolSet.from_openai([], "auto") is None
    ts = ToolSet.from_openai([WEATHER, TIME])
    assert ts is not None and ts.choice.kind == "auto" and ts.parallel and ts.calls
    assert ts.rendered() == [WEATHER, {**TIME, "function": {**TIME["function"], "description": ""}}]
    fmt = ts.response_format()
    assert fmt is not None and fmt.type == "tool_calls" and fmt.tools is not None
    assert not fmt.tools.required and fmt.tools.only is None and fmt.tools.parallel
    assert [(f.index, f.name) for f in fmt.tools.functions] == [(0, "get_weather"), (1, "get_time")]
    named = ToolSet.from_openai([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, True)
    assert named is not None
    nf = named.response_format(thinking=True)
    assert nf is not None and nf.tools is not None
    assert nf.tools.required and nf.tools.only == "get_time" and not nf.tools.parallel and nf.tools.thinking
    none = ToolSet.from_openai([WEATHER], "none")
    assert none is not None and not none.calls and none.rendered() == [] and none.response_format() is None
    # no parameters: arguments {} only; a schema without a type gets "object"
    bare = FunctionTool.from_openai({"type": "function", "function": {"name": "ping"}})
    assert json.loads(bare.parameters) == {"type": "object", "properties": {}, "additionalProperties": False}
    typed = FunctionTool("f", parameters='{"properties": {}}')
    assert json.loads(typed.parameters)["type"] == "object"
    with pytest.raises(ValueError, match=r"^response_format: type 'tool_calls' is made from a request's tools"):
        ResponseFormat("tool_calls")


# ---------------------------------------------------------------------- the conversation


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda m: m[3].update(tool_call_id="c9"), r"^messages\[3\]\.tool_call_id: matches no tool call"),
        (lambda m: m[3].pop("tool_call_id"), r"^messages\[3\]\.tool_call_id must be a non-empty string"),
        (
            lambda m: m.insert(1, {"role": "tool", "tool_call_id": "c1", "content": "x"}),
            r"^messages\[1\]\.tool_call_id: a tool",
        ),
        (
            lambda m: m[6].update(role="tool", tool_call_id="c1"),
            r"^messages\[6\]\.tool_call_id: a tool message must follow",
        ),
        (
            lambda m: m[2]["tool_calls"][1]["function"].update(arguments=[1]),
            r"^messages\[2\]\.tool_calls\[1\]\.function\.arguments must be a string \(JSON text\) or an object",
        ),
        (
            lambda m: m[2]["tool_calls"][1]["function"].update(arguments="\ud800"),
            r"^messages\[2\]\.tool_calls\[1\]\.function\.arguments: not valid Unicode",
        ),
        (lambda m: m[2]["tool_calls"][1].update(id="c1"), r"^messages\[2\]\.tool_calls\[1\]\.id: another call"),
        (lambda m: m[2]["tool_calls"][0].update(type="code"), r"^messages\[2\]\.tool_calls\[0\]\.type"),
        (
            lambda m: m[2]["tool_calls"][0].pop("function"),
            r"^messages\[2\]\.tool_calls\[0\]\.function must be an object",
        ),
        (lambda m: m[2]["tool_calls"][0]["function"].pop("name"), r"^messages\[2\]\.tool_calls\[0\]\.function\.name"),
        (lambda m: m[2].update(tool_calls="call"), r"^messages\[2\]\.tool_calls must be a non-empty list"),
        (lambda m: m[1].update(tool_calls=[{"id": "x"}]), r"^messages\[1\]\.tool_calls: only assistant messages"),
        (lambda m: m[5].update(content=None), r"^messages\[5\]\.content must be a string"),
        (lambda m: m[3].update(content=None), r"^messages\[3\]\.content must be a string"),
        (lambda m: m[2].update(reasoning_content=1), r"^messages\[2\]\.reasoning_content must be a string"),
        (
            lambda m: m[2]["tool_calls"][0].update(id="\ud800"),
            r"^messages\[2\]\.tool_calls\[0\]\.id: not valid Unicode",
        ),
    ],
)
def test_conversation_errors_name_the_field(change, field):
    messages = json.loads(json.dumps(CONVERSATION))
    change(messages)
    with pytest.raises(ValueError, match=field):
        validate_messages(messages)


# (JSON deeper than the reader allows is a 400: tests/service/test_client_json.py)
@pytest.mark.parametrize("arguments", ['{"city"', "{bad", "[1]", "3", "", "[" * 100 + "]" * 100, "{{{"])
def test_history_arguments_that_are_no_json_object_render_as_they_came(shipped_tok, arguments):
    """Another server's cut call, or one a client edited: OpenAI accepts it, and the templates write its text."""
    messages = json.loads(json.dumps(CONVERSATION))
    messages[2]["tool_calls"][0]["function"]["arguments"] = arguments
    plain = validate_messages(messages)
    assert plain[2]["tool_calls"][0]["function"]["arguments"] == arguments
    call = f"<|tool_call>call:get_weather{arguments}<tool_call|>"
    assert call in render_gemma4(plain, "<bos>", True, False, TOOLS)
    assert call in shipped_tok.apply_chat_template(messages, tools=TOOLS)


def test_conversation_copy_has_object_arguments_and_leaves_the_callers_alone():
    plain = validate_messages(CONVERSATION)
    assert plain[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'
    # an empty tool_calls list is no calls (some clients send one); arguments may already be an object
    assert validate_messages([{"role": "assistant", "content": "x", "tool_calls": []}])
    msgs = [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {"k": 1}}}]}]
    assert validate_messages(msgs)[0]["tool_calls"][0]["function"]["arguments"] == {"k": 1}


def test_history_arguments_text_is_read_once(monkeypatch):
    """The object the bounded reader made from a call's arguments text is kept as is: the text never goes through
    the conversation copy's json round trip again. Arguments given as an object are copied (the caller's own
    object is not handed to the template)."""
    dumped: list[str] = []
    real_dumps = json.dumps

    def recording_dumps(value, *args, **kw):
        dumped.append(real_dumps(value, *args, **kw))
        return dumped[-1]

    given = {"k": [1, 2]}
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": '{"mark":"q7"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "r"},
        {"role": "assistant", "tool_calls": [{"id": "b", "function": {"name": "f", "arguments": given}}]},
    ]
    monkeypatch.setattr(json, "dumps", recording_dumps)
    plain = validate_messages(msgs)
    monkeypatch.undo()
    assert plain[1]["tool_calls"][0]["function"]["arguments"] == {"mark": "q7"}
    assert dumped and not any("q7" in text for text in dumped)  # the text was read by the reader alone
    assert plain[3]["tool_calls"][0]["function"]["arguments"] == given
    assert plain[3]["tool_calls"][0]["function"]["arguments"] is not given
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"mark":"q7"}'  # the caller's untouched


# ---------------------------------------------------------------------- the prompt

EXPECTED = (
    "<bos><|turn>system\nBe brief."
    '<|tool>declaration:get_weather{"description":"The forecast for a city","parameters":'
    + json.dumps(WEATHER_SCHEMA, separators=(",", ":"))
    + "}<tool|>"
    '<|tool>declaration:get_time{"description":"","parameters":'
    + json.dumps(TIME_SCHEMA, separators=(",", ":"))
    + "}<tool|><turn|>\n"
    "<|turn>user\nWeather in Paris, and the time?<turn|>\n"
    "<|turn>model\n"
    '<|tool_call>call:get_weather{"city":"Paris"}<tool_call|><|tool_call>call:get_time{}<tool_call|>'
    '<|tool_response>response:get_time{"value":"12:00"}<tool_response|>'
    '<|tool_response>response:get_weather{"value":"{\\"temp\\": 20}"}<tool_response|>'
    "Sunny, 20 degrees, noon.<turn|>\n"
    "<|turn>user\nThanks<turn|>\n"
)
TOOLS = [WEATHER, {**TIME, "function": {**TIME["function"], "description": ""}}]


@pytest.fixture(scope="module")
def shipped_tok() -> Tokenizer:
    return Tokenizer.from_pretrained(SHIPPED)


def test_builtin_format_renders_tools_and_tool_turns():
    plain = validate_messages(CONVERSATION)
    assert render_gemma4(plain, "<bos>", False, False, TOOLS) == EXPECTED
    assert render_gemma4(plain, "<bos>", True, False, TOOLS) == EXPECTED + "<|turn>model\n<|channel>thought\n<channel|>"
    # after the results, with no text: the model's turn stays open, and the generation prompt is empty
    open_turn = render_gemma4(validate_messages(CONVERSATION[:5]), "<bos>", True, False, TOOLS)
    assert open_turn.endswith('<|tool_response>response:get_weather{"value":"{\\"temp\\": 20}"}<tool_response|>')
    # calls without results yet: the turn ends where the model stops after calling
    pending = render_gemma4(validate_messages(CONVERSATION[:3]), "<bos>", True, False, TOOLS)
    assert pending.endswith("<tool_call|><|tool_response>")
    # tools and no system message: a system turn holds the declarations
    alone = render_gemma4(validate_messages(list(ASK)), "<bos>", True, False, [WEATHER])
    assert (
        alone.startswith("<bos><|turn>system\n<|tool>declaration:get_weather{")
        and "<tool|><turn|>\n<|turn>user\n" in alone
    )
    # reasoning is written back only in the turn after the last user message (not in EXPECTED, where a user follows)
    assert "<|turn>model\n<|channel>thought\nTwo calls.\n<channel|><|tool_call>call:get_weather" in open_turn


@pytest.mark.parametrize("end", [3, 5, 6, 7])
def test_shipped_template_renders_tools_as_the_builtin_format(shipped_tok, end):
    """The shipped model's template (tokenizer_config.json) and the built-in format agree on tools and tool turns
    (the built-in generation prompt adds the empty thought channel, which the shipped template never had)."""
    plain_msgs = CONVERSATION[:end]
    for gen in (False, True):
        ours = render_gemma4(validate_messages(plain_msgs), "<bos>", gen, False, TOOLS)
        theirs = shipped_tok.apply_chat_template(plain_msgs, gen, tools=TOOLS)
        assert theirs == ours.removesuffix("<|channel>thought\n<channel|>")
    no_system = shipped_tok.apply_chat_template(CONVERSATION[1:3], False, tools=TOOLS)
    assert no_system == render_gemma4(validate_messages(CONVERSATION[1:3]), "<bos>", False, False, TOOLS)


def test_shipped_template_without_tools_is_unchanged(shipped_tok):
    chat = shipped_tok.apply_chat_template([{"role": "user", "content": " Who is the king of glory? "}])
    assert chat == "<bos><|turn>user\nWho is the king of glory?<turn|>\n<|turn>model\n"


def test_transformers_renders_the_shipped_template_the_same(shipped_tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(SHIPPED)
    plain = validate_messages(CONVERSATION)
    for end in (3, 5, 7):
        theirs = hf.apply_chat_template(plain[:end], tools=TOOLS, tokenize=False, add_generation_prompt=True)
        assert theirs == shipped_tok.apply_chat_template(CONVERSATION[:end], tools=TOOLS)


def test_checkpoint_template_gets_tools_and_object_arguments(tmp_path):
    (tmp_path / "tokenizer.json").write_text((SHIPPED / "tokenizer.json").read_text())
    (tmp_path / "chat_template.jinja").write_text(
        "{{ tools | length }}|{{ tools[0].function.name }}|{{ messages[2].tool_calls[0].function.arguments.city }}"
        "|{{ messages[3].role }}:{{ messages[3].tool_call_id }}|{{ tools is none }}"
    )
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template(CONVERSATION, tools=TOOLS) == "2|get_weather|Paris|tool:c2|False"
    (tmp_path / "chat_template.jinja").write_text("{{ tools is none }}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(CONVERSATION) == "True"
    with pytest.raises(ValueError, match=r"^tools\[0\] must be"):
        tok.apply_chat_template(CONVERSATION, tools=[{"type": "function"}])


# ---------------------------------------------------------------------- parsing

CALL = '<|tool_call>call:get_weather{"city":"Paris","days":2}<tool_call|>'
TEXTS = [
    ("Hello", "Hello", []),
    (CALL, "", [("get_weather", '{"city":"Paris","days":2}')]),
    (
        "Let me check." + CALL + CALL.replace("Paris", "Oslo"),
        "Let me check.",
        [("get_weather", '{"city":"Paris","days":2}'), ("get_weather", '{"city":"Oslo","days":2}')],
    ),
    (
        '<|tool_call>call:f{"s":"a}b<tool_call|>c","n":{"m":[1,{}]}}<tool_call|>tail',
        "tail",
        [("f", '{"s":"a}b<tool_call|>c","n":{"m":[1,{}]}}')],
    ),
    (
        '<|tool_call>call:f{q:<|"|>say "hi" {x}<|"|>,n:-1.5e2,b:[true,null]}<tool_call|>',
        "",
        [("f", '{"q":"say \\"hi\\" {x}","n":-150.0,"b":[true,null]}')],
    ),
    ("<|tool_call>call:ns.tool-x{}<tool_call|>", "", [("ns.tool-x", "{}")]),
    ("a <|tool_call>oops", "a <|tool_call>oops", []),
    ("a <|tool_call>call:{}", "a <|tool_call>call:{}", []),
    ("a < b <|tool", "a < b <|tool", []),
    ("cut <|tool_call>call:get_w", "cut ", []),
    ('cut <|tool_call>call:f{"a":"x', "cut ", []),  # a call the output ends inside is never a call
    ('<|tool_call>call:f{"a":1}then text', "then text", [("f", '{"a":1}')]),
    ('<|tool_call>call:f{a:<|"|>unread}', "", []),  # a body that is no JSON object is not a call
    ('<|tool_call>call:f{"a":1,}<tool_call|>x', "x", []),
]
# the same parser when the output was cut (finish(cut=True): the budget, the context, a stop or a cancel ended it):
# a held piece of a marker is dropped, never content
CUT_TEXTS = [
    ("Hello", "Hello", []),
    ("a < b <|tool", "a < b ", []),
    ("text <", "text ", []),
    ("cut <|tool_call>", "cut ", []),
    ('<|tool_call>call:f{"a":1}<tool_c', "", [("f", '{"a":1}')]),
    ('<|tool_call>call:f{"a":1}<tool_call|><', "", [("f", '{"a":1}')]),
    ('<|tool_call>call:f{"a":1}<tool_call|><|tool_call>call:f{"a":"x', "", [("f", '{"a":1}')]),
]


def _feed(
    text: str, cuts: list[int], id_seed: bytes = b"s", cut: bool = False
) -> tuple[ToolCallParser, list[str], dict]:
    """Feed ``text`` cut at ``cuts``; returns the parser, the content after each push, and each call as rebuilt from
    its deltas (index → [id, name, arguments])."""
    parser = ToolCallParser(id_seed)
    calls: dict = {}
    pieces = [parser.push(text[a:b]) for a, b in itertools.pairwise([0, *cuts, len(text)])]
    seen = [content for content, _ in pieces]
    pieces.append(parser.finish(cut))
    for _, deltas in pieces:
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.name is not None
                calls[d.index] = [d.id, d.name, d.arguments]
            else:
                calls[d.index][2] += d.arguments
    return parser, seen, calls


@pytest.mark.parametrize("cut, text, content, calls", [(False, *t) for t in TEXTS] + [(True, *t) for t in CUT_TEXTS])
def test_parser_at_every_split_point(cut, text, content, calls):
    whole_content, whole_calls = parse_tool_calls(text, b"s", cut)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole_calls] == calls
    splits = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]  # two pieces at every point; per char
    rng = random.Random(0)
    splits += [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4))) for _ in range(5)]
    for cuts in splits:
        parser, seen, rebuilt = _feed(text, cuts, cut=cut)
        assert parser.content == content and parser.calls == whole_calls, cuts
        assert [tuple(v) for v in rebuilt.values()] == [(c.id, c.name, c.arguments) for c in whole_calls], cuts
        # content streams only what stays content: no piece of a marker that later opens a call
        assert content.startswith("".join(seen)), cuts
        # a call is streamed only whole: no delta of a call that is not returned
        assert len(rebuilt) == len(whole_calls), cuts


def test_calls_of_functions_the_request_may_not_call_are_not_calls():
    parser = ToolCallParser(b"s", names={"get_time"})
    content, deltas = parser.push('<|tool_call>call:get_weather{"city":"Paris"}<tool_call|>')
    assert (content, deltas, parser.calls) == ("", [], [])
    named = ToolSet.from_openai([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named is not None and named.callable_names == {"get_time"}
    auto = ToolSet.from_openai([WEATHER, TIME])
    assert auto is not None and auto.callable_names == {"get_weather", "get_time"}


def test_native_syntax_reader():
    assert read_native('{a:<|"|>x<|"|>,"b":"y",<|"|>c d<|"|>:[1, 2.5 ,{}], e :false}') == {
        "a": "x",
        "b": "y",
        "c d": [1, 2.5, {}],
        "e": False,
    }
    for bad in ["{a:}", "{a 1}", "{a:1", "{a:1}x", "[1 2]", '{a:<|"|>x}', "{a:yes}", "[" * 70 + "]" * 70]:
        with pytest.raises(ValueError):
            read_native(bad)


def test_call_ids_and_delta_shapes():
    seed = call_id_seed(7, [2, 3, 4])
    assert seed == call_id_seed(7, [2, 3, 4]) and seed not in (call_id_seed(8, [2, 3, 4]), call_id_seed(7, [2, 3]))
    ids = [call_id(seed, i) for i in range(3)]
    assert len(set(ids)) == 3 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert ToolCallParser(None)._id_seed != ToolCallParser(None)._id_seed  # random without a seed
    _, deltas = ToolCallParser(seed).push('<|tool_call>call:f{"a":1}<tool_call|>')
    assert [d.to_openai() for d in deltas] == [
        {"index": 0, "id": ids[0], "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a":1}'}},
    ]
    _, calls = parse_tool_calls('<|tool_call>call:f{"a":1}<tool_call|>', seed)
    assert calls[0].to_openai() == {"id": ids[0], "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}


# ---------------------------------------------------------------------- the grammar


@pytest.fixture(scope="module")
def compiler(shipped_tok) -> GrammarCompiler:
    return GrammarCompiler(shipped_tok.to_json(), 2048, [1, 4])


def _accepts(compiler, tok, fmt, text: str) -> tuple[bool, bool]:
    """(every token of ``text`` is allowed, the grammar may end there)."""
    m = compiler.matcher(fmt)
    ok = all(m.consume_token(t) for t in tok.encode(text))
    return ok, ok and m.is_accepting()


@pytest.mark.parametrize(
    "choice, parallel, text, ok, done",
    [
        ("auto", True, "Just text.", True, True),
        ("auto", True, "Text, then " + CALL, True, True),
        ("auto", True, CALL + CALL, True, True),
        ("auto", False, CALL + "<|tool_call>", False, False),
        ("auto", True, CALL + " more text", False, False),
        ("auto", True, 'x <|tool_call>call:get_weather{"city":"Rome"', False, False),
        ("auto", True, 'x <|tool_call>call:get_weather{"city":"Oslo","days":9', False, False),
        ("auto", True, "x <|tool_call>call:get_wind{", False, False),
        ("auto", True, '<|tool_call>call:get_time{"zone":"UTC"}', True, False),
        ("required", True, "Text", False, False),
        ("required", True, "", True, False),
        ("required", True, CALL + '<|tool_call>call:get_time{"zone":"UTC"}<tool_call|>', True, True),
        ("required", False, CALL, True, True),
        ("required", False, CALL + "<|tool_call>", False, False),
        ({"type": "function", "function": {"name": "get_time"}}, True, CALL, False, False),
        (
            {"type": "function", "function": {"name": "get_time"}},
            True,
            '<|tool_call>call:get_time{"zone":"CET"}<tool_call|>',
            True,
            True,
        ),
    ],
)
def test_grammar_admits_exactly_valid_calls(compiler, shipped_tok, choice, parallel, text, ok, done):
    ts = ToolSet.from_openai([WEATHER, TIME], choice, parallel)
    assert ts is not None
    assert _accepts(compiler, shipped_tok, ts.response_format(), text) == (ok, done)


def test_grammar_forces_the_call_and_allows_a_thought_first(compiler, shipped_tok):
    named = ToolSet.from_openai([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named is not None
    m = compiler.matcher(named.response_format())
    assert shipped_tok.decode(m.compute_ff_tokens()) == '<|tool_call>call:get_weather{"city":"'
    required = ToolSet.from_openai([WEATHER, TIME], "required")
    assert required is not None
    thought = "<|channel>thought\nthe forecast <|tool_call> first<channel|>"
    assert _accepts(compiler, shipped_tok, required.response_format(thinking=True), thought + CALL) == (True, True)
    assert _accepts(compiler, shipped_tok, required.response_format(thinking=False), thought) == (False, False)


def test_grammar_errors_name_the_tool(compiler):
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]},
        },
    }
    for choice in ("auto", {"type": "function", "function": {"name": "get_time"}}):
        ts = ToolSet.from_openai([TIME, bad], choice)
        assert ts is not None
        with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters: "):
            compiler.grammar(ts.response_format())


# ---------------------------------------------------------------------- generation on the shipped model


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(SHIPPED)


def _run(engine: Engine, prompt: ChatPrompt, seed: int, max_new_tokens: int = 48):
    """(result, parsed message) of one request; small budgets keep the CPU suite fast."""
    params = engine.default_params(seed=seed, max_new_tokens=max_new_tokens, max_denoising_steps=4)
    req = engine.add(engine.make_request(Submission(prompt, params)))
    while not req.finished:
        engine.step()
    parser = prompt.output_parser(req)
    for block in req.blocks:
        parser.push(block.text)
    parser.finish()
    return req.result(), parser.message()


def _valid(call) -> None:
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("seed", [0, 1])
def test_required_calls_validate(engine, seed):
    prompt = ChatPrompt(ASK, tools=ToolSet.from_openai([WEATHER, TIME], "required", False))
    result, msg = _run(engine, prompt, seed)
    assert result.finish_reason == "eos", result.text
    assert result.text.startswith(TOOL_CALL_BEGIN) and msg.content == "" and len(msg.tool_calls) == 1
    _valid(msg.tool_calls[0])


def test_named_function_is_the_one_called_and_seeded_runs_repeat(engine):
    tools = ToolSet.from_openai([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    prompt = ChatPrompt(ASK, tools=tools)
    first, msg = _run(engine, prompt, 3)
    assert first.finish_reason == "eos" and [c.name for c in msg.tool_calls] == ["get_weather"]
    _valid(msg.tool_calls[0])
    again, msg2 = _run(engine, prompt, 3)
    assert again.token_ids == first.token_ids and msg2 == msg  # same seed and prompt: same call, same id
    other = ChatPrompt((*ASK, {"role": "assistant", "content": "?"}, *ASK), tools=tools)
    _, msg3 = _run(engine, other, 3)
    assert msg3.tool_calls[0].id != msg.tool_calls[0].id  # another conversation: other ids


def test_auto_gives_text_or_valid_calls(engine):
    prompt = ChatPrompt(ASK, tools=ToolSet.from_openai([WEATHER, TIME]))
    for seed in (0, 1):
        result, msg = _run(engine, prompt, seed, max_new_tokens=32)
        assert result.finish_reason in ("eos", "length")
        assert TOOL_CALL_BEGIN not in msg.content
        for call in msg.tool_calls:
            _valid(call)


def test_tools_and_other_constraints_are_refused(engine):
    tools = ToolSet.from_openai([WEATHER])
    prompt = ChatPrompt(ASK, tools=tools)
    fmt = ResponseFormat("json_object")
    for kw, field in [
        ({"response_format": fmt}, "response_format"),
        ({"stop": ("x",)}, "stop"),
        ({"ignore_eos": True}, "ignore_eos"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: cannot be combined with tools"):
            engine.make_request(Submission(prompt, SamplingParams(**kw)))
    none = ChatPrompt(ASK, tools=ToolSet.from_openai([WEATHER], "none"))
    req = engine.make_request(Submission(none, SamplingParams(stop=("x",), max_new_tokens=4)))
    assert req.params.response_format is None and req.params.stop == ("x",)
    assert engine.prompt_ids(none) == engine.prompt_ids(ChatPrompt(ASK))  # "none": nothing declared
    assert len(engine.prompt_ids(prompt)) > len(engine.prompt_ids(none))


# ---------------------------------------------------------------------- markers as special tokens


def test_special_token_markers(special_marker_engine):
    e = special_marker_engine
    assert e.tokenizer is not None
    begin = e.tokenizer.token_to_id(TOOL_CALL_BEGIN)
    assert e._grammar_compiler().special_markers == {"<|tool_call>", "<tool_call|>", "<|channel>", "<channel|>"}
    prompt = ChatPrompt(ASK, tools=ToolSet.from_openai([WEATHER, TIME], "required"))
    result, msg = _run(e, prompt, 0)
    assert result.token_ids[0] == begin  # the marker is one token, and the text keeps it
    assert result.text.startswith(TOOL_CALL_BEGIN + "call:")
    assert msg.tool_calls and msg.content == ""
    for call in msg.tool_calls[:-1] if result.finish_reason == "length" else msg.tool_calls:
        _valid(call)
