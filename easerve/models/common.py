"""`HFAdapter`: the shared implementation of `ModelAdapter` over transformers 5 classes.

A family subclass declares *what* its checkpoint looks like; this class does the rest (the
gateway side, messages -> ProcessedPrompt, is its mixin `easerve.models.prompts.Prompts`):

    class MyAdapter(HFAdapter):
        family = "my-family"; modalities = ("image",)  # and its config names in models/registry.py
        model_class = MyForConditionalGeneration          # the full HF class
        encoder_parts = ("model.vision_tower", "model.multi_modal_projector")  # submodules/params
        lm_parts = ("model.language_model", "lm_head")    # default, usually kept
        legacy_renames = ((r"^vision_tower", "model.vision_tower"), ...)  # hub key -> v5 key
        placeholder_tokens = {"image": "<image>"}         # one placeholder string per modality

        def split_items(self, out, modality): ...  # processor outputs -> [(pixels, meta)] per item
        def encode(self, items): ...               # [MMItem] -> [[num_tokens, hidden]]

Optional hooks: `build_part(path, meta_obj)` (materialise one part; the default handles
`PreTrainedModel`s, parameters and plain modules without non-persistent buffers),
`expected_tokens(modality, meta)` (per-item placeholder count, for validation),
`prefill_positions(input_ids, req)` (one prompt's positions + rope delta; default 1-D;
batched prefill lays them end to end, see `easerve.models.batched_prefill`), `decode_position_ids`
(default [B, 1]). Item token counts come from the processor's `text_replacement_offsets`
(occurrences of the placeholder string in each item's replacement text); each item keeps its
replacement text, so `prompt_from_items` can build the same prompt again from the chat template's
text and learned items, without decoding the media or running the processor (encoder-cache hits).

Roles: "processor" loads no weights; "encode" loads `encoder_parts`; "prefill"/"decode" load
`lm_parts` (a tied lm_head is tied to the loaded embedding); "full" is plain `from_pretrained`
(or, with `assemble_full`, every part through `read_part_tensors`, for weights in several folders).
Partial roles build the whole model on the meta device and swap in real parts, so HF methods
such as `get_image_features` or `get_rope_index` work unchanged on `self.model`.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from easerve.models import batched_prefill as pb
from easerve.models.base import ModelAdapter
from easerve.models.weights import (fast_init, get_submodule, held_parameters, load_into,
                                    meta_skeleton, read_tensors, renamer, set_submodule, under)
from easerve.errors import InvalidRequest
from easerve.models.prompts import Prompts
from easerve.types import CachedPrefix, PrefillRequest, PrefillResult

ROLES = ("processor", "encode", "prefill", "decode", "full")


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU (exact tests), bfloat16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


class HFAdapter(Prompts, ModelAdapter):
    model_class: ClassVar[type]
    encoder_parts: ClassVar[tuple[str, ...]] = ()
    lm_parts: ClassVar[tuple[str, ...]] = ("model.language_model", "lm_head")
    lm_path: ClassVar[str] = "model.language_model"
    lm_head_path: ClassVar[str] = "lm_head"
    legacy_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    placeholder_tokens: ClassVar[dict[str, str]] = {}
    assemble_full: ClassVar[bool] = False  # role "full" built from parts (weights in several folders)

    def __init__(self, path: str, role: str = "full", device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"):
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; choose one of {ROLES}")
        from transformers import AutoConfig, AutoProcessor

        self.path, self.role = str(path), role
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.attn_implementation = attn_implementation
        self.config = AutoConfig.from_pretrained(self.path)
        self.text_config = self.config.get_text_config()
        self.processor = AutoProcessor.from_pretrained(self.path)
        self.generation_eos = self._read_eos()
        self.placeholder_ids = {m: self._token_id(t) for m, t in self.placeholder_tokens.items()}
        self.model = self._load_model() if role != "processor" else None
        self._use_packed_attention()

    # ---- loading ------------------------------------------------------------------------
    def _use_packed_attention(self) -> None:
        """An LM loaded with sdpa runs `prefill_batch.ATTN_IMPL`: sdpa, plus per-prompt
        (varlen) attention when a packed prefill asks for it."""
        if self.role in ("prefill", "decode", "full") and self.attn_implementation == "sdpa":
            pb.register()
            self.language_model.set_attn_implementation(pb.ATTN_IMPL)

    def _read_eos(self) -> tuple[int, ...]:
        from transformers import GenerationConfig
        try:
            eos = GenerationConfig.from_pretrained(self.path).eos_token_id
        except OSError:
            eos = None
        for src in (self.text_config, self.config):
            eos = eos if eos is not None else getattr(src, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)

    def _token_id(self, token: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == self.tokenizer.unk_token_id:
            raise ValueError(f"{self.path}: tokenizer has no placeholder token {token!r}")
        return int(tid)

    @classmethod
    def parts_of(cls, role: str) -> tuple[str, ...]:
        """Submodule / parameter paths whose weights `role` holds."""
        if role == "processor":
            return ()
        if role == "encode":
            return cls.encoder_parts
        if role == "full":
            return cls.encoder_parts + cls.lm_parts
        return cls.lm_parts

    @classmethod
    def weight_filter(cls, role: str):
        """The key map of the checkpoint tensors `role` reads (None for the others): what
        `read_part_tensors` reads, and what `easerve.models.hub` fetches."""
        return under(cls.parts_of(role), renamer(cls.legacy_renames))

    def role_parts(self) -> tuple[str, ...]:
        """Submodule / parameter paths whose weights this role holds."""
        return self.parts_of(self.role)

    def _load_model(self) -> nn.Module:
        if self.role == "full" and not self.assemble_full:
            model = self.model_class.from_pretrained(
                self.path, dtype=self.dtype, attn_implementation=self.attn_implementation)
            return model.to(self.device).eval()
        self.config._attn_implementation = self.attn_implementation
        for sub in self.config.sub_configs:
            getattr(self.config, sub)._attn_implementation = self.attn_implementation
        skel = meta_skeleton(self.model_class, self.config)
        parts = self.role_parts()
        tensors = self.read_part_tensors(parts)
        for p in parts:
            self._install_part(skel, p, tensors)
        self._tie_weights(skel, parts, tensors)
        return skel.eval()

    def read_part_tensors(self, parts: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """{module name: tensor} of the checkpoint tensors under `parts` (legacy names renamed)."""
        return read_tensors(self.path, under(parts, renamer(self.legacy_renames)), dtype=self.dtype,
                            device=self.device)

    def _install_part(self, skel: nn.Module, path: str, tensors: dict[str, torch.Tensor]) -> None:
        meta_obj = get_submodule(skel, path)
        real = self.build_part(path, meta_obj)
        if isinstance(real, nn.Parameter):
            if path not in tensors:
                raise ValueError(f"checkpoint {self.path} has no tensor {path!r}")
            with torch.no_grad():
                real.copy_(tensors[path])
        else:
            load_into(real, tensors, path, allow_missing=self._tied_missing(path, tensors))
        set_submodule(skel, path, real)

    def build_part(self, path: str, meta_obj: Any) -> nn.Module | nn.Parameter:
        """A real (device, dtype) instance of the skeleton's `meta_obj` at `path`,
        weights not yet loaded. Override for modules with non-persistent buffers that are
        not `PreTrainedModel`s."""
        from transformers import PreTrainedModel

        if isinstance(meta_obj, nn.Parameter):
            return nn.Parameter(torch.empty(meta_obj.shape, dtype=self.dtype, device=self.device),
                                requires_grad=False)
        if isinstance(meta_obj, PreTrainedModel):
            with fast_init(), torch.device(self.device):
                return type(meta_obj)._from_config(meta_obj.config, dtype=self.dtype)
        if any(m._non_persistent_buffers_set for m in meta_obj.modules()):
            raise NotImplementedError(
                f"{type(self).__name__}.build_part must construct {path!r} itself: it has "
                "non-persistent buffers that to_empty() would leave uninitialised")
        return meta_obj.to_empty(device=self.device).to(self.dtype)

    def _tied_pairs(self) -> dict[str, str]:  # {target: source}, transformers 5 style
        tied = getattr(self.model_class, "_tied_weights_keys", None) or {}
        return tied if isinstance(tied, dict) else {}

    def _tied_missing(self, path: str, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Names (relative to `path`) allowed to be absent because they are tied."""
        return [t[len(path) + 1:] for t in self._tied_pairs()
                if t.startswith(path + ".") and t not in tensors]

    def _tie_weights(self, skel: nn.Module, parts: tuple[str, ...], tensors: dict) -> None:
        """Point tied targets this role holds (absent from the checkpoint) at their source."""
        held = lambda key: any(key.startswith(p + ".") or key == p for p in parts)
        for target, source in self._tied_pairs().items():
            if target in tensors or not held(target):
                continue
            if not held(source):
                raise ValueError(f"{target} is tied to {source}, which role {self.role!r} does not load")
            t_mod, _, t_name = target.rpartition(".")
            s_mod, _, s_name = source.rpartition(".")
            setattr(get_submodule(skel, t_mod), t_name, getattr(get_submodule(skel, s_mod), s_name))

    # ---- properties -------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def sampling_rate(self) -> int | None:
        fe = getattr(self.processor, "feature_extractor", None)
        return int(fe.sampling_rate) if fe is not None else None

    @property
    def language_model(self) -> nn.Module:
        return get_submodule(self._need_model(), self.lm_path)

    @property
    def lm_head(self) -> nn.Module:
        return get_submodule(self._need_model(), self.lm_head_path)

    def lm_head_slot(self) -> tuple[nn.Module, str]:
        """(parent module, attribute) of the lm_head, for code that swaps the layer."""
        parent, _, name = self.lm_head_path.rpartition(".")
        model = self._need_model()
        return (get_submodule(model, parent) if parent else model), name

    def _need_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError(f"role {self.role!r} holds no weights; build the adapter with a model role")
        return self.model

    def parameters(self) -> list[nn.Parameter]:
        return held_parameters(self.model) if self.model is not None else []

    # ---- LM hooks used by prefill and the decode engine -------------------------------
    @torch.inference_mode()
    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.get_input_embeddings()(ids.to(self.device))

    def lm_hidden(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                  **attn_kwargs: Any) -> torch.Tensor:
        out = self.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids,
                                  cache=cache, use_cache=True, **attn_kwargs)
        return out.last_hidden_state

    @torch.inference_mode()
    def lm_forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cache: Any,
                   **attn_kwargs: Any) -> torch.Tensor:
        return self.lm_head(self.lm_hidden(inputs_embeds, position_ids, cache, **attn_kwargs))

    def decode_position_ids(self, positions: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
        """1-D RoPE: [B] absolute positions -> [B, 1] (rope_deltas are 0 and ignored)."""
        return positions.to(self.device, torch.long).view(-1, 1)

    def prefill_positions(self, input_ids: torch.Tensor, req: PrefillRequest) -> tuple[torch.Tensor, int]:
        """Position ids for the prompt [1, L] and its rope delta (0 for 1-D RoPE)."""
        return torch.arange(input_ids.shape[1], device=self.device).view(1, -1), 0

    # ---- prefill ------------------------------------------------------------------------
    def expected_tokens(self, modality: str, meta: dict[str, torch.Tensor]) -> int | None:
        """Placeholder count one item of `meta` needs, or None when meta does not say."""
        return None

    def _check_embeddings(self, req: PrefillRequest, ids: torch.Tensor) -> None:
        if len(req.embeddings) != len(req.items_meta):
            raise InvalidRequest(f"request {req.request_id}: {len(req.embeddings)} embeddings for "
                             f"{len(req.items_meta)} media items; send one embedding per item")
        unknown = {m.modality for m in req.items_meta} - set(self.placeholder_ids)
        if unknown:
            raise InvalidRequest(f"{self.family} has no placeholder for {sorted(unknown)}; "
                             f"it accepts {list(self.modalities)}")
        hidden = self.text_config.hidden_size
        for i, (emb, item) in enumerate(zip(req.embeddings, req.items_meta)):
            mod = item.modality
            want = self.expected_tokens(mod, item.meta)
            if emb.dim() != 2 or emb.shape[1] != hidden:
                raise InvalidRequest(f"request {req.request_id}: item {i} embedding has shape "
                                 f"{tuple(emb.shape)}; expected [num_tokens, {hidden}]")
            if want is not None and emb.shape[0] != want:
                raise InvalidRequest(f"request {req.request_id}: {mod} item {i} has {emb.shape[0]} "
                                 f"embedding rows but its meta needs {want} placeholder tokens")
        for mod, tid in self.placeholder_ids.items():
            rows = sum(e.shape[0] for e, m in zip(req.embeddings, req.items_meta) if m.modality == mod)
            n = int((ids == tid).sum())
            if rows != n:
                raise InvalidRequest(f"request {req.request_id}: the prompt has {n} {mod} placeholder "
                                 f"tokens but the {mod} embeddings have {rows} rows; the prompt and "
                                 f"media items must come from the same preprocess call")

    def check_prefill(self, req: PrefillRequest) -> None:
        """Raise ValueError naming what to change when `req` cannot be prefilled (empty
        prompt, embeddings that do not fit its placeholders). Cheap: no forward; `prefill`
        runs it too, so callers batching requests can fail one bad request alone first."""
        if not req.input_ids:
            raise InvalidRequest(f"request {req.request_id}: empty prompt; send at least one token")
        self._check_embeddings(req, torch.tensor(req.input_ids, dtype=torch.long))

    def _place_items(self, embeds: torch.Tensor, ids: torch.Tensor, req: PrefillRequest) -> None:
        """Write each media item's rows at its placeholders of `ids`, in `embeds` (in place)."""
        for mod, tid in self.placeholder_ids.items():
            rows = [e for e, m in zip(req.embeddings, req.items_meta) if m.modality == mod]
            if rows:
                embeds[ids == tid] = torch.cat(rows).to(embeds.device, embeds.dtype)

    @torch.inference_mode()
    def prefill_one(self, req: PrefillRequest) -> PrefillResult:
        """One request, one unpadded forward (the reference `prefill` must agree with)."""
        from transformers import DynamicCache

        self.check_prefill(req)
        ids = torch.tensor([req.input_ids], dtype=torch.long, device=self.device)
        embeds = self.embed_tokens(ids).clone()
        self._place_items(embeds, ids, req)
        positions, delta = self.prefill_positions(ids, req)
        cache = DynamicCache(config=self.text_config)
        hidden = self.lm_hidden(embeds, positions, cache)
        logits = self.lm_head(hidden[:, -1:])[0, -1]
        keys = [layer.keys[0] for layer in cache.layers]
        values = [layer.values[0] for layer in cache.layers]
        return PrefillResult(req.request_id, keys, values, logits.float(), ids.shape[1], int(delta))

    @torch.inference_mode()
    def prefill(self, reqs: list[PrefillRequest],
                prefixes: list[CachedPrefix | None] | None = None) -> list[PrefillResult]:
        """All requests in ONE packed LM forward (`easerve.models.batched_prefill`);
        one request without a cached prefix takes the exact `prefill_one` path. `prefixes`
        (the prefix cache's hits, per request or None): the KV of a request's first tokens,
        so only the tokens after them are computed. Every request is checked before the
        forward: a bad one raises ValueError (use `check_prefill` to sort them out)."""
        self._need_model()
        prefixes = list(prefixes) if prefixes is not None else [None] * len(reqs)
        if len(prefixes) != len(reqs):
            raise ValueError(f"{len(prefixes)} prefixes for {len(reqs)} requests; give one (or None) per request")
        if len(reqs) <= 1 and not any(prefixes):
            return [self.prefill_one(r) for r in reqs]
        for r, p in zip(reqs, prefixes):
            self.check_prefill(r)
            if p is not None and not 0 < p.num_tokens < len(r.input_ids):
                raise ValueError(f"request {r.request_id}: a cached prefix of {p.num_tokens} tokens for a "
                                 f"prompt of {len(r.input_ids)}; it must leave at least one token to compute")
        return self._prefill_packed(reqs, prefixes)

    def _prefill_packed(self, reqs: list[PrefillRequest], prefixes: list[CachedPrefix | None]) -> list[PrefillResult]:
        from transformers import DynamicCache

        done = [p.num_tokens if p is not None else 0 for p in prefixes]
        pieces, positions, deltas = [], [], []
        for r, c in zip(reqs, done):  # each prompt whole (media rows, positions), then its new tokens
            full = torch.tensor([r.input_ids], dtype=torch.long, device=self.device)
            embeds = self.embed_tokens(full).clone()
            self._place_items(embeds, full, r)
            pos, delta = self.prefill_positions(full, r)
            pieces.append(embeds[:, c:])
            positions.append(pos[..., c:])
            deltas.append(delta)
        embeds = torch.cat(pieces, dim=1)
        starts = pb.starts_of([len(r.input_ids) - c for r, c in zip(reqs, done)])
        cache = DynamicCache(config=self.text_config)
        past = pb.fill_cache(cache, [p for p in prefixes if p is not None])
        attn = pb.attention_kwargs(self.language_model.config, embeds, starts, done, cache)
        hidden = self.lm_hidden(embeds, torch.cat(positions, dim=-1), cache, **attn)
        ends = torch.tensor(starts[1:], device=self.device) - 1
        logits = self.lm_head(hidden[0, ends])
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        return pb.split_results([r.request_id for r in reqs], layers, logits, starts, deltas, done, past)
