"""What `hasctl profile` measures: the operating points (`Plan`; `QUICK` for tests and smoke
runs), the media sizes of each modality and the reference one, and the SLO tier multipliers
(`--tiers`). Shared by the measured profile (hasctl.profile, hasctl.profile_measure), the
sharing curve (hasctl.profile_sharing) and the roofline profile (hasctl.roofline_profile)."""
from __future__ import annotations

from dataclasses import dataclass

from easerve import profile_format as pf


@dataclass(frozen=True)
class Plan:
    """The operating points to measure."""
    encode_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    shares: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0)
    image_sizes: tuple[tuple[int, int], ...] = ((112, 112), (224, 224), (448, 448))
    video_sizes: tuple[tuple[int, int, int], ...] = ((4, 112, 112), (8, 112, 112), (16, 112, 112))
    audio_seconds: tuple[float, ...] = (1.0, 2.0, 5.0)
    size_batches: tuple[int, ...] = (1, 4)
    prompt_lens: tuple[int, ...] = (64, 256, 1024)
    prefill_batches: tuple[int, ...] = (1, 4)
    decode_batches: tuple[int, ...] = (1, 4, 16, 64)
    decode_contexts: tuple[int, ...] = (128, 1024)
    decode_steps: int = 8
    output_tokens: int = 32
    repeats: int = 3
    sharing_busy: int = 3         # CPU: up to this many neighbour processes (hasctl/profile_sharing.py); 0: none

    def __post_init__(self) -> None:
        for name in ("encode_batches", "size_batches", "prompt_lens", "prefill_batches", "decode_batches",
                     "decode_contexts"):
            v = getattr(self, name)
            if not v or any(x < 1 for x in v):
                raise ValueError(f"{name} must be a non-empty list of ints >= 1, got {v}")
        if self.repeats < 1 or self.decode_steps < 1 or self.output_tokens < 2 or self.sharing_busy < 0:
            raise ValueError("repeats and decode_steps must be >= 1, output_tokens >= 2, sharing_busy >= 0")


QUICK = Plan(encode_batches=(1, 2), shares=(0.5, 1.0), image_sizes=((56, 56),), video_sizes=((2, 56, 56),),
             audio_seconds=(0.5,), size_batches=(1,), prompt_lens=(16, 48), prefill_batches=(1, 2),
             decode_batches=(1, 4), decode_contexts=(32,), decode_steps=2, output_tokens=4, repeats=1, sharing_busy=1)


def sizes_of(plan: Plan, modality: str) -> tuple:
    return {"image": plan.image_sizes, "video": plan.video_sizes, "audio": plan.audio_seconds}[modality]


def reference_size(plan: Plan, modality: str):
    """The media size of the encode grid and the unloaded request: the second size if there is one."""
    sizes = sizes_of(plan, modality)
    return sizes[min(1, len(sizes) - 1)]


def parse_tiers(text: str) -> dict[str, float]:
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if len(vals) != 3 or not all(v > 0 for v in vals) or vals != sorted(vals):
        raise ValueError(f"--tiers takes three increasing multipliers tight,moderate,loose (e.g. 2,4,8), got {text!r}")
    return dict(zip(pf.TIERS, vals))
