"""A real tiny HF text LM behind the engine hooks of ModelAdapter (tests and bench only).

`build_text_lm(TextLMSpec(...))` makes a random-weight LlamaForCausalLM / Qwen2ForCausalLM,
or a Qwen2.5-VL text decoder (3-D M-RoPE positions) with its own lm_head, plus a tiny
byte-level BPE tokenizer. `TextLMAdapter` runs prefill with a DynamicCache and exposes
embed_tokens / lm_forward / decode_position_ids for `easerve.engine.DecodeEngine`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen2ForCausalLM)
from transformers.models.qwen2_5_vl import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

from easerve.engine.detok import prompt_tail
from easerve.engine.logit_transforms import TokenHistory, penalty_prompt_ids
from easerve.engine.sampler import sample
from easerve.models.base import ModelAdapter
from easerve.policy.prefill_plan import PrefillBatchConfig
from easerve.stages.prefill.loop import PrefillLoop
from easerve.types import KVPayload, PrefillRequest, PrefillResult, ProcessedPrompt, SamplingParams

FAMILIES = ("llama", "qwen2", "qwen2_5_vl")
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a serving system splits encode, prefill and decode into processes",
    "héllo wörld, naïve café; 你好，世界 🙂🚀 ünïcödé",
    "tokens stream back to the client one by one until a stop string",
] * 4


@dataclass(frozen=True)
class TextLMSpec:
    family: str = "llama"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int | None = None      # None: the tiny tokenizer's size
    tokenizer_vocab: int = 320
    init_range: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")

    @classmethod
    def bench(cls, family: str = "llama") -> "TextLMSpec":
        """~57 M parameters: big enough that batching, not Python, decides decode speed."""
        return cls(family, hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1536,
                   vocab=32000, init_range=0.02)


def make_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _config(spec: TextLMSpec, vocab: int):
    common = dict(vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                  num_key_value_heads=spec.kv_heads, max_position_embeddings=4096,
                  initializer_range=spec.init_range, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if spec.family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if spec.family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    half = spec.hidden // spec.heads // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    return Qwen2_5_VLTextConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "mrope_section": section})


def build_text_lm(spec: TextLMSpec = TextLMSpec(), device: str = "cpu",
                  with_tokenizer: bool = True) -> "TextLMAdapter":
    tokenizer = make_tokenizer(spec.tokenizer_vocab) if with_tokenizer else None
    vocab = spec.vocab or len(tokenizer)
    torch.manual_seed(spec.seed)
    cfg = _config(spec, vocab)
    cfg._attn_implementation = "sdpa"
    if spec.family == "qwen2_5_vl":
        model = None  # no text-only *ForCausalLM in transformers for this decoder
        lm = Qwen2_5_VLTextModel(cfg)
        head = torch.nn.Linear(spec.hidden, vocab, bias=False)
        torch.nn.init.normal_(head.weight, std=spec.init_range)
    else:
        model = (LlamaForCausalLM if spec.family == "llama" else Qwen2ForCausalLM)(cfg).to(device).eval()
        lm, head = model.model, model.lm_head
    return TextLMAdapter(lm.to(device).eval(), head.to(device).eval(), tokenizer,
                         mrope=spec.family == "qwen2_5_vl", causal_lm=model)


class TextLMAdapter(ModelAdapter):
    family = "text-lm"
    modalities = ()

    def __init__(self, lm: torch.nn.Module, lm_head: torch.nn.Module, tokenizer, mrope: bool,
                 causal_lm: torch.nn.Module | None = None) -> None:
        self.role = "full"
        self.lm, self.lm_head, self._tokenizer, self.mrope = lm, lm_head, tokenizer, mrope
        self.causal_lm = causal_lm  # the whole *ForCausalLM (for generate), sharing lm / lm_head
        self.config = self.text_config = lm.config
        self.device = next(lm.parameters()).device
        self.dtype = next(lm.parameters()).dtype
        self.generation_eos = lm.config.eos_token_id

    # ---- gateway / encode: text only ---------------------------------------------------------
    def preprocess(self, messages, add_generation_prompt=True) -> ProcessedPrompt:
        text = "".join(p["text"] for m in messages for p in m["content"] if p["type"] == "text")
        return ProcessedPrompt(self._tokenizer.encode(text))

    @property
    def sampling_rate(self):
        return None

    @property
    def tokenizer(self):
        return self._tokenizer

    def encode(self, items):
        raise ValueError("the text LM test adapter takes no media")

    # ---- prefill ------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_ids(self, request_id: str, ids: list[int], position_ids: torch.Tensor | None = None) -> PrefillResult:
        """One prompt; position_ids ([1, T], or [3, 1, T] for M-RoPE) default to 0..T-1."""
        x = torch.tensor([ids], device=self.device)
        if position_ids is None:
            position_ids = self.decode_position_ids(torch.arange(len(ids), device=self.device),
                                                    torch.zeros(len(ids), dtype=torch.long, device=self.device))
            position_ids = position_ids.transpose(-1, -2)  # [.., T, 1] -> [.., 1, T]
        cache = DynamicCache(config=self.text_config)
        out = self.lm(input_ids=x, position_ids=position_ids.to(self.device), cache=cache, use_cache=True)
        logits = self.lm_head(out.last_hidden_state[0, -1])
        delta = int(position_ids.max()) + 1 - len(ids)
        return PrefillResult(request_id, [l.keys[0] for l in cache.layers], [l.values[0] for l in cache.layers],
                             logits, len(ids), delta)

    def prefill(self, reqs: list[PrefillRequest]) -> list[PrefillResult]:
        return [self.prefill_ids(r.request_id, r.input_ids) for r in reqs]

    # ---- engine hooks --------------------------------------------------------------------------
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm.get_input_embeddings()(ids)

    def lm_forward(self, inputs_embeds, position_ids, cache, **attn_kwargs) -> torch.Tensor:
        out = self.lm(inputs_embeds=inputs_embeds, position_ids=position_ids, cache=cache,
                      use_cache=True, **attn_kwargs)
        return self.lm_head(out.last_hidden_state)

    def decode_position_ids(self, positions: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
        pos = (positions + rope_deltas)[:, None]
        return pos[None].expand(3, -1, -1) if self.mrope else pos

    @property
    def language_model(self) -> torch.nn.Module:
        return self.lm

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.lm.parameters(), *self.lm_head.parameters()]


def payload_for(adapter: TextLMAdapter, request_id: str, ids: list[int], sampling: SamplingParams,
                position_ids: torch.Tensor | None = None) -> KVPayload:
    """What a prefill worker hands to decode: prompt KV + the first token (sampler step 0)."""
    res = adapter.prefill_ids(request_id, ids, position_ids)
    first = sample(res.last_logits[None], [sampling], [0], [TokenHistory.start(sampling, ids, adapter.eos_token_ids)])[0]
    return KVPayload(request_id, res.keys, res.values, res.prompt_len, res.rope_delta, first,
                     sampling, prompt_ids_tail=prompt_tail(ids), penalty_ids=penalty_prompt_ids(sampling, ids))


def greedy_ignore_eos(ref, ids: list[int], n: int) -> list[int]:
    """The model's own greedy decode over a DynamicCache: n tokens whatever they are (the
    reference the engine's outputs are compared with)."""
    cache, toks = DynamicCache(config=ref.text_config), []
    with torch.no_grad():
        h = ref.lm(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).last_hidden_state
        for _ in range(n):
            toks.append(int(ref.lm_head(h[0, -1]).argmax()))
            h = ref.lm(input_ids=torch.tensor([[toks[-1]]]), cache=cache, use_cache=True).last_hidden_state
    return toks


def prefill_once(pre, req: PrefillRequest, sp: SamplingParams):
    """`req` with sampling `sp` through a fresh prefill loop: its PrefilledOne."""
    async def prefill():
        loop = PrefillLoop(pre, PrefillBatchConfig())
        loop.start()
        try:
            return await loop.prefill(PrefillRequest(req.request_id, req.input_ids, req.embeddings,
                                                     req.items_meta, sp))
        finally:
            await loop.stop()

    return asyncio.run(prefill())
