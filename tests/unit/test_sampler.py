import pytest
import torch

from easerve.engine.sampler import filtered_logits, mix_seed, sample
from easerve.types import SamplingParams

torch.set_num_threads(1)
V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = _logits(4)
    assert sample(x, [SamplingParams()] * 4, [0] * 4) == x.argmax(-1).tolist()


def test_top_k_1_is_greedy_even_when_hot():
    x = _logits(3)
    p = SamplingParams(temperature=5.0, top_k=1)
    assert sample(x, [p] * 3, [1, 2, 3]) == x.argmax(-1).tolist()


def test_seeded_row_ignores_its_batch_and_position():
    x = _logits(6)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=1234)
    alone = [sample(x[2:3], [p], [s])[0] for s in range(20)]
    others = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=9)]
    for s in range(20):
        batch = torch.cat([x[:2], x[2:3], _logits(3, seed=s + 1)])
        params = [others[0], others[1], p, *others]
        assert sample(batch, params, [0, 5, s, 1, 2, 3])[2] == alone[s]
    assert len(set(alone)) > 1  # the step changes the draw


def test_different_seeds_differ():
    x = _logits(1)
    draws = {tuple(sample(x, [SamplingParams(temperature=2.0, seed=s)], [t])[0] for t in range(10)) for s in range(5)}
    assert len(draws) > 1


def test_filters_keep_top_k_and_nucleus():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: torch.isfinite(filtered_logits(x.clone(), [p]))[0].tolist()
    assert kept(SamplingParams(temperature=1.0, top_k=2)) == [True, True, False, False]
    assert kept(SamplingParams(temperature=1.0, top_p=0.7)) == [True, True, False, False]
    assert kept(SamplingParams(temperature=1.0, top_p=0.8)) == [True, True, False, False]
    assert kept(SamplingParams(temperature=1.0, top_p=0.81)) == [True, True, True, False]
    assert kept(SamplingParams(temperature=1.0, top_p=0.1)) == [True, False, False, False]
    assert all(kept(SamplingParams(temperature=1.0)))


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).expand(2000, 3)
    toks = sample(x, [SamplingParams(temperature=1.0, top_p=0.85)] * 2000, [0] * 2000)
    assert set(toks) == {0, 1} and 0.7 < toks.count(0) / 2000 < 0.85


def test_mix_seed_is_stable_and_in_range():
    assert mix_seed(1, 2) == mix_seed(1, 2) != mix_seed(2, 1)
    assert all(0 <= mix_seed(s, t) < 2 ** 63 for s in (-5, 0, 2 ** 70) for t in (0, 99))


def test_mismatched_rows_rejected():
    with pytest.raises(ValueError, match="must match"):
        sample(_logits(2), [SamplingParams()], [0])
