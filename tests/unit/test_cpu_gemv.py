"""easerve.engine.cpu_gemv: the transposed layout computes what nn.Linear computes, tied
weights stay as they are, and the swap follows the measured decision per shape."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from easerve.engine import cpu_gemv
from easerve.engine.cpu_gemv import TransposedLinear, apply, choose, linears, shape_of


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5)])
def test_transposed_linear_matches_nn_linear(bias, lead):
    torch.manual_seed(0)
    lin = nn.Linear(12, 7, bias=bias)
    moved = TransposedLinear(lin)
    x = torch.randn(*lead, 12)
    torch.testing.assert_close(moved(x), lin(x), rtol=1e-5, atol=1e-6)
    assert moved.weight.shape == (7, 12) and torch.equal(moved.weight, lin.weight)
    assert moved.weight_t.is_contiguous() and moved.weight_t.shape == (12, 7)
    assert (moved.bias is None) == (not bias)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.up = nn.Linear(8, 24, bias=False)
        self.down = nn.Linear(24, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 24, bias=False), nn.Linear(24, 8)])

    def forward(self, x):
        h = self.embed(x)
        for up, down in ((self.up, self.down), tuple(self.blocks)):
            h = h + down(torch.relu(up(h)))
        return h


class Wrapper(nn.Module):  # the HF shape: decoder beside an lm_head
    def __init__(self, tie: bool):
        super().__init__()
        self.decoder = Tiny()
        self.lm_head = nn.Linear(8, 11, bias=False)
        if tie:
            self.lm_head.weight = self.decoder.embed.weight

    def forward(self, x):
        return self.lm_head(self.decoder(x))


def test_linears_finds_each_layer_once_and_leaves_a_tied_head_alone():
    untied, tied = Wrapper(False), Wrapper(True)
    assert len(linears(untied.decoder, [(untied, "lm_head")])) == 5
    found = linears(tied.decoder, [(tied, "lm_head")])
    assert len(found) == 4 and all(layer is not tied.lm_head for _, _, layer in found)


def test_apply_swaps_exactly_the_shapes_measured_faster_and_keeps_the_output():
    torch.manual_seed(1)
    m = Wrapper(False)
    x = torch.randint(0, 11, (2, 4))
    before = m(x)
    faster = {(24, 8, False)}  # the up projections only

    def timer(shape, dtype):
        assert dtype == torch.float32
        return (2.0, 1.0) if shape in faster else (1.0, 1.0)
    decision = apply(m.decoder, torch.float32, extra=[(m, "lm_head")], timer=timer)
    assert decision == {(24, 8, False): True, (8, 24, True): False, (11, 8, False): False}
    assert isinstance(m.decoder.up, TransposedLinear) and isinstance(m.decoder.blocks[0], TransposedLinear)
    assert type(m.decoder.down) is nn.Linear and type(m.lm_head) is nn.Linear
    torch.testing.assert_close(m(x), before, rtol=1e-5, atol=1e-6)
    assert shape_of(m.decoder.down) == (8, 24, True)


def test_a_small_gain_keeps_the_loaded_layout():
    gain = cpu_gemv.MIN_GAIN * 0.99
    assert choose([(4, 4, False)], torch.float32, timer=lambda s, d: (gain, 1.0)) == {(4, 4, False): False}
    assert choose([(4, 4, False)], torch.float32, timer=lambda s, d: (cpu_gemv.MIN_GAIN, 1.0)) == {(4, 4, False): True}


def test_the_real_timer_returns_positive_medians():
    plain, moved = cpu_gemv.time_layouts((16, 8, True), torch.float32, reps=3)
    assert plain > 0 and moved > 0


def test_engine_config_names_the_layouts():
    from easerve.engine.config import EngineConfig
    with pytest.raises(ValueError, match="linear_layout must be one of auto, torch, got 'fast'"):
        EngineConfig(linear_layout="fast")
