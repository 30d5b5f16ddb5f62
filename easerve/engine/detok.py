"""Incremental detokenization of one request's output, with stop strings.

`push(token_id)` returns the text that became final: a delta never ends inside a multi-byte
character (a byte-level token that ends mid-character waits for the next one), and, when
the request has stop strings, the last len(longest stop) - 1 characters are held back, so
that a stop string found across token boundaries can still be cut out. When a stop string
appears, `stop_hit` names it and the text is cut right before it; `finish()` returns
whatever was held back. The deltas concatenated always equal `text`. A transformers fast tokenizer that does not
clean up spaces is decoded through its Rust backend directly (the same text, without
transformers' per-call conversions).
"""
from __future__ import annotations

from typing import Any

# prompt tokens that seed the decode window before the first output token (as vLLM/TGI): the
# one length of every KVPayload.prompt_ids_tail and of every Detokenizer's prompt context
PROMPT_TAIL = 5


def prompt_tail(input_ids) -> list[int]:
    """The prompt's last PROMPT_TAIL ids: the detokenizer's context for the first output token
    (prefill detokenizes that one, decode the rest, both from this tail)."""
    return list(input_ids[-PROMPT_TAIL:])


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_tail: list[int] | tuple[int, ...] = (),
                 stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._ids: list[int] = list(prompt_tail)[-PROMPT_TAIL:]
        self._prefix = 0               # decode window start (context)
        self._read = len(self._ids)    # ids before this are already in `text`
        self.text = ""                 # output text so far (cut at a stop string)
        self._emitted = 0              # characters of `text` already returned
        self.stop_hit: str | None = None
        self.find_stops = True         # False: stop strings are not looked for (min_tokens not reached)
        self._backend = _backend_decoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one output token; return the newly final text."""
        if self.stop_hit is not None:
            return ""
        self._ids.append(int(token_id))
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new, or the token ends inside a character
        start = len(self.text)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self._find_stop(start)
        return self._take(final=self.stop_hit is not None)

    def _find_stop(self, new_from: int) -> None:
        if not self.find_stops:
            return
        hits = []
        for s in self.stop:
            i = self.text.find(s, max(0, new_from - len(s) + 1))
            if i >= 0:
                hits.append((i, s))
        if hits:
            i, self.stop_hit = min(hits)
            self.text = self.text[:i]

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        delta, self._emitted = self.text[self._emitted:end], end
        return delta

    def finish(self) -> str:
        """The request is over: return the held-back tail (an unfinished character at the
        very end is decoded as U+FFFD, as a full decode would)."""
        if self.stop_hit is None and self._read < len(self._ids):
            tail = self._decode(self._ids[self._prefix:])[len(self._decode(self._ids[self._prefix:self._read])):]
            start = len(self.text)
            self.text += tail
            self._read = len(self._ids)
            self._find_stop(start)
        return self._take(final=True)


def _backend_decoder(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` whose decode() gives exactly tokenizer.decode()'s text, or
    None: only for transformers' own fast-tokenizer decode, with space clean-up off."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep tokenizer.decode
        return None
    kind = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or kind.decode is not PreTrainedTokenizerBase.decode
            or kind._decode is not TokenizersBackend._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    return tokenizer.backend_tokenizer
