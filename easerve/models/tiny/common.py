"""Pieces every tiny-checkpoint builder shares: a byte-level BPE tokenizer trained
offline on a few lines, deterministic seeding, and scale presets.

A tiny checkpoint is a real checkpoint folder (config, safetensors, tokenizer,
processor with chat template) with random weights: `from_pretrained` and
`AutoProcessor.from_pretrained` load it offline exactly like a hub download.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CORPUS = [
    "A picture of a cat sitting on a red mat next to a small dog.",
    "Describe the image. What is in the video? Transcribe the audio clip please.",
    "The quick brown fox jumps over the lazy dog while the sun sets slowly.",
    "user assistant system You are a helpful assistant. Answer briefly and clearly.",
    "0 1 2 3 4 5 6 7 8 9 colors shapes sounds frames speech music noise",
    "Hello world! How are you today? I am fine, thank you. Good morning, good night.",
]

BASE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<s>", "</s>"]

# A ChatML template that understands HF content parts; each family passes its own
# placeholder strings for image / video / audio parts.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' or part['type'] == 'image_url' %}{{ '__IMAGE__' }}"
    "{% elif part['type'] == 'video' or part['type'] == 'video_url' %}{{ '__VIDEO__' }}"
    "{% elif part['type'] == 'audio' or part['type'] == 'input_audio' %}{{ '__AUDIO__' }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_template(image: str = "", video: str = "", audio: str = "") -> str:
    """ChatML with the family's placeholder text for each media part."""
    return (CHATML_TEMPLATE.replace("__IMAGE__", image)
            .replace("__VIDEO__", video).replace("__AUDIO__", audio))


@dataclass(frozen=True)
class Scale:
    """Size preset. `tiny`: a few MB for tests; `bench`: tens of millions of
    parameters so compute, not Python overhead, dominates on a CPU."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    enc_hidden: int
    enc_layers: int
    enc_heads: int
    enc_intermediate: int


SCALES = {
    "tiny": Scale(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                  enc_hidden=32, enc_layers=2, enc_heads=2, enc_intermediate=64),
    "bench": Scale(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536,
                   enc_hidden=384, enc_layers=8, enc_heads=6, enc_intermediate=1536),
}


def scale(name: str) -> Scale:
    if name not in SCALES:
        raise ValueError(f"unknown --scale {name!r}; choose one of {sorted(SCALES)}")
    return SCALES[name]


def build_tokenizer(special_tokens: list[str], vocab_size: int = 384):
    """Byte-level BPE trained on CORPUS, wrapped in PreTrainedTokenizerFast.

    Ids: the base specials come first (0 = <|endoftext|>, 1 = <|im_start|>,
    2 = <|im_end|>, 3 = <pad>, 4 = <s>, 5 = </s>), then the family's specials in the
    given order, then the learned vocabulary. Deterministic for a given input.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = BASE_SPECIALS + [t for t in special_tokens if t not in BASE_SPECIALS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<s>",
        unk_token=None, additional_special_tokens=specials[len(BASE_SPECIALS):])
    return fast


def token_id(tokenizer, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError(f"token {token!r} is not in the tokenizer")
    return int(tid)


def special_ids(tok) -> dict:
    """bos/eos/pad ids for a config, set explicitly (families' defaults point outside a tiny vocab)."""
    return {"bos_token_id": token_id(tok, "<s>"), "eos_token_id": token_id(tok, "<|im_end|>"),
            "pad_token_id": token_id(tok, "<pad>")}


def text_kwargs(sc: Scale, tok) -> dict:
    """The language model's config fields every family shares: sizes from the scale, the
    special ids, a large init range (rare greedy ties)."""
    return dict(vocab_size=len(tok), hidden_size=sc.hidden, intermediate_size=sc.intermediate,
                num_hidden_layers=sc.layers, num_attention_heads=sc.heads, num_key_value_heads=sc.kv_heads,
                max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False,
                **special_ids(tok))


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


def save_model(model, out: Path) -> None:
    """safetensors weights + config; float32 so tiny models are exact on CPU."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
