"""The roofline's rows-per-media-size rule (easerve.roofline.rows) against the tiny checkpoints'
real HF processors: the rows it predicts are the placeholders the processor emits."""
import pytest

from easerve.roofline import load_arch
from easerve.stages.encode.profiler import media_label, synthetic_item

CASES = [
    ("llava-next", "image", [(112, 112), (224, 224), (448, 448), (640, 480), (300, 700), (1000, 90)]),
    ("qwen2.5-vl", "image", [(56, 56), (224, 224), (448, 448), (640, 480), (30, 900)]),
    ("qwen2.5-vl", "video", [(2, 56, 56), (4, 112, 112), (5, 224, 160), (8, 112, 112)]),
    ("ultravox", "audio", [0.5, 1.0, 2.0, 5.0, 31.0]),
]


@pytest.mark.parametrize("family,modality,sizes", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_rows_match_processor(adapters, tiny_checkpoint, family, modality, sizes):
    arch, enc = load_arch(tiny_checkpoint(family)), adapters(family, "encode")
    got = {media_label(modality, s): arch.rows(modality, media_label(modality, s)) for s in sizes}
    want = {media_label(modality, s): int(synthetic_item(enc, modality, s).num_tokens) for s in sizes}
    assert got == want
