"""Shared fixtures for the per-family model tests: tiny checkpoints built once per session,
adapters loaded once per (family, role), and the split E -> P -> D greedy loop."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.models.text_lm import TextLMSpec, build_text_lm

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_root):
    """`tiny_checkpoint(family, seed=0)` -> folder, built once per session (cached_tiny)."""
    from easerve.models.tiny import cached_tiny

    return lambda family, seed=0: cached_tiny(family, tiny_root, seed=seed)


@pytest.fixture(scope="session")
def adapters(tiny_checkpoint):
    """`adapters(family, role)` -> adapter over the family's tiny checkpoint, loaded once."""
    from easerve.models.loader import load_adapter

    loaded: dict[tuple[str, str], object] = {}

    def get(family: str, role: str):
        if (family, role) not in loaded:
            loaded[family, role] = load_adapter(tiny_checkpoint(family), role=role)
        return loaded[family, role]

    return get


@pytest.fixture(scope="module")
def full(adapters, request):
    """The unsplit model of the test module's FAMILY."""
    return adapters(request.module.FAMILY, "full")


@pytest.fixture(scope="module")
def enc(adapters, request):
    return adapters(request.module.FAMILY, "encode")


@pytest.fixture(scope="module")
def pre(adapters, request):
    return adapters(request.module.FAMILY, "prefill")


@pytest.fixture
def rng():
    return np.random.RandomState(0)


def random_image(rng, h: int, w: int):
    from PIL import Image

    return Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8))


def random_video(rng, frames: int, h: int, w: int) -> np.ndarray:
    return rng.randint(0, 256, (frames, h, w, 3), dtype=np.uint8)


def audio_clip(rng, seconds: float, rate: int = 16000) -> np.ndarray:
    return (0.1 * rng.standard_normal(int(seconds * rate))).astype(np.float32)


def audio_messages(rng, seconds) -> list[dict]:
    """One user message with a clip per entry of `seconds`, then a text part."""
    return user(*[{"type": "audio", "audio": audio_clip(rng, s)} for s in seconds], "Transcribe the audio.")


def assert_batched_matches_alone(enc, items, atol: float = 1e-5) -> None:
    """Encoding items together gives each item what encoding it alone gives."""
    import torch

    for item, got in zip(items, enc.encode(items)):
        alone = enc.encode([item])[0]
        assert got.shape == (item.num_tokens, enc.text_config.hidden_size) == alone.shape
        torch.testing.assert_close(got, alone, atol=atol, rtol=atol)


def user(*parts) -> list[dict]:
    """One user message from content parts (str -> text part, else a ready dict)."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


def split_greedy(enc, pre, prompt, new_tokens: int = 8) -> list[int]:
    """Encode -> prefill -> decode with a DynamicCache rebuilt from the prefill KV."""
    from easerve.types import PrefillRequest, items_meta

    embeddings = enc.encode(prompt.items)
    req = PrefillRequest("r0", prompt.input_ids, embeddings, items_meta(prompt.items))
    return greedy_from(pre, pre.prefill([req])[0], new_tokens)


def reference_greedy(full, messages, new_tokens: int = 8) -> tuple[list[int], list[int]]:
    """(prompt ids, new tokens) of the unsplit model's `generate(do_sample=False)`
    (fewer than `new_tokens` when it stops at an eos token)."""
    inputs = full.processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_tensors="pt", add_generation_prompt=True)
    with torch.inference_mode():
        out = full.model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    n = inputs["input_ids"].shape[1]
    return inputs["input_ids"][0].tolist(), out[0, n:].tolist()


def assert_audio_split_equals_generate(full, enc, pre, messages, clips: int) -> None:
    """An audio prompt of `clips` clips: the processor's ids are generate's, one item per clip,
    and the split path's greedy tokens equal generate's."""
    prompt = full.preprocess(messages)
    ref_ids, ref = reference_greedy(full, messages)
    assert prompt.input_ids == ref_ids
    assert [i.modality for i in prompt.items] == ["audio"] * clips
    assert ref, "generate produced no tokens"
    assert split_greedy(enc, pre, prompt)[:len(ref)] == ref


@pytest.fixture(scope="session")
def mm():
    """The helpers above as one namespace, for test modules (conftest is not imported)."""
    from types import SimpleNamespace

    return SimpleNamespace(image=random_image, video=random_video, user=user, audio=audio_clip,
                           audio_messages=audio_messages, split_greedy=split_greedy,
                           reference_greedy=reference_greedy, assert_batched_matches_alone=assert_batched_matches_alone,
                           assert_audio_split_equals_generate=assert_audio_split_equals_generate)


@pytest.fixture(scope="session")
def unsupported_checkpoint(tmp_path_factory):
    """A folder holding a saved tiny GPT-2 config (an architecture EAServe does not serve)."""
    from transformers import GPT2Config

    path = tmp_path_factory.mktemp("gpt2")
    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def legacy_copy(tmp_path_factory):
    """`legacy_copy(src, renames)` -> a copy of checkpoint `src` whose tensor names are
    rewritten by the (prefix, replacement) pairs: the pre-transformers-5 hub layout."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    def make(src, renames):
        dst = tmp_path_factory.mktemp("legacy")
        for f in src.iterdir():
            if f.name != "model.safetensors" and f.is_file():
                shutil.copy(f, dst / f.name)
        out = {}
        with safe_open(str(src / "model.safetensors"), "pt") as sf:
            for key in sf.keys():
                new = next((r + key[len(p):] for p, r in renames if key.startswith(p)), key)
                out[new] = sf.get_tensor(key)
        save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return dst

    return make


# media of the mixed prefill batches, per family: each entry is one prompt's parts
# (("image", h, w) / ("video", frames, h, w) / ("audio", seconds)) plus its words of text;
# lengths and media counts differ, and every family has a text-only prompt
MIXED_PROMPTS = {
    "llava-next": [([("image", 60, 90)], 3), ([], 20), ([("image", 64, 64), ("image", 33, 70)], 1),
                   ([("image", 20, 20)], 9)],
    "qwen2.5-vl": [([("image", 60, 90)], 3), ([("video", 4, 56, 56)], 1), ([], 20),
                   ([("image", 30, 30), ("video", 2, 40, 60), ("image", 84, 56)], 6)],
    "qwen2-audio": [([("audio", 0.5)], 2), ([], 20), ([("audio", 0.3), ("audio", 1.5)], 5), ([("audio", 1.0)], 9)],
    "ultravox": [([("audio", 0.77)], 2), ([], 20), ([("audio", 0.3), ("audio", 2.5)], 5), ([("audio", 0.2)], 9)],
}
WORDS = "please describe what you can see or hear in this input in a few short and clear words".split()


def _media_part(rng, spec) -> dict:
    kind = spec[0]
    if kind == "image":
        return {"type": "image", "image": random_image(rng, *spec[1:])}
    if kind == "video":
        return {"type": "video", "video": random_video(rng, *spec[1:])}
    return {"type": "audio", "audio": audio_clip(rng, spec[1])}


@pytest.fixture(scope="session")
def mixed_requests(adapters):
    """`mixed_requests(family)` -> PrefillRequests of MIXED_PROMPTS[family] (embeddings from
    the family's encode adapter), built once per family."""
    from easerve.types import PrefillRequest, items_meta

    built: dict[str, list] = {}

    def get(family: str) -> list:
        if family not in built:
            rng, full, enc = np.random.RandomState(1), adapters(family, "full"), adapters(family, "encode")
            reqs = []
            for k, (media, words) in enumerate(MIXED_PROMPTS[family]):
                text = " ".join(WORDS[(k + j) % len(WORDS)] for j in range(words))
                prompt = full.preprocess(user(*[_media_part(rng, s) for s in media], text))
                reqs.append(PrefillRequest(f"{family}-{k}", prompt.input_ids, enc.encode(prompt.items),
                                           items_meta(prompt.items)))
            built[family] = reqs
        return list(built[family])

    return get


def greedy_from(pre, res, new_tokens: int = 6) -> list[int]:
    """Greedy tokens decoded from a PrefillResult's KV with a plain DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in zip(res.keys, res.values)],
                         config=pre.text_config)
    tokens = [int(res.last_logits.argmax())]
    for k in range(new_tokens - 1):
        pos = pre.decode_position_ids(torch.tensor([res.prompt_len + k]), torch.tensor([res.rope_delta]))
        logits = pre.lm_forward(pre.embed_tokens(torch.tensor([[tokens[-1]]])), pos, cache)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


@pytest.fixture(scope="session")
def decode_greedy():
    """`decode_greedy(pre, result, n)`: greedy_from above, for test modules."""
    return greedy_from


@pytest.fixture(scope="module")
def llama():
    """A tiny random text-only Llama (tests/models/text_lm.py, seed 4)."""
    return build_text_lm(TextLMSpec(family="llama", seed=4))


@pytest.fixture(scope="module")
def ref(llama):
    """A copy of `llama` that keeps plain sdpa attention: the reference its outputs are compared with."""
    return copy.deepcopy(llama)
