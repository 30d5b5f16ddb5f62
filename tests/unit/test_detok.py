import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.models.text_lm import make_tokenizer  # noqa: E402

from easerve.engine.detok import PROMPT_TAIL, Detokenizer, prompt_tail  # noqa: E402

TEXT = "héllo wörld, 你好 🙂🚀 the quick brown fox"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _run(det: Detokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for t in ids:
        deltas.append(det.push(t))
        if det.stop_hit:
            break
    deltas.append(det.finish())
    return deltas


def test_multibyte_characters_are_never_split(tok):
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the tokenizer does split characters
    deltas = _run(Detokenizer(tok), ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_prompt_tail_gives_context_but_no_text(tok):
    prompt, out = tok.encode("the quick"), tok.encode(" brown fox")
    assert "".join(_run(Detokenizer(tok, prompt_tail=prompt), out)) == " brown fox"


def test_the_shipped_prompt_tail_is_the_detokenizer_context(tok):
    """prefill ships prompt_tail(ids); a Detokenizer given the whole prompt keeps just as much."""
    prompt, out = tok.encode("héllo wörld, the quick brown"), tok.encode(" fox jumps")
    assert len(prompt) > PROMPT_TAIL and prompt_tail(prompt) == prompt[-PROMPT_TAIL:]
    whole, tail = Detokenizer(tok, prompt_tail=prompt), Detokenizer(tok, prompt_tail=prompt_tail(prompt))
    assert _run(whole, out) == _run(tail, out) and "".join(_run(Detokenizer(tok, prompt), out)) == " fox jumps"


@pytest.mark.parametrize("stop", ["wörld", "d, 你", "🚀", "fox"])
def test_stop_string_across_tokens_is_trimmed(tok, stop):
    ids = tok.encode(TEXT)
    det = Detokenizer(tok, stop=(stop, "never-there"))
    deltas = _run(det, ids)
    assert det.stop_hit == stop
    assert "".join(deltas) == det.text == TEXT[:TEXT.index(stop)]


def test_text_is_held_back_only_as_long_as_a_stop_could_start(tok):
    ids = tok.encode("abcdefgh")
    det = Detokenizer(tok, stop=("xyz",))
    streamed = "".join(det.push(t) for t in ids)
    assert streamed == "abcdefgh"[:len(streamed)] and len(streamed) >= 6
    assert streamed + det.finish() == "abcdefgh" and det.stop_hit is None


def test_special_tokens_are_skipped(tok):
    ids = tok.encode("fox") + [tok.eos_token_id]
    assert "".join(_run(Detokenizer(tok), ids)) == "fox"
