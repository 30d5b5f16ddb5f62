"""POST /v1/completions on a live stack (real processes), through the openai package: text and
token-id prompts, streamed and not, equal the in-process runtime's greedy tokens; the inputs a new
user tries first get a 400 on both APIs (HTTP and gRPC), never a 500."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from easerve import Client
from easerve.errors import InvalidRequest
from easerve.pipeline import InProcessPipeline
from easerve.types import ProcessedPrompt, SamplingParams

pytestmark = pytest.mark.slow
N = 6
TEXT = "The quick brown fox"


@pytest.fixture(scope="module")
def pipe(vl_stack):
    return InProcessPipeline(vl_stack.deployment.model)


def reference(pipe, ids: list[int]) -> list[int]:
    """Greedy tokens of the in-process E -> P -> D runtime for a raw token prompt."""
    rid, _ = pipe.start(ProcessedPrompt(input_ids=list(ids)), SamplingParams(max_tokens=N))
    out = []
    while pipe.engine.has_work:
        out += [o.token_id for o in pipe.engine.step() if o.request_id == rid and o.token_id is not None]
    return out


@pytest.fixture(scope="module")
def oa(vl_stack):
    from openai import OpenAI
    return OpenAI(base_url=vl_stack.endpoints.openai_base_url, api_key="none", max_retries=0)


def test_text_prompt_unary_and_streamed(vl_stack, pipe, oa):
    served = oa.models.list().data[0].id
    ids = pipe.encoder.preprocess_prompt(TEXT).input_ids
    want = reference(pipe, ids)
    want_text = pipe.lm.tokenizer.decode(want, skip_special_tokens=True)
    r = oa.completions.create(model=served, prompt=TEXT, max_tokens=N, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == want_text and r.choices[0].index == 0
    assert r.choices[0].finish_reason == ("length" if len(want) == N else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    chunks = list(oa.completions.create(model=served, prompt=[TEXT], max_tokens=N, temperature=0, stream=True,
                                        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
    assert chunks[-1].usage.completion_tokens == len(want) and not chunks[-1].choices


def test_token_id_prompt(vl_stack, pipe, oa):
    served = oa.models.list().data[0].id
    ids = pipe.encoder.preprocess_prompt("Hello world! How are you").input_ids
    want = reference(pipe, ids)
    r = oa.completions.create(model=served, prompt=ids, max_tokens=N, temperature=0)
    assert r.choices[0].text == pipe.lm.tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids)


def _post(url: str, body) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["message"]


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": "x"}, "seed: "),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, "seed: "),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "invalid unicode"),
    ("/v1/completions", {"prompt": "hi \udfff"}, "invalid unicode"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n: Input should be less than or equal to 16"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n: "),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "dog " * 9000}, "context length (max_model_len) is"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "dog " * 9000}]}, "context length"),
])
def test_a_new_users_mistakes_are_400s(vl_stack, path, body, needle):
    status, message = _post(vl_stack.endpoints.http + path, body)
    assert status == 400 and needle in message, (status, message)


def test_prompt_over_the_context_is_invalid_argument_on_grpc(vl_stack):
    with pytest.raises(InvalidRequest, match=r"the prompt has \d+ tokens but .* is \d+"):
        Client(vl_stack.endpoints.grpc, timeout=60).generate("dog " * 9000, max_tokens=4)
    with pytest.raises(InvalidRequest, match=r"prompt \(\d+ tokens\) \+ max_tokens \(4000\)"):
        Client(vl_stack.endpoints.grpc, timeout=60).generate("dog " * 200, max_tokens=4000)
