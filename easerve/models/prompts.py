"""`Prompts`: the gateway side of an `HFAdapter` (a mixin of it): chat messages or a raw prompt
through the model's HF processor into a `ProcessedPrompt` of token ids and media items, and the
same prompt again from learned items without the processor (encoder-cache hits). The HF chat
template's dict form of our typed messages is built here only (`hf_messages`)."""
from __future__ import annotations

from typing import Any

import torch

from easerve.errors import InvalidRequest
from easerve.types import ChatMessage, MMItem, ProcessedPrompt, TextPart, as_messages

# processor argument name for each modality
MEDIA_KWARGS = {"image": "images", "video": "videos", "audio": "audio"}


class Prompts:
    """Needs of the host class: `family`, `modalities`, `placeholder_tokens`, `placeholder_ids`,
    `processor`; a family overrides `split_items`."""

    # ---- gateway -----------------------------------------------------------------------
    def split_items(self, out: Any, modality: str) -> list[tuple[dict, dict]]:
        """Batched processor outputs -> (pixels, meta) per item of `modality`, in order."""
        raise NotImplementedError

    def _check_modalities(self, found: list[str]) -> None:
        bad = sorted(set(found) - set(self.modalities))
        if bad:
            raise InvalidRequest(f"{self.family} does not accept {bad} inputs; it accepts "
                             f"{list(self.modalities)}: remove those parts or use another model")

    def _to_prompt(self, out: Any) -> ProcessedPrompt:
        ids = out["input_ids"][0]
        offsets = out["text_replacement_offsets"][0] if "text_replacement_offsets" in out else []
        split = {m: self.split_items(out, m) for m in {o["type"] for o in offsets}}
        items, taken = [], {m: 0 for m in split}
        for o in offsets:
            mod = o["type"]
            pixels, meta = split[mod][taken[mod]]
            taken[mod] += 1
            n = o["replacement"].count(self.placeholder_tokens[mod])
            items.append(MMItem(mod, pixels, meta, n, replacement=o["replacement"]))
        self._check_placeholders(ids, items)
        return ProcessedPrompt(input_ids=ids.tolist(), items=items)

    def _check_placeholders(self, ids: torch.Tensor, items: list[MMItem]) -> None:
        for mod, tid in self.placeholder_ids.items():
            have = sum(i.num_tokens for i in items if i.modality == mod)
            if have != int((ids == tid).sum()):
                raise InvalidRequest(f"{mod} placeholders in the prompt ({int((ids == tid).sum())}) "
                                 f"do not match the processed {mod} items ({have} tokens)")

    def preprocess(self, messages, add_generation_prompt: bool = True) -> ProcessedPrompt:
        messages = as_messages(messages)
        self._check_modalities([p.kind for m in messages for p in m.media])
        kwargs = {"return_text_replacement_offsets": True, **_video_metadata(messages)}
        out = self.processor.apply_chat_template(
            hf_messages(messages), tokenize=True, return_dict=True, return_tensors="pt",
            add_generation_prompt=add_generation_prompt, processor_kwargs=kwargs)
        return self._to_prompt(out)

    def preprocess_prompt(self, prompt: str, images=(), videos=(), audios=()) -> ProcessedPrompt:
        """A raw prompt holding one placeholder string per media item, in prompt order."""
        media = {"image": list(images), "video": list(videos), "audio": list(audios)}
        self._check_modalities([m for m, v in media.items() if v])
        for mod, token in self.placeholder_tokens.items():
            n = prompt.count(token)
            if n != len(media[mod]):
                raise InvalidRequest(f"the prompt has {n} {mod} placeholder(s) {token!r} but "
                                 f"{len(media[mod])} {mod}(s) were given; use one {token!r} per {mod}")
        kwargs = {MEDIA_KWARGS[m]: v for m, v in media.items() if v}
        out = self.processor(text=prompt, return_tensors="pt",
                             return_text_replacement_offsets=True, **kwargs)
        return self._to_prompt(out)

    # ---- gateway: media processed before (encoder-cache hits) ----------------------------
    def chat_text(self, messages, add_generation_prompt: bool = True) -> str:
        """The chat template's text of `messages`, placeholders not expanded: what `preprocess`
        hands the processor. Media values are not read (they may still be undecoded)."""
        return self.processor.apply_chat_template(hf_messages(as_messages(messages)), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_from_items(self, text: str, items: dict[str, list[MMItem]], chat: bool = True) -> ProcessedPrompt:
        """What `preprocess` (`chat`: `text` from `chat_text`) or `preprocess_prompt` gives for
        media processed before, without decoding them or running the HF processor: the k-th
        placeholder of a modality in `text` becomes the `replacement` of the k-th item of it in
        `items` (pixel-free MMItems learned from an earlier preprocess), and the text is tokenized
        as the processor tokenizes it. Items come back in prompt order."""
        self._check_modalities([m for m, v in items.items() if v])
        for mod, token in self.placeholder_tokens.items():
            n, want = text.count(token), len(items.get(mod, ()))
            if n != want:
                raise InvalidRequest(f"the prompt has {n} {mod} placeholder(s) {token!r} but {want} {mod}(s) "
                                     f"were given; use one {token!r} per {mod}")
        proc = self.processor
        repl = {m: [i.replacement for i in items.get(m, ())] for m in MEDIA_KWARGS}
        (expanded,), (offsets,) = proc.get_text_with_replacements([text], repl["image"], repl["video"],
                                                                   repl["audio"])
        kwargs = {"return_tensors": "pt"}
        if chat and proc.tokenizer.bos_token is not None and text.startswith(proc.tokenizer.bos_token):
            kwargs["add_special_tokens"] = False  # as the processor's apply_chat_template
        text_kwargs = proc._merge_kwargs(tokenizer_init_kwargs=proc.tokenizer.init_kwargs, **kwargs)["text_kwargs"]
        for flag in ("return_mm_token_type_ids", "return_text_replacement_offsets"):
            text_kwargs.pop(flag, None)
        ids = proc.tokenizer([expanded], **text_kwargs)["input_ids"][0]
        taken = {m: 0 for m in items}
        ordered = []
        for o in offsets:
            ordered.append(items[o["type"]][taken[o["type"]]])
            taken[o["type"]] += 1
        self._check_placeholders(ids, ordered)
        return ProcessedPrompt(input_ids=ids.tolist(), items=ordered)



def hf_messages(messages: tuple[ChatMessage, ...]) -> list[dict]:
    """The HF chat-template form of `messages`, built here only, where the processor reads it: a
    media part holds its decoded value, or while undecoded its MediaRef (the template reads only
    the part's type), and a video part the rate of its frames as "fps" when known."""
    out = []
    for m in messages:
        content = []
        for p in m.content:
            if isinstance(p, TextPart):
                content.append({"type": "text", "text": p.text})
                continue
            part = {"type": p.kind, p.kind: p.value if p.decoded else p.ref}
            if p.fps is not None:
                part["fps"] = p.fps
            content.append(part)
        out.append({"role": m.role, "content": content})
    return out


def _video_metadata(messages: tuple[ChatMessage, ...]) -> dict:
    """`video_metadata` for the processor when every video part says the rate of its frames
    (`fps`: the media decoder's sampling rate). Without it HF assumes 24 fps for decoded
    frames, which squeezes Qwen2.5-VL's temporal positions (second_per_grid_ts)."""
    videos = [p for m in messages for p in m.media if p.kind == "video"]
    if not videos or any(not p.fps for p in videos):
        return {}
    meta = []
    for p in videos:
        n = len(p.value)
        meta.append({"total_num_frames": n, "fps": float(p.fps), "frames_indices": list(range(n))})
    return {"video_metadata": meta}
