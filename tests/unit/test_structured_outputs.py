"""Structured outputs on the tiny random-weight model (whose free text is never JSON): for
hypothesis-generated JSON schemas the answer parses and validates every time, greedy and
sampled; regex, choice and grammar hold too; the first token is masked at prefill and decode
goes on from it with a matcher of its own (`InProcessPipeline`: prefill samples the first token, the
engine replays it); an invalid spec is an InvalidRequest naming the problem; the spec crosses
the wire (proto, KV header) unchanged."""
from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from easerve.engine import grammar
from easerve.errors import InvalidRequest
from easerve.types import KVPayload, SamplingParams, StructuredOutput
from easerve.wire.codec import kv_from_parts, kv_to_parts
from easerve.wire.sampling_proto import sampling_from_proto, sampling_to_proto

torch.set_num_threads(1)
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    from easerve.models.tiny import cached_tiny
    from easerve.pipeline import InProcessPipeline

    root = os.environ.get("EASERVE_TINY_CACHE") or str(tmp_path_factory.mktemp("tiny"))
    return InProcessPipeline(str(cached_tiny("qwen2.5-vl", root)))


def _run(pipe, so: StructuredOutput, **sampling):
    sp = SamplingParams(max_tokens=MAX_TOKENS, structured=so, **sampling)
    (out,) = pipe.run([([{"role": "user", "content": "Answer in JSON."}], sp)])
    assert out.finish_reason == "stop", f"{out.finish_reason}: {out.text!r}"
    return out.text


LEAF = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(st.text(alphabet="abcxyz ", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
)
NAMES = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)


def _extend(children):
    return st.one_of(
        st.tuples(children, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
        st.dictionaries(NAMES, children, min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False}))


SCHEMAS = st.recursive(LEAF, _extend, max_leaves=6)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**32))
def test_output_validates_against_generated_schemas(pipe, schema, seed):
    so = StructuredOutput("json", json.dumps(schema))
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": seed}):
        text = _run(pipe, so, **sampling)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_choice_and_grammar_hold(pipe):
    # any object: strings are unbounded, so a bias on '"' and '}' makes the random model close them
    bias = {pipe.lm.tokenizer.convert_tokens_to_ids(t): 30.0 for t in ('"', "}")}
    assert isinstance(json.loads(_run(pipe, StructuredOutput("json_object"), logit_bias=bias)), dict)
    for seed in range(3):
        assert re.fullmatch(r"[a-c]{2,5}-\d{3}", _run(pipe, StructuredOutput("regex", r"[a-c]{2,5}-\d{3}"),
                                                        temperature=1.0, seed=seed))
        assert _run(pipe, StructuredOutput("choice", json.dumps(["yes", "no", 'say "hi"'])),
                    temperature=1.0, seed=seed) in ("yes", "no", 'say "hi"')
        assert re.fullmatch(r"(ab)+!", _run(pipe, StructuredOutput("grammar", 'root ::= ("ab")+ "!"'),
                                            temperature=1.0, seed=seed))


def test_tool_call_grammar_writes_one_hermes_call(pipe):
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
              "required": ["city"], "additionalProperties": False}
    spec = json.dumps({"functions": [{"name": "weather", "parameters": params}, {"name": "time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}]})
    text = _run(pipe, StructuredOutput("tool_calls", spec), temperature=1.0, seed=1)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] in ("weather", "time") and set(call) == {"name", "arguments"}
    if call["name"] == "weather":
        jsonschema.validate(call["arguments"], params)


def test_first_token_is_masked_at_prefill_and_decode_replays_it(pipe):
    """The prefill-side mask alone fixes the first token; a decode-side matcher built from the
    spec accepts it and masks the next step."""
    lm = pipe.lm
    so = StructuredOutput("regex", "xyz")
    g = grammar.Grammars.of(lm)
    state = g.start(so)
    logits = torch.zeros(2, lm.text_config.vocab_size)
    grammar.mask(logits, [state, None])
    allowed = (logits[0] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and all(lm.tokenizer.decode([t]) in ("x", "xy", "xyz") for t in allowed)
    assert (logits[1] == 0).all()  # a row without a grammar is untouched
    decode_side = g.start(so)  # what decode builds: a fresh matcher, then the first token replayed
    assert decode_side.accept(allowed[0]) and not decode_side.accept(allowed[0])  # "x" twice is not "xyz"


@pytest.mark.parametrize("so, words", [
    (StructuredOutput("json", "{not json"), "JSON schema is invalid"),
    (StructuredOutput("json", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'), "JSON schema"),
    (StructuredOutput("regex", "(unclosed"), "regex is invalid"),
    (StructuredOutput("grammar", "root ::= undefined_rule"), "grammar is invalid"),
    (StructuredOutput("choice", "[]"), "choice"),
    (StructuredOutput("tool_calls", '{"functions": []}'), "tools"),
])
def test_invalid_spec_names_the_problem(so, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        grammar.parse(so)


def test_structured_output_checks_and_vllm_shapes():
    with pytest.raises(InvalidRequest, match="kind"):
        StructuredOutput("xml", "x")
    with pytest.raises(InvalidRequest, match="non-empty spec"):
        StructuredOutput("regex", "")
    assert StructuredOutput.from_vllm({"json": {"type": "integer"}}) == StructuredOutput("json", '{"type": "integer"}')
    assert StructuredOutput.from_vllm({"choice": ["a", "b"]}) == StructuredOutput("choice", '["a", "b"]')
    assert StructuredOutput.from_vllm({"json_object": True}) == StructuredOutput("json_object")
    with pytest.raises(InvalidRequest, match="exactly one"):
        StructuredOutput.from_vllm({"regex": "a", "grammar": "root ::= \"a\""})
    assert StructuredOutput.from_response_format({"type": "text"}) is None
    assert StructuredOutput.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "null"}}}) == \
        StructuredOutput("json", '{"type": "null"}')
    with pytest.raises(InvalidRequest, match="response_format"):
        StructuredOutput.from_response_format({"type": "json_schema"})


def test_structured_output_crosses_proto_and_kv_header():
    sp = SamplingParams(max_tokens=9, structured=StructuredOutput("regex", "[0-9]+"))
    assert sampling_from_proto(sampling_to_proto(sp)) == sp
    assert sampling_from_proto(sampling_to_proto(SamplingParams(max_tokens=9))).structured is None
    k = torch.zeros(1, 2, 3, 4)
    payload = KVPayload("r", [k], [k.clone()], 3, 0, 5, sp)
    assert kv_from_parts(*kv_to_parts(payload)).sampling == sp
    assert sp.transforms_logits  # the engine leaves its greedy fast path for it


@pytest.mark.parametrize("bad", ["control", "partial utf-8"])
def test_raw_control_characters_and_broken_utf8_never_enter_json(pipe, bad):
    """xgrammar's length-bounded strings admit raw control characters (JSON forbids them) and
    bytes of unfinished UTF-8 characters: the JSON kinds mask both even when a bias pushes the
    model towards them."""
    tok = pipe.lm.tokenizer
    hit = (lambda t: any(ord(c) < 0x20 for c in t)) if bad == "control" else (lambda t: "\ufffd" in t)
    ids = [i for i in range(len(tok)) if hit(tok.decode([i]))]
    assert ids
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}
    for seed in range(3):
        text = _run(pipe, StructuredOutput("json", json.dumps(schema)), temperature=1.0, seed=seed,
                    logit_bias={t: 100.0 for t in ids[:200]})
        jsonschema.validate(json.loads(text), schema)
