"""The stop rules of a request, applied token by token (the one home prefill and decode share)."""
from __future__ import annotations

import pytest

from easerve.engine.stops import StopRules
from easerve.types import SamplingParams


class CharTok:
    """Token i is the character chr(ord('a') + i); id 99 decodes to nothing (special)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == 99 else chr(ord("a") + i) for i in ids)


def _run(rules, tokens):
    out = []
    for t in tokens:
        v = rules.push(t)
        out.append((v.text, v.finish_reason))
        if v.finished:
            break
    return out


def test_eos_ends_without_its_text_unless_ignored():
    sp = SamplingParams(max_tokens=10)
    assert _run(StopRules(sp, (3,), CharTok()), [0, 1, 3, 4])[-1] == ("", "stop")
    got = _run(StopRules(SamplingParams(max_tokens=3, ignore_eos=True), (3,), CharTok()), [0, 3, 1])
    assert "".join(t for t, _ in got) == "adb" and got[-1][1] == "length"


def test_stop_string_cuts_text_across_tokens():
    rules = StopRules(SamplingParams(max_tokens=10, stop=("cd",)), (), CharTok())
    got = _run(rules, [0, 1, 2, 3, 4])
    assert "".join(t for t, _ in got) == "ab" and got[-1][1] == "stop" and len(got) == 4


def test_stop_strings_wait_for_min_tokens():
    sp = SamplingParams(max_tokens=10, min_tokens=4, stop=("b",))
    got = _run(StopRules(sp, (), CharTok()), [1, 0, 1, 2, 1, 3])  # "b" at tokens 1 and 3 is text; at 5 it stops
    assert "".join(t for t, _ in got) == "babc" and got[-1][1] == "stop" and len(got) == 5


def test_max_tokens_counts_every_token_and_flushes_text():
    got = _run(StopRules(SamplingParams(max_tokens=2, stop=("zz",)), (), CharTok()), [0, 1, 2])
    assert got == [("", None), ("ab", "length")]


def test_stop_token_ids_and_first_token_finish():
    rules = StopRules(SamplingParams(max_tokens=5, stop_token_ids=(7,)), (), CharTok())
    assert rules.push(7).finish_reason == "stop"
    assert StopRules(SamplingParams(max_tokens=1), (), CharTok()).push(0).finish_reason == "length"


def test_stop_strings_without_a_tokenizer_are_refused():
    with pytest.raises(ValueError, match="tokenizer"):
        StopRules(SamplingParams(stop=("x",)), (), None)
    assert StopRules(SamplingParams(max_tokens=2), (1,), None).push(1).finish_reason == "stop"
