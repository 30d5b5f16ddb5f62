"""The real aiohttp app of the gateway over a real GatewayCore (tiny Qwen2.5-VL processor, a
prefill address nothing listens on): every malformed body gets a 4xx naming the field, never
a 5xx (hypothesis), and the rules a body must follow each get their own 400."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from easerve.errors import BadRequest
from easerve.stages.gateway import openai_api as oa
from tests.support.http_api import CHAT, SERVED, http_client, post

COMPLETION = {"model": SERVED, "prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def client(loop, adapter):
    """HttpApi over a real GatewayCore whose stages are not there."""
    from easerve.stages.gateway.core import GatewayCore
    yield from http_client(loop, adapter, GatewayCore)


# ---- invalid values per field ---------------------------------------------------------------
def not_(*kinds):
    """JSON values of every type except `kinds` (int counts as number; bool is not int)."""
    options = {"str": st.text(max_size=5), "int": st.integers(-5, 5), "float": st.floats(-3, 3).filter(
        lambda f: not f.is_integer()), "bool": st.booleans(), "list": st.lists(st.integers(0, 3), max_size=2),
        "dict": st.dictionaries(st.sampled_from("ab"), st.integers(0, 3), max_size=1)}
    drop = set(kinds) | ({"int"} if "float" in kinds else set())
    return st.one_of(*[s for k, s in options.items() if k not in drop])


positive_int_bad = st.one_of(not_("int"), st.integers(max_value=0), st.integers(min_value=1 << 32))
BAD = {  # field -> strategy of values that must be refused
    "model": st.one_of(not_("str"), st.text(max_size=8).filter(lambda s: s != SERVED)),
    "max_tokens": positive_int_bad,
    "max_completion_tokens": positive_int_bad,
    "temperature": st.one_of(not_("float"), st.floats(max_value=-1e-6), st.floats(min_value=2.001),
                             st.just(math.nan), st.just(math.inf)),
    "top_p": st.one_of(not_("float"), st.floats(max_value=0.0), st.floats(min_value=1.0001)),
    "top_k": st.one_of(not_("int"), st.integers(max_value=-2)),
    "seed": st.one_of(not_("int"), st.integers(min_value=1 << 64), st.integers(max_value=-(1 << 63) - 1)),
    "stop": st.one_of(not_("str", "list"), st.lists(st.one_of(st.just(""), st.integers()), min_size=1, max_size=3)),
    "stop_token_ids": st.one_of(not_("list"), st.lists(st.integers(max_value=-1), min_size=1, max_size=2)),
    "ignore_eos": not_("bool"),
    "stream": not_("bool"),
    "stream_options": st.one_of(not_("dict"), st.fixed_dictionaries({"include_usage": not_("bool")})),
    "n": st.one_of(not_("int"), st.integers(max_value=0), st.integers(min_value=17)),  # 1..16 choices
    "timeout": st.one_of(not_("float"), st.floats(max_value=0.0), st.floats(min_value=86400.001)),
    "presence_penalty": st.one_of(not_("float"), st.floats(max_value=-2.001), st.floats(min_value=2.001)),
    "frequency_penalty": st.one_of(not_("float"), st.floats(max_value=-2.001), st.floats(min_value=2.001)),
    "repetition_penalty": st.one_of(not_("float"), st.floats(max_value=0.0), st.floats(min_value=100.001),
                                    st.just(math.nan)),
    "min_p": st.one_of(not_("float"), st.floats(max_value=-1e-6), st.floats(min_value=1.0001)),
    "min_tokens": st.one_of(not_("int"), st.integers(max_value=-1), st.integers(5, 1 << 31)),  # > max_tokens 4
    "logit_bias": st.one_of(not_("dict"), st.dictionaries(st.sampled_from(["a", "-1", "1.5", ""]), st.integers(0, 3),
                                                          min_size=1, max_size=1),
                            st.dictionaries(st.sampled_from(["5", "7"]), st.one_of(
                                st.floats(min_value=100.001), st.floats(max_value=-100.001), not_("float")),
                                min_size=1, max_size=1)),
}
ROLE = st.one_of(not_("str"), st.text(max_size=6).filter(lambda r: r not in ("system", "developer", "user", "assistant")))
BAD_MESSAGES = st.one_of(
    not_("list"), st.just([]), st.lists(not_("dict"), min_size=1, max_size=2),
    st.builds(lambda r: [{"role": r, "content": "hi"}], ROLE),
    st.builds(lambda c: [{"role": "user", "content": c}], st.one_of(not_("str", "list"), st.just([]))),
    st.builds(lambda p: [{"role": "user", "content": [p]}],
              st.one_of(not_("dict", "str"), st.fixed_dictionaries({"type": not_("str")}),
                        st.fixed_dictionaries({"type": st.text(max_size=6).filter(
                            lambda t: t not in ("text", "image_url", "video_url", "input_audio"))}),
                        st.fixed_dictionaries({"type": st.just("text"), "text": not_("str")}),
                        st.fixed_dictionaries({"type": st.just("image_url"), "image_url": not_("dict", "str")}))),
    st.builds(lambda s: [{"role": "user", "content": "ok " + s}], st.sampled_from(["\ud800", "a\udfffb"])),
)
BAD_PROMPT = st.one_of(
    not_("str", "list"), st.just(""), st.just([]), st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
    st.lists(st.text(min_size=1, max_size=3), min_size=2, max_size=3), st.lists(st.floats(0.5, 9), min_size=1),
    st.lists(st.integers(min_value=10_000, max_value=1 << 40), min_size=1, max_size=2),
    st.sampled_from(["x\ud800", ["\udc00"]]))


def check_4xx_naming(status: int, answer: dict, field: str) -> None:
    assert 400 <= status < 500, (status, answer)
    assert answer["error"]["code"] == status and answer["error"]["type"] == "invalid_request_error"
    assert field in answer["error"]["message"], (field, answer["error"]["message"])


PROPERTY = settings(max_examples=int(os.environ.get("EASERVE_HYPOTHESIS_EXAMPLES", 200)), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(case=st.one_of(
    st.sampled_from(sorted(BAD)).flatmap(lambda f: st.tuples(st.just(f), BAD[f])),
    st.tuples(st.just("messages"), BAD_MESSAGES)))
def test_malformed_chat_body_is_a_4xx_naming_the_field(loop, client, case):
    field, value = case
    status, answer = post(loop, client, "/v1/chat/completions", {**CHAT, field: value})
    check_4xx_naming(status, answer, field)


@PROPERTY
@given(case=st.one_of(
    st.sampled_from(sorted(BAD)).flatmap(lambda f: st.tuples(st.just(f), BAD[f])),
    st.tuples(st.just("prompt"), BAD_PROMPT),
    st.tuples(st.just("echo"), st.one_of(not_("bool"), st.just(True))),
    st.tuples(st.just("best_of"), st.one_of(not_("int"), st.integers(max_value=0), st.integers(min_value=2)))))
def test_malformed_completion_body_is_a_4xx_naming_the_field(loop, client, case):
    field, value = case
    status, answer = post(loop, client, "/v1/completions", {**COMPLETION, field: value})
    check_4xx_naming(status, answer, field)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["model", "messages", "prompt", "role", "content", "type", "text",
                                         "max_tokens", "stop", "n", "x"]), inner, max_size=4), max_leaves=12)


@PROPERTY
@given(body=JSON, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
@example(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 255}, path="/v1/chat/completions")
def test_any_json_body_is_never_a_server_error(loop, client, body, path):
    """Arbitrary JSON: a 400, unless the parser accepts it; then the dead prefill gives 503."""
    status, answer = post(loop, client, path, body)
    try:
        if path == "/v1/chat/completions":
            oa.parse_chat_request(body, SERVED, ("image", "video"), None)
        else:
            oa.parse_completion_request(body, SERVED, vocab_size=10_000)
        valid = True
    except BadRequest:
        valid = False
    if valid and status == 400:  # the one rule past the parser: it needs the prompt's token count
        n, m = map(int, re.search(r"prompt \((\d+) tokens\) \+ max_tokens \((\d+)\)",
                                  answer["error"]["message"]).groups())
        assert m == body["max_tokens"] and n + m > 256, (body, answer)
        return
    assert status == (503 if valid else 400), (body, status, answer)


@PROPERTY
@given(raw=st.binary(max_size=64))
def test_any_bytes_are_never_a_server_error(loop, client, raw):
    try:
        json.loads(raw)
        return  # valid JSON is the property above
    except ValueError:
        pass
    status, answer = post(loop, client, "/v1/completions", raw=raw)
    assert status == 400 and "not valid JSON" in answer["error"]["message"]


# ---- one test per rule ------------------------------------------------------------------------
def test_deeply_nested_body_is_a_400(loop, client):
    status, answer = post(loop, client, "/v1/chat/completions", raw=b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested too deeply" in answer["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "cat dog " * 400}]}),
    ("/v1/completions", {**COMPLETION, "prompt": "cat dog " * 400}),
    ("/v1/completions", {**COMPLETION, "prompt": [7] * 300}),
])
def test_prompt_over_the_context_is_a_400_with_both_numbers(loop, client, path, body):
    status, answer = post(loop, client, path, body)
    msg = answer["error"]["message"]
    assert status == 400, answer
    n = int(msg.split("the prompt has ")[1].split()[0])
    assert n > 256 and "max_model_len) is 256" in msg


def test_prompt_plus_max_tokens_over_the_context_is_a_400_saying_how_much_fits(loop, client):
    status, answer = post(loop, client, "/v1/completions", {**COMPLETION, "prompt": [7] * 200, "max_tokens": 100})
    assert status == 400
    assert "prompt (200 tokens) + max_tokens (100)" in answer["error"]["message"]
    assert "at most 56" in answer["error"]["message"]


def test_placeholder_token_ids_are_refused(loop, client, adapter):
    ids = [5, adapter.placeholder_ids["image"], 6]
    status, answer = post(loop, client, "/v1/completions", {**COMPLETION, "prompt": ids})
    assert status == 400 and "image placeholder" in answer["error"]["message"]


def test_valid_bodies_pass_validation_and_reach_the_pipeline(loop, client):
    """The dead prefill address is what answers (503): validation let the body through."""
    for path, body in (("/v1/chat/completions", {**CHAT, "max_completion_tokens": 3, "stream": True}),
                       ("/v1/completions", {**COMPLETION, "prompt": [[5, 6, 7]], "seed": -3}),
                       ("/v1/completions", {**COMPLETION, "prompt": ["Hello"], "stream": True, "n": 1})):
        status, answer = post(loop, client, path, body)
        assert status == 503, (path, answer)


SAMPLING = {"presence_penalty": -1.5, "frequency_penalty": 2, "repetition_penalty": 1.3, "min_p": 0.1,
            "min_tokens": 2, "logit_bias": {"5": -100, "7": 3.5}, "seed": 11, "stop_token_ids": [9], "temperature": 0.8}


@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_vllm_sampling_fields_are_accepted_one_by_one_and_together(loop, client, path, base):
    for body in [*({**base, k: v} for k, v in SAMPLING.items()), {**base, **SAMPLING}]:
        status, answer = post(loop, client, path, body)
        assert status == 503, (body, answer)  # validation let it through to the (dead) prefill


def test_vllm_sampling_fields_reach_sampling_params():
    from easerve.stages.gateway import openai_schema as osc
    sp = oa.sampling_from(osc.ChatBody.model_validate({**CHAT, **SAMPLING}), 16)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p, sp.min_tokens) == \
        (-1.5, 2.0, 1.3, 0.1, 2)
    assert sp.logit_bias == ((5, -100.0), (7, 3.5)) and sp.seed == 11 and sp.stop_token_ids == (9,)


# ---- a stream that ends without a finish reason ----------------------------------------------
@pytest.fixture(scope="module")
def cut_short(loop, adapter):
    """HttpApi over a GatewayCore whose stream breaks the contract: one token, then its end,
    with no finish reason (what a pipeline bug would produce; the real stages cannot)."""
    from easerve.stages.gateway.core import Delta, GatewayCore

    class CutShort(GatewayCore):
        async def generate(self, job):
            yield Delta([5], "Hel")
    yield from http_client(loop, adapter, CutShort)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_a_stream_that_ends_without_a_finish_reason_ends_in_an_error_event_not_a_clean_done(loop, cut_short,
                                                                                            path, body):
    async def go():
        async with cut_short.post(path, json={**body, "stream": True}) as r:
            return r.status, await r.text()
    status, text = loop.run_until_complete(go())
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    assert status == 200 and events[-1] == "[DONE]"
    assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in chunks)  # no fake finish
    assert chunks[-1] == {"error": {"message": "the pipeline ended the stream without a finish reason; the answer "
                                               "is cut short", "type": "server_error", "code": 502}}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_a_unary_answer_without_a_finish_reason_is_a_502(loop, cut_short, path, body):
    status, answer = post(loop, cut_short, path, body)
    assert status == 502 and "without a finish reason" in answer["error"]["message"], answer


# ---- n choices: OpenAI's shapes from the core's deltas --------------------------------------------
@pytest.fixture(scope="module")
def two_choices(loop, adapter):
    """HttpApi over a GatewayCore that answers n = 2 the way `choices.fan_in` does: both first
    tokens, choice 1 ending first, then choice 0 ending the request with the summed usage."""
    from easerve.stages.gateway.core import Delta, GatewayCore

    class TwoChoices(GatewayCore):
        async def generate(self, job):
            assert job.sampling.n == 2
            yield Delta([5], "Hel", index=0)
            yield Delta([6], "Bye", index=1)
            yield Delta([7], "!", "length", index=1)
            yield Delta([8], "lo", "stop", prompt_tokens=9, completion_tokens=4, index=0)
    yield from http_client(loop, adapter, TwoChoices)


def test_two_choices_unary_and_streamed(loop, two_choices):
    status, body = post(loop, two_choices, "/v1/chat/completions", {**CHAT, "n": 2})
    assert status == 200, body
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "Hello", "stop"), (1, "Bye!", "length")]
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (9, 4)

    async def go():
        async with two_choices.post("/v1/completions", json={**COMPLETION, "n": 2, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as r:
            return await r.text()
    events = [e.removeprefix("data: ") for e in loop.run_until_complete(go()).split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    got = [(c["index"], c["text"], c["finish_reason"]) for ch in chunks for c in ch["choices"]]
    assert got == [(0, "Hel", None), (1, "Bye", None), (1, "!", "length"), (0, "lo", "stop")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
