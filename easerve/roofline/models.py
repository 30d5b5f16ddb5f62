"""Each supported family's shapes, read from config.json (and processor_config.json when the
folder has one; published defaults otherwise), as FLOP / byte counts per call:
`encode_cost(modality, media)` for one batched encode call, `prefill_cost(prompt_lens)`,
`decode_cost(contexts)`, plus the rows per media size (`rows`).

Media sizes are the profile's labels: "WxH" (image), "FxWxH" (video), "Ss" (audio seconds).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from easerve.roofline import rows as R
from easerve.roofline.cost import Block, Cost, linear

FAMILIES = {"llava_next": "llava-next", "qwen2_5_vl": "qwen2.5-vl", "ultravox": "ultravox"}


def parse_media(modality: str, media: str) -> tuple:
    try:
        if modality == "audio":
            return (float(media.removesuffix("s")),)
        dims = tuple(int(x) for x in media.split("x"))
    except ValueError:
        dims = ()
    if (modality, len(dims)) not in (("image", 2), ("video", 3), ("audio", 1)):
        raise ValueError(f"media {media!r} is not a {modality} size; use WxH (image), FxWxH (video) or Ss (audio)")
    return dims


@dataclass(frozen=True)
class LanguageModel:
    block: Block
    layers: int
    vocab: int

    @classmethod
    def from_config(cls, t: dict) -> "LanguageModel":
        heads = t["num_attention_heads"]
        hd = t.get("head_dim") or t["hidden_size"] // heads
        return cls(Block(t["hidden_size"], heads, t.get("num_key_value_heads", heads), hd, t["intermediate_size"], True),
                   t["num_hidden_layers"], t["vocab_size"])

    def kv_bytes_per_token(self, b: int) -> int:
        return self.layers * 2 * self.block.kv_heads * self.block.head_dim * b

    def weight_bytes(self, b: int) -> int:
        return (self.layers * self.block.params() + 2 * self.vocab * self.block.hidden) * b

    def prefill_cost(self, prompt_lens: list[int], b: int) -> Cost:
        """The prompts' layers (causal), their KV written, the last token's logits."""
        kv_write = Cost(0.0, float(sum(prompt_lens)) * self.kv_bytes_per_token(b))
        return self.block.forward(prompt_lens, b, causal=True) * self.layers + kv_write + \
            linear(len(prompt_lens), self.block.hidden, self.vocab, b)

    def decode_cost(self, contexts: list[int], b: int) -> Cost:
        """One step: a token per running request over its context, and its logits."""
        return self.block.decode(contexts, b) * self.layers + linear(len(contexts), self.block.hidden, self.vocab, b)


class ModelArch:
    family = ""
    modalities: tuple[str, ...] = ()

    def __init__(self, cfg: dict, processor: dict | None):
        self.cfg, self.processor = cfg, processor or {}
        self.lm = LanguageModel.from_config(cfg["text_config"])

    def rows(self, modality: str, media: str) -> int:
        raise NotImplementedError

    def encode_cost(self, modality: str, media: list[str], b: int) -> Cost:
        raise NotImplementedError

    def encoder_weight_bytes(self, b: int) -> int:
        raise NotImplementedError

    def check_modality(self, modality: str) -> None:
        if modality not in self.modalities:
            raise ValueError(f"{self.family} takes {list(self.modalities)}, not {modality!r}")


class QwenVL(ModelArch):
    family, modalities = "qwen2.5-vl", ("image", "video")
    IMAGE_PIXELS = (3136, 12845056)         # Qwen2.5-VL's preprocessor_config min / max pixels
    VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)  # qwen-vl-utils' per-frame video bounds

    def __init__(self, cfg: dict, processor: dict | None):
        super().__init__(cfg, processor)
        v = cfg["vision_config"]
        self.vis = Block(v["hidden_size"], v["num_heads"], v["num_heads"], v["hidden_size"] // v["num_heads"],
                         v["intermediate_size"], True)
        self.depth, self.full = v["depth"], set(v.get("fullatt_block_indexes", ()))
        self.patch, self.merge, self.temporal = v["patch_size"], v["spatial_merge_size"], v["temporal_patch_size"]
        self.window = v.get("window_size", 112) // (self.patch * self.merge)  # merged units per window side
        self.out_hidden = v["out_hidden_size"]

    def _pixels(self, modality: str) -> tuple[int, int]:
        size = self.processor.get("image_processor" if modality == "image" else "video_processor", {}).get("size")
        if size:
            return size["shortest_edge"], size["longest_edge"]
        return self.IMAGE_PIXELS if modality == "image" else self.VIDEO_PIXELS

    def grid(self, modality: str, media: str) -> tuple[int, int, int]:
        self.check_modality(modality)
        dims = parse_media(modality, media)
        f, w, h = (1, *dims) if modality == "image" else dims
        return R.qwen_grid(f, w, h, self.patch, self.merge, self.temporal, *self._pixels(modality))

    def rows(self, modality: str, media: str) -> int:
        t, gh, gw = self.grid(modality, media)
        return t * gh * gw // self.merge ** 2

    def _windows(self, gh: int, gw: int) -> list[int]:
        m, ws = self.merge, self.window
        side = lambda n: [min(ws, n - i) for i in range(0, n, ws)]  # noqa: E731
        return [a * c * m * m for a in side(gh // m) for c in side(gw // m)]

    def encode_cost(self, modality: str, media: list[str], b: int) -> Cost:
        grids = [self.grid(modality, x) for x in media]
        patches = sum(t * gh * gw for t, gh, gw in grids)
        full = [gh * gw for t, gh, gw in grids for _ in range(t)]
        windows = [s for t, gh, gw in grids for _ in range(t) for s in self._windows(gh, gw)]
        n_full = sum(1 for i in range(self.depth) if i in self.full)
        hm = self.vis.hidden * self.merge ** 2
        embed = linear(patches, 3 * self.temporal * self.patch ** 2, self.vis.hidden, b)
        merger = linear(patches // self.merge ** 2, hm, hm, b) + linear(patches // self.merge ** 2, hm, self.out_hidden, b)
        layers = self.vis.forward(full, b) * n_full + self.vis.forward(windows, b) * (self.depth - n_full)
        return embed + layers + merger + Cost(layers=2)

    def encoder_weight_bytes(self, b: int) -> int:
        hm = self.vis.hidden * self.merge ** 2
        return (self.depth * self.vis.params() + 3 * self.temporal * self.patch ** 2 * self.vis.hidden
                + hm * hm + hm * self.out_hidden) * b


class LlavaNext(ModelArch):
    family, modalities = "llava-next", ("image",)

    def __init__(self, cfg: dict, processor: dict | None):
        super().__init__(cfg, processor)
        v = cfg["vision_config"]
        self.vis = Block(v["hidden_size"], v["num_attention_heads"], v["num_attention_heads"],
                         v["hidden_size"] // v["num_attention_heads"], v["intermediate_size"], False)
        self.depth, self.patch, self.crop = v["num_hidden_layers"], v["patch_size"], v["image_size"]
        self.pinpoints = cfg["image_grid_pinpoints"]

    def _rows_tiles(self, media: str) -> tuple[int, int]:
        self.check_modality("image")
        w, h = parse_media("image", media)
        return R.llava_next_rows(w, h, self.pinpoints, self.crop, self.patch)

    def rows(self, modality: str, media: str) -> int:
        self.check_modality(modality)
        return self._rows_tiles(media)[0]

    def encode_cost(self, modality: str, media: list[str], b: int) -> Cost:
        self.check_modality(modality)
        tiles = sum(self._rows_tiles(x)[1] for x in media)
        side = (self.crop // self.patch) ** 2
        th = self.lm.block.hidden
        embed = linear(tiles * side, 3 * self.patch ** 2, self.vis.hidden, b)
        proj = linear(tiles * side, self.vis.hidden, th, b) + linear(tiles * side, th, th, b)
        return embed + self.vis.forward([side + 1] * tiles, b) * self.depth + proj + Cost(layers=2)

    def encoder_weight_bytes(self, b: int) -> int:
        th = self.lm.block.hidden
        return (self.depth * self.vis.params() + 3 * self.patch ** 2 * self.vis.hidden
                + self.vis.hidden * th + th * th) * b


class Ultravox(ModelArch):
    family, modalities = "ultravox", ("audio",)

    def __init__(self, cfg: dict, processor: dict | None):
        super().__init__(cfg, processor)
        a = cfg["audio_config"]
        d, heads = a["d_model"], a["encoder_attention_heads"]
        self.vis = Block(d, heads, heads, d // heads, a["encoder_ffn_dim"], False)
        self.depth, self.mels = a["encoder_layers"], a.get("num_mel_bins", 80)
        self.stack, self.proj_hidden = cfg["stack_factor"], cfg["hidden_size"]
        fe = self.processor.get("feature_extractor", {})
        self.audio = (fe.get("sampling_rate", 16000), fe.get("hop_length", 160),
                      self.processor.get("audio_context_size", R.WHISPER_CHUNK_FRAMES))

    def chunks(self, media: str) -> list[int]:
        self.check_modality("audio")
        return R.audio_chunks(parse_media("audio", media)[0], *self.audio)

    def rows(self, modality: str, media: str) -> int:
        self.check_modality(modality)
        return R.ultravox_rows(self.chunks(media), self.stack)

    def encode_cost(self, modality: str, media: list[str], b: int) -> Cost:
        """Every item's chunks in one call, zero-padded to the widest chunk (the padding is computed)."""
        self.check_modality(modality)
        chunks = [c for x in media for c in self.chunks(x)]
        n, width = len(chunks), max(chunks)
        pos = -(-width // 2)
        d, th = self.vis.hidden, self.lm.block.hidden
        conv = linear(n * width, 3 * self.mels, d, b) + linear(n * pos, 3 * d, d, b)
        r = n * -(-pos // self.stack)
        proj = linear(r, d * self.stack, self.proj_hidden, b) + linear(r, self.proj_hidden // 2, th, b)
        return conv + self.vis.forward([pos] * n, b) * self.depth + proj + Cost(layers=3)

    def encoder_weight_bytes(self, b: int) -> int:
        d = self.vis.hidden
        return (self.depth * self.vis.params() + 3 * self.mels * d + 3 * d * d + d * self.stack * self.proj_hidden
                + self.proj_hidden // 2 * self.lm.block.hidden) * b


ARCHS = {"llava_next": LlavaNext, "qwen2_5_vl": QwenVL, "ultravox": Ultravox}


def load_arch(model_dir: str | Path) -> ModelArch:
    """The roofline shapes of the checkpoint folder (config.json; processor_config.json if present)."""
    d = Path(model_dir)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except OSError as e:
        raise ValueError(f"cannot read {d / 'config.json'}: {e.strerror}; --model takes a checkpoint folder") from None
    kind = cfg.get("model_type")
    if kind not in ARCHS:
        raise ValueError(f"{d}: model_type {kind!r} has no roofline model; supported: {sorted(FAMILIES.values())}")
    proc = d / "processor_config.json"
    return ARCHS[kind](cfg, json.loads(proc.read_text()) if proc.is_file() else None)


MEMORY_UTILIZATION = 0.9   # of a device's memory an engine takes (vLLM's --gpu-memory-utilization default)
ACTIVATION_RESERVE_GIB = 1.0  # stated: activations of a prefill chunk and CUDA graphs, per device


def kv_budget_gib(arch: ModelArch, mem_gib: float, tp: int, b: int) -> float:
    """KV-cache GiB per device of an instance holding the whole model over `tp` devices: the
    engine's share of memory less the weights' share and ACTIVATION_RESERVE_GIB."""
    weights = (arch.lm.weight_bytes(b) + arch.encoder_weight_bytes(b)) / tp / 2 ** 30
    return MEMORY_UTILIZATION * mem_gib - weights - ACTIVATION_RESERVE_GIB


def check_fits(arch: ModelArch, mem_gib: float, tp: int, b: int) -> None:
    room = MEMORY_UTILIZATION * mem_gib - ACTIVATION_RESERVE_GIB
    if kv_budget_gib(arch, mem_gib, tp, b) <= 0:
        total = (arch.lm.weight_bytes(b) + arch.encoder_weight_bytes(b)) / 2 ** 30
        raise ValueError(f"{arch.family}: the weights need {total / tp:.1f} GiB per device at tp={tp}, over the "
                         f"{room:.1f} GiB an engine has of the device's {mem_gib:g} GiB ({MEMORY_UTILIZATION:.0%} less "
                         f"{ACTIVATION_RESERVE_GIB:g} GiB of activations), no room for a KV cache; "
                         f"use --tp {math.floor(total / room) + 1} or more")

