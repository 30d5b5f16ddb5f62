"""Tools at the OpenAI front: the hermes prompt (tools in the system message, earlier calls and
tool results in Qwen2.5's tags), tool_choice -> the grammar that forces a call, and the answer's
text -> OpenAI's tool_calls, whole and streamed in any chunking."""
from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from easerve.stages.gateway import openai_api as oa
from easerve.stages.gateway.tools import ToolCallStream, split_tool_calls
from easerve.types import StructuredOutput, TextPart

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = {"role": "user", "content": "Weather in Paris?"}


def parse(**body):
    return oa.parse_chat_request({"messages": [USER], **body}, "m", (), None, default_max_tokens=32)


def _text(msg) -> str:
    return "".join(p.text for p in msg.content if isinstance(p, TextPart))


def test_tools_join_the_system_message_and_auto_leaves_the_output_free():
    req = parse(tools=[WEATHER, TIME])
    system = req.messages[0]
    assert system.role == "system" and _text(system).startswith("# Tools\n")
    sigs = _text(system).split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(s)["function"]["name"] for s in sigs] == ["get_weather", "get_time"]
    assert req.sampling.structured is None and req.tools is not None
    kept = oa.parse_chat_request({"messages": [{"role": "system", "content": "Be brief."}, USER], "tools": [TIME]},
                                 "m", (), None)
    assert _text(kept.messages[0]).startswith("Be brief.\n\n# Tools") and len(kept.messages) == 2


def test_none_offers_no_tools_and_parses_nothing():
    req = parse(tools=[WEATHER], tool_choice="none")
    assert req.tools is None and req.messages[0].role == "user" and req.sampling.structured is None


def test_required_and_named_choice_force_a_call_through_the_grammar():
    req = parse(tools=[WEATHER, TIME], tool_choice="required")
    so = req.sampling.structured
    assert so.kind == "tool_calls"
    assert [f["name"] for f in json.loads(so.spec)["functions"]] == ["get_weather", "get_time"]
    named = parse(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(named.sampling.structured.spec) == {
        "functions": [{"name": "get_time", "parameters": {"type": "object"}}]}


def test_earlier_calls_and_tool_results_take_the_hermes_form():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    req = oa.parse_chat_request({"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                                              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                                 "tools": [WEATHER]}, "m", (), None)
    _, user, assistant, tool = req.messages
    assert _text(assistant) == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert tool.role == "user" and _text(tool) == "<tool_response>\nsunny\n</tool_response>"


def test_structured_outputs_of_both_apis():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    rf = parse(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert rf.sampling.structured == StructuredOutput("json", json.dumps(schema))
    assert parse(response_format={"type": "json_object"}).sampling.structured == StructuredOutput("json_object")
    assert parse(structured_outputs={"choice": ["a", "b"]}).sampling.structured == StructuredOutput("choice", '["a", "b"]')
    assert parse(structured_outputs={"regex": "[0-9]+"}).sampling.structured == StructuredOutput("regex", "[0-9]+")
    comp = oa.parse_completion_request({"prompt": "x", "structured_outputs": {"grammar": 'root ::= "a"'}}, "m", 100)
    assert comp.sampling.structured == StructuredOutput("grammar", 'root ::= "a"')


TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_answer_text_becomes_tool_calls():
    content, calls = split_tool_calls(TEXT)
    assert content == "Let me check."
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [(0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert split_tool_calls("no calls <tool") == ("no calls <tool", [])
    assert split_tool_calls("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])


def test_completion_json_shapes_calls_as_openai_does():
    req = parse(tools=[WEATHER])
    body = oa.completion_json(req, TEXT, "stop", {})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather", "get_time"]
    plain = oa.completion_json(parse(), TEXT, "stop", {})["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": TEXT} and plain["finish_reason"] == "stop"


@given(cuts=st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_streamed_in_any_chunking_equals_whole(cuts):
    points = sorted(set(cuts))
    pieces = [TEXT[a:b] for a, b in zip([0, *points], [*points, len(TEXT)])]
    stream, content, calls = ToolCallStream(), "", []
    for piece in pieces:
        content += stream.feed(piece)
        calls += stream.take()
        assert "<tool" not in content  # never shows a tag it may later turn into a call
    content += stream.flush()
    whole_content, whole = split_tool_calls(TEXT)
    assert content.rstrip() == whole_content
    assert [(c["index"], c["function"]) for c in calls] == [(c["index"], c["function"]) for c in whole]
