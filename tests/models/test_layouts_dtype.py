"""bf16 / fp16 weights: every role loads in the dtype asked for (CPU included), and a bf16 / fp16
split E -> P gives finite logits; fp32 stays the CPU default; `--dtype` reaches every stage."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.test_layouts import messages_for


@pytest.fixture(scope="module")
def half(tiny_checkpoint):
    from easerve.models.registry import load_adapter

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
    from easerve.types import PrefillRequest

    want = getattr(torch, dtype)
    enc, pre = half(family, "encode", dtype), half(family, "prefill", dtype)
    assert {p.dtype for p in enc.parameters()} == {want} == {p.dtype for p in pre.parameters()}
    prompt = enc.preprocess(messages_for(family, mm, np.random.RandomState(0)))
    embeddings = enc.encode(prompt.items)
    assert embeddings and all(e.dtype == want for e in embeddings)
    res = pre.prefill([PrefillRequest("r", prompt.input_ids, embeddings, [(i.modality, i.meta) for i in prompt.items])])[0]
    assert res.keys[0].dtype == want and res.last_logits.dtype == torch.float32
    assert torch.isfinite(res.last_logits).all() and res.last_logits.abs().max() > 0


def test_fp32_is_the_cpu_default_and_auto_means_it(adapters, half):
    assert {p.dtype for p in adapters("qwen2.5-vl", "prefill").parameters()} == {torch.float32}
    assert {p.dtype for p in half("qwen2.5-vl", "prefill", "auto").parameters()} == {torch.float32}


def test_unknown_dtype_is_refused(tiny_checkpoint):
    from easerve.models.registry import load_adapter

    with pytest.raises(ValueError, match="int8.*auto or one of"):
        load_adapter(tiny_checkpoint("qwen2.5-vl"), role="prefill", dtype="int8")


@pytest.mark.parametrize("stage", ["decode", "prefill", "encode", "gateway"])
def test_every_stage_takes_dtype(stage):
    import importlib

    from easerve.stages.cli import dtype_of

    extra = {"decode": [], "prefill": ["--decode", "h:1"], "encode": ["--prefill", "h:1"],
             "gateway": ["--prefill", "h:1"]}[stage]
    args = importlib.import_module(f"services.{stage}.__main__").parse(["--model", "m", "--dtype", "bfloat16", *extra])
    assert dtype_of(args.dtype) is torch.bfloat16
    default = importlib.import_module(f"services.{stage}.__main__").parse(["--model", "m", *extra])
    assert default.dtype == "auto" and dtype_of(default.dtype) is None
