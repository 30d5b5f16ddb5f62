"""Structured outputs and tool calls on a live 2 prefill x 2 decode stack (the tiny random model,
whose free text is never JSON): a JSON-schema answer and forced tool calls, streamed and not,
parsed by the `openai` client's own models; the SDK's structured_outputs; an invalid schema is a
400 naming the problem over HTTP and INVALID_ARGUMENT over gRPC."""
from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from easerve import Client
from easerve.errors import InvalidRequest
from easerve.models.tiny import cached_tiny
from tests.integration.test_multi_instance import _multi

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


class Answer(BaseModel):
    name: str = Field(max_length=6)
    score: int = Field(ge=0, le=9)
    mood: Literal["good", "bad"]


class GetWeather(BaseModel):
    """The weather of a city."""
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=3)


USER = [{"role": "user", "content": "Weather in Paris, as JSON?"}]


@pytest.fixture(scope="module")
def multi(tiny_root):
    stack = _multi(str(cached_tiny("qwen2.5-vl", tiny_root)))
    stack.start(timeout=420)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def oa(multi):
    return openai.OpenAI(base_url=multi.endpoints.openai_base_url, api_key="none", max_retries=0, timeout=120)


def _served(oa) -> str:
    return oa.models.list().data[0].id


def test_json_schema_answers_parse_into_the_clients_model(oa):
    for seed in range(4):  # spread over both prefill and both decode instances
        r = oa.chat.completions.parse(model=_served(oa), messages=USER, response_format=Answer, max_tokens=200,
                                      temperature=1.0, seed=seed)
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Answer)


def test_forced_tool_call_parses_streamed_and_not(oa):
    tool = openai.pydantic_function_tool(GetWeather)
    named = {"type": "function", "function": {"name": "GetWeather"}}
    for seed, choice in ((0, named), (1, "required")):
        r = oa.chat.completions.parse(model=_served(oa), messages=USER, tools=[tool], tool_choice=choice,
                                      max_tokens=200, temperature=1.0, seed=seed)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
    with oa.chat.completions.stream(model=_served(oa), messages=USER, tools=[tool], tool_choice=named,
                                    max_tokens=200, temperature=1.0, seed=5) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather) and call.id.startswith("call_")
    assert final.choices[0].finish_reason == "tool_calls"


def test_invalid_schema_is_a_400_naming_it(oa):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(openai.BadRequestError, match="JSON schema"):
        oa.chat.completions.create(model=_served(oa), messages=USER, response_format=bad, max_tokens=8)


def test_sdk_structured_outputs_and_invalid_argument(multi):
    c = Client(multi.endpoints.grpc, timeout=120)
    for seed in range(2):
        out = c.generate("Pick one.", max_tokens=50, temperature=1.0, seed=seed,
                         structured_outputs={"choice": ["red", "green", "blue"]})
        assert out.text in ("red", "green", "blue")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    out = c.generate("A number?", max_tokens=50, response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema}})
    assert 0 <= json.loads(out.text)["n"] <= 99
    with pytest.raises(InvalidRequest, match="regex is invalid"):
        c.generate("x", max_tokens=4, structured_outputs={"regex": "(unclosed"})
