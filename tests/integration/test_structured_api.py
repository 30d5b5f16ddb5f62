"""Structured outputs, tool calls and n > 1 choices on a live 2 prefill x 2 decode stack (the tiny
random model, whose free text is never JSON): a JSON-schema answer and forced tool calls, streamed
and not, parsed by the `openai` client's own models; the SDK's structured_outputs; an invalid schema
is a 400 naming the problem over HTTP and INVALID_ARGUMENT over gRPC; n = 3 choices (each with its
own grammar state) parsed by the same models, streamed and not, with usage summed over the choices;
a seeded n = 3 request answers the same on both decode instances, over HTTP and the SDK."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import pytest
from pydantic import BaseModel, Field

from easerve import Client
from easerve.errors import InvalidRequest
from easerve.wire.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.multi_stack import kv_received

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


# ---- n > 1: one prefill, n decodes sharing the prompt's KV --------------------------------------------
def test_three_choices_parse_into_the_clients_models_with_usage_summed(oa):
    r = oa.chat.completions.parse(model=_served(oa), messages=USER, response_format=Answer, max_tokens=200,
                                  temperature=1.0, seed=11, n=3, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason == "stop" and isinstance(c.message.parsed, Answer) for c in r.choices)
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    one = oa.chat.completions.create(model=_served(oa), messages=USER, max_tokens=2)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    tool = openai.pydantic_function_tool(GetWeather)
    t = oa.chat.completions.parse(model=_served(oa), messages=USER, tools=[tool], tool_choice="required",
                                  max_tokens=200, temperature=1.0, seed=2, n=2)
    assert [c.finish_reason for c in t.choices] == ["tool_calls"] * 2
    assert all(isinstance(c.message.tool_calls[0].function.parsed_arguments, GetWeather) for c in t.choices)


def test_streamed_choices_end_once_each_and_equal_the_unary_answer(oa):
    kw = dict(model=_served(oa), messages=USER, max_tokens=12, temperature=1.0, seed=5, n=3)
    whole = oa.chat.completions.create(**kw)
    text, finish, usage = {}, {}, None
    for chunk in oa.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_seeded_three_choices_equal_on_both_decode_instances_and_through_the_sdk(multi, oa):
    names = ("decode-0", "decode-1")
    before = {n: sum(kv_received(multi, n).values()) for n in names}

    def ask(_):
        r = oa.chat.completions.create(model=_served(oa), messages=USER, max_tokens=10, temperature=1.0,
                                       seed=42, n=3, extra_body={"ignore_eos": True})
        return [(c.index, c.message.content, c.finish_reason) for c in r.choices]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(6)))
    after = {n: sum(kv_received(multi, n).values()) for n in names}
    assert all(after[n] > before[n] for n in names), (before, after)  # both decode instances forked some
    assert all(a == answers[0] for a in answers)
    assert len({text for _, text, _ in answers[0]}) == 3  # seed + i: the choices differ
    sdk = Client(multi.endpoints.grpc, timeout=120).generate(messages=USER, max_tokens=10, temperature=1.0, seed=42,
                                                           n=3, ignore_eos=True)
    assert [c.text for c in sdk] == [text for _, text, _ in answers[0]]
    assert sdk[0].usage.completion_tokens == sum(len(c.token_ids) for c in sdk) == 30


def test_bad_n_is_a_400_or_invalid_argument_naming_it(multi, oa):
    with pytest.raises(openai.BadRequestError, match="n: Input should be less than or equal to 16"):
        oa.chat.completions.create(model=_served(oa), messages=USER, max_tokens=4, n=17)
    with pytest.raises(openai.BadRequestError, match="n = 16 choices"):  # more than decode's 8 slots could hold
        oa.chat.completions.create(model=_served(oa), messages=USER, max_tokens=4, n=16)
    with grpc.insecure_channel(multi.endpoints.grpc) as ch:
        req = gateway_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(max_tokens=4, n=17))
        with pytest.raises(grpc.RpcError) as e:
            list(gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be an integer in 1..16" in e.value.details()
