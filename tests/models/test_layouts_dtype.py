"""bf16 / fp16 weights: every role loads in the dtype asked for (CPU included), and a bf16 / fp16
split E -> P gives finite logits; fp32 stays the CPU default; `--dtype` reaches every stage."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.layouts import messages_for


@pytest.fixture(scope="module")
def half(tiny_checkpoint):
    from easerve.models.loader import load_adapter

    cache = {}

    def get(family, role, dtype):
        if (family, role, dtype) not in cache:
            cache[family, role, dtype] = load_adapter(tiny_checkpoint(family), role=role, dtype=dtype)
        return cache[family, role, dtype]
    return get


@pytest.mark.parametrize("family, dtype", [("qwen2.5-vl", "bfloat16"), ("llava-next", "bfloat16"),
                                           ("qwen2-audio", "bfloat16"), ("ultravox", "bfloat16"),
                                           ("qwen2.5-vl", "float16")])
def test_half_precision_split_prefill_on_cpu_gives_finite_logits(half, mm, family, dtype):
    from easerve.types import PrefillRequest, items_meta

    want = getattr(torch, dtype)
    enc, pre = half(family, "encode", dtype), half(family, "prefill", dtype)
    assert {p.dtype for p in enc.parameters()} == {want} == {p.dtype for p in pre.parameters()}
    prompt = enc.preprocess(messages_for(family, mm, np.random.RandomState(0)))
    embeddings = enc.encode(prompt.items)
    assert embeddings and all(e.dtype == want for e in embeddings)
    res = pre.prefill([PrefillRequest("r", prompt.input_ids, embeddings, items_meta(prompt.items))])[0]
    assert res.keys[0].dtype == want and res.last_logits.dtype == torch.float32
    assert torch.isfinite(res.last_logits).all() and res.last_logits.abs().max() > 0


def test_fp32_is_the_cpu_default_and_auto_means_it(adapters, half):
    assert {p.dtype for p in adapters("qwen2.5-vl", "prefill").parameters()} == {torch.float32}
    assert {p.dtype for p in half("qwen2.5-vl", "prefill", "auto").parameters()} == {torch.float32}


def test_unknown_dtype_is_refused(tiny_checkpoint):
    from easerve.models.loader import load_adapter

    with pytest.raises(ValueError, match="int8.*auto or one of"):
        load_adapter(tiny_checkpoint("qwen2.5-vl"), role="prefill", dtype="int8")


@pytest.mark.parametrize("stage", ["decode", "prefill", "encode", "gateway"])
def test_every_stage_takes_dtype(stage):

    from easerve.stages.common.cli import dtype_of

    from easerve.stages.common.configs import STAGE_CONFIGS

    from easerve.stages.common.argv import from_argv

    extra = {"decode": [], "prefill": ["--decode", "h:1"], "encode": ["--prefill", "h:1"],
             "gateway": ["--prefill", "h:1", "--decode", "h:2"]}[stage]
    args = from_argv(STAGE_CONFIGS[stage], stage, ["--model", "m", "--dtype", "bfloat16", *extra])
    assert dtype_of(args.dtype) is torch.bfloat16
    default = from_argv(STAGE_CONFIGS[stage], stage, ["--model", "m", *extra])
    assert default.dtype == "auto" and dtype_of(default.dtype) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", ["llava-next", "qwen2.5-vl", "qwen2-audio", "ultravox"])
def test_half_precision_on_gpu_split_equals_generate(tiny_checkpoint, mm, family, dtype):
    """On a GPU, in bf16 and fp16: split E -> P -> D greedy equals the unsplit model's generate."""
    from easerve.models.loader import load_adapter

    path = tiny_checkpoint(family)
    full, enc, pre = (load_adapter(path, role=r, device="cuda:0", dtype=dtype) for r in ("full", "encode", "prefill"))
    assert {p.dtype for p in pre.parameters()} == {getattr(torch, dtype)}
    assert all(p.device.type == "cuda" for p in enc.parameters())
    messages = messages_for(family, mm, np.random.RandomState(1))
    inputs = full.processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                                add_generation_prompt=True).to("cuda:0")
    with torch.inference_mode():
        out = full.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    ref = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert ref and mm.split_greedy(enc, pre, full.preprocess(messages), 6)[:len(ref)] == ref
