"""Ultravox from transformers core classes: the upstream checkpoint layout loads with no
`trust_remote_code`.

Upstream (fixie-ai/ultravox) ships Ultravox as hub remote code. The model is a Whisper encoder
(`audio_tower.*`), a frame-stacking SwiGLU projector (`multi_modal_projector.*`) and a Llama
LM (`language_model.model.*`, `language_model.lm_head.*`); config fields as upstream
(`audio_config`, `text_config`, `stack_factor`, `projector_act`, `projector_ln_mid`, ...).
Importing this module registers `UltravoxConfig` / `UltravoxModel` / `UltravoxProcessor`
with AutoConfig, AutoModel, AutoModelForCausalLM and AutoProcessor.

Differences from upstream, on purpose: audio positions are found by `audio_token_index`
(the processor expands `<|audio|>` into that many `<|audio|>` tokens instead of EOS
tokens); the encoder zeroes padding frames before and after its convolutions, so a clip
encodes to the same rows whether it is batched with longer clips or alone.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoProcessor,
                          PreTrainedConfig, PreTrainedModel)
from transformers import initialization as init
from transformers.configuration_utils import SubConfigSpec
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.whisper.modeling_whisper import WhisperEncoder
from transformers.processing_utils import ProcessorMixin
from easerve.errors import InvalidRequest

AUDIO_PLACEHOLDER = "<|audio|>"
AUDIO_KEYS = ("audio_values", "audio_lens", "audio_token_len", "audio_num_chunks")
# what upstream's UltravoxProcessor returns besides input_ids / attention_mask / audio_values / audio_lens /
# audio_token_len: where each chunk's tokens start, and chunks per sample (its input_ids hold the
# tokenizer's EOS token at the audio positions instead of an audio token)
UPSTREAM_KEYS = ("audio_token_start_idx", "audio_batch_size")


class UltravoxConfig(PreTrainedConfig):
    model_type = "ultravox"
    sub_configs_defaults = {
        "audio_config": SubConfigSpec(config_class=AutoConfig, model_type="whisper"),
        "text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama"),
    }
    audio_config: dict | PreTrainedConfig | None = None
    text_config: dict | PreTrainedConfig | None = None
    audio_model_id: str | None = None
    text_model_id: str | None = None
    ignore_index: int = -100
    audio_token_index: int | None = None
    hidden_size: int = 4096
    stack_factor: int = 8
    norm_init: float = 0.4
    projector_act: str = "swiglu"
    projector_ln_mid: bool = False
    text_model_lora_config: dict | None = None
    audio_model_lora_config: dict | None = None
    audio_latency_block_size: int | None = None
    vocab_size: int | None = None
    initializer_range: float | None = None
    tie_word_embeddings: bool | None = None

    def __post_init__(self, **kwargs):
        for kind in ("text", "audio"):  # published v0.5 layout: the sub-models by reference
            model_id = getattr(self, f"{kind}_model_id")
            if getattr(self, f"{kind}_config") is None and model_id is not None:
                setattr(self, f"{kind}_config", AutoConfig.from_pretrained(referenced_folder(model_id, kind)))
        super().__post_init__(**kwargs)
        text = self.text_config
        self.vocab_size = text.vocab_size if self.vocab_size is None else self.vocab_size
        self.initializer_range = self.initializer_range or text.initializer_range
        if self.tie_word_embeddings is None:
            self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False))


def referenced_folder(model_id: str, kind: str, weights: bool = False) -> str:
    """The local folder an Ultravox config's `audio_model_id` / `text_model_id` names: a folder, or
    a hub id fetched (its config files, and with `weights` its safetensors) by easerve.models.hub."""
    from easerve.models.hub import HubModelError, parse_hub_id, resolve_model
    if parse_hub_id(model_id):
        try:
            return str(resolve_model(model_id, ("full",) if weights else ("processor",)))
        except HubModelError as e:
            raise HubModelError(f"this Ultravox config names {kind}_model_id={model_id!r}, which is not a local "
                                f"checkpoint folder: {e}") from e
    if not Path(model_id, "config.json").is_file():
        raise ValueError(
            f"this Ultravox config names {kind}_model_id={model_id!r}, which is neither a local checkpoint folder "
            f"nor a hub id: set {kind}_model_id in the Ultravox config.json to one")
    return str(model_id)


class UltravoxWhisperEncoder(WhisperEncoder):
    """Whisper's encoder taking mel inputs up to its context (not exactly 30 s), with
    padding frames (beyond `audio_len`) masked in attention and zeroed around the convs."""

    @property
    def max_context_length(self) -> int:
        return self.config.max_source_positions * self.conv1.stride[0] * self.conv2.stride[0]

    def forward(self, input_features: torch.Tensor, audio_len: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutput:
        b, _, t = input_features.shape
        if t > self.max_context_length:
            raise InvalidRequest(f"mel input has {t} frames but this Whisper encoder takes at most "
                             f"{self.max_context_length}; split the audio into chunks (the processor does)")
        if audio_len is None:
            audio_len = torch.full((b,), t, dtype=torch.long, device=input_features.device)
        x = input_features.to(self.conv1.weight.dtype) * _keep(audio_len, t)[:, None, :]
        x = F.gelu(self.conv1(x)) * _keep(audio_len, t)[:, None, :].to(x.dtype)
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        out_len = self._get_feat_extract_output_lengths(audio_len)
        x = x + self.embed_positions.weight[: x.shape[1]]
        keep = _keep(out_len, x.shape[1])
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=x, attention_mask=keep)
        for layer in self.layers:
            x = layer(x, mask, **kwargs)
        x = self.layer_norm(x) * keep[..., None].to(x.dtype)
        return BaseModelOutput(last_hidden_state=x)


def _keep(lengths: torch.Tensor, t: int) -> torch.Tensor:
    """[B] lengths -> [B, t] 1/0 mask (long) of the frames inside each length."""
    return (torch.arange(t, device=lengths.device)[None, :] < lengths.view(-1, 1)).long()


class RMSNorm(LlamaRMSNorm):
    """Upstream's projector norm (a Llama RMSNorm whose weight starts at `norm_init`)."""

    def __init__(self, hidden_size: int, init: float = 1.0, eps: float = 1e-6):
        super().__init__(hidden_size, eps=eps)
        self.init_value = init
        with torch.no_grad():
            self.weight.fill_(init)


class SwiGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class UltravoxProjector(nn.Module):
    """Stack `stack_factor` encoder frames, RMSNorm, Linear, SwiGLU, (ln_mid), Linear, (ln_post)."""

    def __init__(self, config: UltravoxConfig):
        super().__init__()
        if config.projector_act != "swiglu":
            raise ValueError(f"projector_act={config.projector_act!r} is not supported; Ultravox "
                             "checkpoints EAServe loads use 'swiglu'")
        self.stack_factor = config.stack_factor
        dim_in = config.audio_config.d_model * config.stack_factor
        dim_mid, dim_out = config.hidden_size // 2, config.text_config.hidden_size
        self.ln_pre = RMSNorm(dim_in, init=config.norm_init)
        self.linear_1 = nn.Linear(dim_in, config.hidden_size, bias=False)
        self.act = SwiGLU()
        self.linear_2 = nn.Linear(dim_mid, dim_out, bias=False)
        mid = config.projector_ln_mid  # v0.5+: norm after the first linear; v0.4.1-: after the last
        self.ln_mid = RMSNorm(dim_mid, init=config.norm_init) if mid else nn.Identity()
        self.ln_post = nn.Identity() if mid else RMSNorm(dim_out, init=config.norm_init)

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        pad = math.ceil(t / self.stack_factor) * self.stack_factor - t
        x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(b, -1, c * self.stack_factor)

    def forward(self, audio_features: torch.Tensor) -> torch.Tensor:
        h = self.linear_1(self.ln_pre(self.stack(audio_features)))
        return self.ln_post(self.linear_2(self.ln_mid(self.act(h))))


def upstream_audio_mask(input_ids: torch.Tensor, start_idx: torch.Tensor, token_len: torch.Tensor) -> torch.Tensor:
    """[1, L] mask of the audio positions upstream's processor marks by start index and length."""
    if input_ids.shape[0] != 1:
        raise InvalidRequest("upstream Ultravox processor outputs hold one sample; send one prompt at a time")
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for start, n in zip(start_idx.tolist(), token_len.tolist()):
        if start < 0 or start + n > input_ids.shape[1]:
            raise InvalidRequest(f"audio_token_start_idx {start} + audio_token_len {n} lies outside the "
                             f"{input_ids.shape[1]}-token prompt; pass the processor's outputs unchanged")
        mask[0, start:start + n] = True
    return mask


def upstream_to_native(out, audio_token_id: int) -> dict:
    """Upstream UltravoxProcessor outputs (one sample) -> this module's: the audio positions get
    `audio_token_id`, and chunks whose tokens follow each other form one clip (`audio_num_chunks`)."""
    start, n = out["audio_token_start_idx"].reshape(-1), out["audio_token_len"].reshape(-1)
    ids = out["input_ids"].clone()
    ids[upstream_audio_mask(ids, start, n)] = audio_token_id
    counts = []
    for k in range(len(start)):
        follows = k > 0 and int(start[k]) == int(start[k - 1] + n[k - 1])
        if follows:
            counts[-1] += 1
        else:
            counts.append(1)
    return {"input_ids": ids, "audio_values": out["audio_values"], "audio_lens": out["audio_lens"].reshape(-1),
            "audio_token_len": n, "audio_num_chunks": torch.tensor(counts)}


def audio_token_lengths(audio_lens: torch.Tensor, stack_factor: int) -> torch.Tensor:
    """Upstream's rule: ceil(mel frames / (2 * stack_factor)) tokens per chunk."""
    return torch.div(audio_lens + 2 * stack_factor - 1, 2 * stack_factor, rounding_mode="floor")


class UltravoxModel(PreTrainedModel):
    config_class = UltravoxConfig
    config: UltravoxConfig
    base_model_prefix = "ultravox"
    main_input_name = "input_ids"
    input_modalities = ("audio", "text")
    _no_split_modules = ["WhisperEncoderLayer", "LlamaDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    _tied_weights_keys = {"language_model.lm_head.weight": "language_model.model.embed_tokens.weight"}

    def __init__(self, config: UltravoxConfig):
        super().__init__(config)
        self.audio_tower = UltravoxWhisperEncoder(config.audio_config)
        self.multi_modal_projector = UltravoxProjector(config)
        self.language_model = AutoModelForCausalLM.from_config(config.text_config)
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, RMSNorm):
            init.constant_(module.weight, module.init_value)
        else:
            super()._init_weights(module)

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def get_audio_features(self, audio_values: torch.Tensor, audio_lens: torch.Tensor,
                           audio_token_len: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Chunks [N, mels, T] (+ mel lengths [N]) -> one [tokens, hidden] tensor per chunk."""
        hidden = self.audio_tower(audio_values, audio_len=audio_lens).last_hidden_state
        embeds = self.multi_modal_projector(hidden)
        if audio_token_len is None:
            audio_token_len = audio_token_lengths(audio_lens, self.config.stack_factor)
        return [e[: int(n)] for e, n in zip(embeds, audio_token_len)]

    def embed_prompt(self, input_ids: torch.Tensor, audio_values=None, audio_lens=None,
                     audio_token_len=None, audio_token_start_idx=None, **_: object) -> torch.Tensor:
        """Token embeddings with every audio chunk's rows at the `audio_token_index` positions, or
        (upstream processor outputs, one sample) at `audio_token_start_idx` + `audio_token_len`."""
        if audio_token_start_idx is not None:
            mask = upstream_audio_mask(input_ids, audio_token_start_idx, audio_token_len)
        else:
            tid = self.config.audio_token_index
            mask = input_ids == tid if tid is not None else torch.zeros_like(input_ids, dtype=torch.bool)
        safe_ids = input_ids.masked_fill(mask, 0)  # the audio token may lie past the LM's vocab
        embeds = self.get_input_embeddings()(safe_ids)
        if audio_values is None or len(audio_values) == 0:
            return embeds
        rows = torch.cat(self.get_audio_features(audio_values, audio_lens, audio_token_len))
        if rows.shape[0] != int(mask.sum()):
            raise InvalidRequest(f"the prompt has {int(mask.sum())} audio tokens but the audio gives "
                             f"{rows.shape[0]} rows; build the prompt and audio with UltravoxProcessor")
        return embeds.masked_scatter(mask[..., None], rows.to(embeds.dtype))

    def forward(self, input_ids=None, audio_values=None, audio_lens=None, audio_token_len=None,
                inputs_embeds=None, attention_mask=None, audio_token_start_idx=None, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in AUDIO_KEYS + UPSTREAM_KEYS}
        if inputs_embeds is None:
            inputs_embeds = self.embed_prompt(input_ids, audio_values, audio_lens, audio_token_len,
                                              audio_token_start_idx)
        return self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, audio_values=None, audio_lens=None,
                 audio_token_len=None, audio_token_start_idx=None, **kwargs):
        """Like upstream: embed the prompt with its audio, then the LM's `generate` (our
        processor's outputs or upstream's, with `audio_token_start_idx`)."""
        kwargs = {k: v for k, v in kwargs.items() if k not in AUDIO_KEYS + UPSTREAM_KEYS}
        embeds = self.embed_prompt(input_ids, audio_values, audio_lens, audio_token_len, audio_token_start_idx)
        return self.language_model.generate(input_ids=input_ids, inputs_embeds=embeds, **kwargs)


class UltravoxProcessor(ProcessorMixin):
    """WhisperFeatureExtractor + tokenizer + chat template. Each `<|audio|>` in the text
    becomes ceil(frames / (2 * stack_factor)) audio tokens; clips longer than the
    encoder context are split into chunks (as upstream), their tokens back to back."""

    audio_kwargs = {"return_attention_mask": True}

    def __init__(self, feature_extractor=None, tokenizer=None, chat_template=None,
                 stack_factor: int = 8, audio_context_size: int = 3000,
                 audio_placeholder: str = AUDIO_PLACEHOLDER, audio_padding: str = "longest",
                 encoder_ds_factor: int = 2):
        if audio_padding != "longest" or encoder_ds_factor != 2:  # upstream's processor_config fields
            raise ValueError(f"audio_padding={audio_padding!r}, encoder_ds_factor={encoder_ds_factor} are not "
                             "supported; Whisper-encoder Ultravox checkpoints use 'longest' and 2")
        self.stack_factor, self.audio_context_size = stack_factor, audio_context_size
        self.audio_placeholder = self.audio_token = audio_placeholder
        if tokenizer.convert_tokens_to_ids(audio_placeholder) in (None, tokenizer.unk_token_id):
            tokenizer.add_tokens([audio_placeholder], special_tokens=True)  # id = len(vocab), as upstream
        self.audio_token_id = tokenizer.convert_tokens_to_ids(audio_placeholder)
        super().__init__(feature_extractor, tokenizer, chat_template=chat_template)

    def _process_audio(self, audio, **kwargs):
        audio = list(audio)  # already fetched and listed by `prepare_inputs_layout`
        if any(len(a) == 0 for a in audio):
            raise InvalidRequest("an audio clip is empty; send at least a few samples of audio")
        hop = self.feature_extractor.hop_length
        audio = [a if len(a) >= 2 * hop else _pad_np(a, 2 * hop) for a in audio]
        kwargs.update(padding="longest", pad_to_multiple_of=hop, truncation=False,
                      return_attention_mask=True, return_tensors="pt")
        feats = self.feature_extractor(audio, **kwargs)
        out = self._chunk(feats["input_features"], feats["attention_mask"].sum(-1))
        counts = out["audio_num_chunks"].tolist()
        ends = torch.tensor(counts).cumsum(0).tolist()
        token_len = out["audio_token_len"].tolist()
        repl = [self.audio_token * sum(token_len[e - c:e]) for c, e in zip(counts, ends)]
        return out, repl

    def _chunk(self, values: torch.Tensor, lens: torch.Tensor) -> dict[str, torch.Tensor]:
        size = self.audio_context_size
        chunks, chunk_lens, counts = [], [], []
        for v, n in zip(values, lens.tolist()):
            starts = range(0, n, size)
            chunks += [v[:, s:s + size] for s in starts]
            chunk_lens += [min(size, n - s) for s in starts]
            counts.append(len(starts))
        width = max(c.shape[-1] for c in chunks)
        lens_t = torch.tensor(chunk_lens)
        return {"audio_values": torch.stack([F.pad(c, (0, width - c.shape[-1])) for c in chunks]),
                "audio_lens": lens_t, "audio_token_len": audio_token_lengths(lens_t, self.stack_factor),
                "audio_num_chunks": torch.tensor(counts)}

    @property
    def model_input_names(self):
        return list(dict.fromkeys(self.tokenizer.model_input_names + list(AUDIO_KEYS)))


def _pad_np(a, n: int):
    return np.pad(np.asarray(a), (0, n - len(a)))


def register() -> None:
    """Idempotent registration with the transformers Auto classes."""
    AutoConfig.register("ultravox", UltravoxConfig, exist_ok=True)
    AutoModel.register(UltravoxConfig, UltravoxModel, exist_ok=True)
    AutoModelForCausalLM.register(UltravoxConfig, UltravoxModel, exist_ok=True)
    AutoProcessor.register(UltravoxConfig, UltravoxProcessor, exist_ok=True)


register()
