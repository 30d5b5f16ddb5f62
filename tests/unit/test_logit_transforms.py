"""The vLLM sampling transforms, each against a hand-computed example and, where transformers
has the same processor, against it; batched rows equal each row alone."""
import math

import pytest
import torch
from transformers import MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from easerve.engine import logit_transforms as lt
from easerve.engine.logit_transforms import TokenHistory
from easerve.engine.sampler import filtered_logits, sample
from easerve.errors import InvalidRequest
from easerve.types import SamplingParams

torch.set_num_threads(1)
V = 12
EOS = (11,)


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _history(sp: SamplingParams, prompt: list[int], generated: list[int]) -> TokenHistory:
    h = TokenHistory.start(sp, prompt, EOS)
    for t in generated:
        h.push(t)
    return h


def test_hand_computed_example():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    sp = SamplingParams(max_tokens=8, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                        min_tokens=3, stop_token_ids=(5,), logit_bias={2: 1.0, 4: -1.0})
    h = TokenHistory.start(sp, [0, 1], eos_ids=(4,))
    for t in (3, 3, 1):
        h.push(t)
    out = lt.apply(x, [sp], [3 - 1], [h])  # 2 generated so far (< min_tokens 3)
    # 0: prompt, positive -> 2/2 = 1
    # 1: prompt + generated once, negative -> -1*2 = -2, then -0.25*1 - 0.5 = -2.75
    # 2: bias +1 -> 1.5 (never seen)
    # 3: generated twice, positive -> 3/2 = 1.5, then -0.25*2 - 0.5 = 0.5
    # 4: eos while under min_tokens -> -inf (its bias is added first, -inf wins)
    # 5: a stop id under min_tokens -> -inf
    assert out[0].tolist() == [1.0, -2.75, 1.5, 0.5, -math.inf, -math.inf]
    assert x[0].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]  # the input is left alone
    done = lt.apply(x, [sp], [3], [h])  # min_tokens reached: eos and stop id come back
    assert done[0, 4].item() == -3.0 and done[0, 5].item() == 0.0


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    x = _logits(1, seed=3)
    prompt, generated = [1, 4, 4, 7], [7, 9, 2]
    sp = SamplingParams(repetition_penalty=penalty)
    ours = lt.apply(x, [sp], [len(generated)], [_history(sp, prompt, generated)])
    theirs = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + generated]), x.clone())
    torch.testing.assert_close(ours, theirs)


def test_min_tokens_equals_transformers_min_new_tokens():
    x = _logits(1, seed=4)
    prompt = [1, 2, 3]
    sp = SamplingParams(max_tokens=10, min_tokens=4)
    proc = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=len(prompt), min_new_tokens=4, eos_token_id=list(EOS))
    for n in range(6):
        gen = [5] * n
        ours = lt.apply(x, [sp], [n], [_history(sp, prompt, gen)])
        theirs = proc(torch.tensor([prompt + gen]), x.clone())
        torch.testing.assert_close(ours, theirs)
    assert math.isinf(lt.apply(x, [sp], [0], [_history(sp, prompt, [])])[0, 11].item())


def test_ignore_eos_leaves_eos_to_min_tokens_alone():
    sp = SamplingParams(max_tokens=10, min_tokens=4, ignore_eos=True, stop_token_ids=(3,))
    assert TokenHistory.start(sp, [], EOS).stop_ids == frozenset({3})


@pytest.mark.parametrize("min_p", [0.05, 0.2, 0.6])
def test_min_p_equals_transformers(min_p):
    x = _logits(3, seed=5)
    ours = filtered_logits(x.clone(), [SamplingParams(temperature=1.0, min_p=min_p)] * 3)
    theirs = MinPLogitsWarper(min_p)(torch.zeros(3, 1, dtype=torch.long), x.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    torch.testing.assert_close(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


def test_min_p_hand_example_and_temperature_first():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: torch.isfinite(filtered_logits(x.clone(), [p]))[0].tolist()
    assert kept(SamplingParams(temperature=1.0, min_p=0.2)) == [True, True, True, False]   # 0.05 < 0.1
    assert kept(SamplingParams(temperature=1.0, min_p=0.5)) == [True, True, False, False]  # 0.15 < 0.25
    # temperature 0.5 squares the ratios: 0.15/0.5 = 0.3 -> 0.09 < 0.2
    assert kept(SamplingParams(temperature=0.5, min_p=0.2)) == [True, True, False, False]


def test_presence_and_frequency_count_generated_tokens_only():
    x = torch.zeros(1, V)
    sp = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
    out = lt.apply(x, [sp], [3], [_history(sp, [6, 6, 6], [2, 2, 8])])
    expected = torch.zeros(1, V)
    expected[0, 2], expected[0, 8] = -2.0, -1.5
    assert torch.equal(out, expected)  # the prompt's 6 is not penalised


def test_batched_rows_equal_each_row_alone():
    x = _logits(4, seed=6)
    params = [SamplingParams(repetition_penalty=1.5), SamplingParams(),
              SamplingParams(max_tokens=5, frequency_penalty=1.0, min_tokens=2, logit_bias={0: 5.0}),
              SamplingParams(presence_penalty=-0.5, logit_bias={3: -100})]
    hist = [_history(params[0], [1, 2], [3]), None, _history(params[2], [4], [5, 5]), _history(params[3], [], [7])]
    steps = [1, 0, 1, 1]
    batched = lt.apply(x, params, steps, hist)
    for i in range(4):
        alone = lt.apply(x[i:i + 1], [params[i]], [steps[i]], [hist[i]])
        torch.testing.assert_close(batched[i:i + 1], alone)
    torch.testing.assert_close(batched[1], x[1])  # a row without transforms is untouched


def test_logit_bias_forces_a_greedy_token_and_bans_another():
    x = _logits(1, seed=7)
    top = int(x.argmax())
    forced = (top + 1) % V
    sp = SamplingParams(logit_bias={forced: 100.0})
    assert sample(x, [sp], [0], [TokenHistory.start(sp, [], EOS)]) == [forced]
    ban = SamplingParams(logit_bias={top: -100.0})
    assert sample(x, [ban], [0], [TokenHistory.start(ban, [], EOS)]) != [top]


def test_seeded_penalised_rows_repeat():
    x = _logits(2, seed=8)
    sp = SamplingParams(temperature=1.0, seed=42, repetition_penalty=1.4, min_p=0.05)
    draw = lambda: sample(x, [sp, sp], [2, 2], [_history(sp, [1, 2], [3]), _history(sp, [1, 2], [3])])
    assert draw() == draw()


def test_sample_refuses_a_transforming_row_without_its_history():
    with pytest.raises(ValueError, match="TokenHistory"):
        sample(_logits(1), [SamplingParams(presence_penalty=0.5)], [0])


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.1}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"), ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"1": 1}}, "logit_bias"), ({"logit_bias": {1: "x"}}, "logit_bias"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest, match=field):
        SamplingParams(**kwargs)


def test_penalty_prompt_ids_only_when_repetition_is_on():
    assert lt.penalty_prompt_ids(SamplingParams(repetition_penalty=1.1), [5, 3, 5]) == [3, 5]
    assert lt.penalty_prompt_ids(SamplingParams(presence_penalty=1.0), [5, 3, 5]) == []
