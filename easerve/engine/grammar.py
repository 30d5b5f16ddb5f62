"""Structured outputs through xgrammar: a request's `StructuredOutput` -> a grammar -> one
matcher per request that masks the logits of tokens the grammar does not allow next.

`parse` needs no tokenizer (the gateway checks a request with it: an invalid schema, regex or
grammar is an `InvalidRequest` naming the problem). `Grammars` compiles for one tokenizer (once
per process, lazily, cached by spec). Prefill's first token and every decode step mask through
`mask` (called by `logit_transforms.apply`). The matcher state never crosses the network: decode
compiles the same spec and replays the first token prefill sampled (`GrammarState.accept`).
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar as xgr

from easerve.errors import InvalidRequest
from easerve.types import StructuredOutput

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_COMPILED_ENTRIES = 64  # compiled grammars kept per tokenizer


def _literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes, which xgrammar's EBNF reads)."""
    return json.dumps(text, ensure_ascii=False)


def _json_schema(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)


def _tool_call_schema(spec: str) -> str:
    """{"functions": [{"name", "parameters"}]} -> one JSON schema for {"name": ..., "arguments": ...}."""
    try:
        functions = json.loads(spec)["functions"]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidRequest(f"tool_calls spec must be {{\"functions\": [{{\"name\", \"parameters\"}}]}}: {e}") from None
    if not calls:
        raise InvalidRequest("tool_calls spec names no function")
    return json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})


def parse(so: StructuredOutput) -> xgr.Grammar:
    """The grammar `so` asks for; InvalidRequest naming what is wrong with its spec."""
    try:
        if so.kind == "json":
            json.loads(so.spec)
            return _json_schema(so.spec)
        if so.kind == "json_object":
            return _json_schema('{"type": "object"}')
        if so.kind == "regex":
            return xgr.Grammar.from_regex(so.spec)
        if so.kind == "choice":
            choices = json.loads(so.spec)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequest("choice must be a non-empty list of non-empty strings")
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_literal(c) for c in choices))
        if so.kind == "grammar":
            return xgr.Grammar.from_ebnf(so.spec)
        return xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {_literal(TOOL_CALL_OPEN)}"),
                                  _json_schema(_tool_call_schema(so.spec)),
                                  xgr.Grammar.from_ebnf(f"root ::= {_literal(TOOL_CALL_CLOSE)}"))
    except InvalidRequest as e:
        raise InvalidRequest(f"{_name(so)}: {e}") from None
    except (ValueError, RuntimeError, TypeError) as e:  # xgrammar's parse errors, json's
        raise InvalidRequest(f"{_name(so)} is invalid: {_first_line(e)}") from None


def _name(so: StructuredOutput) -> str:
    return {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
            "tool_calls": "tools", "json_object": "json_object"}[so.kind]


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[-1][:500]


class GrammarState:
    """One request's place in its grammar; `plain`: a bitmask row ANDed into every mask (JSON
    output: only tokens of whole UTF-8 characters and no raw control characters; xgrammar's
    length-bounded strings let both through, and a character split over tokens may be left
    unfinished; any character still comes as a \\u escape)."""

    def __init__(self, matcher: xgr.GrammarMatcher, plain: torch.Tensor | None = None) -> None:
        self._m = matcher
        self.plain = plain

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar did not allow it (or had ended)."""
        return not self._m.is_terminated() and self._m.accept_token(token)

    @property
    def done(self) -> bool:
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self.plain is not None:
            bitmask[row] &= self.plain


class Grammars:
    """The compiler for one tokenizer (built on first use) and its compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._args = (tokenizer, vocab_size, list(eos_ids))
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[StructuredOutput, xgr.CompiledGrammar] = OrderedDict()
        self._plain_rows: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, adapter) -> "Grammars":
        """The (shared) Grammars of a model adapter's tokenizer and logits width."""
        tok = adapter.tokenizer
        with _SHARED_LOCK:
            g = _SHARED.get(tok)
            if g is None:
                g = _SHARED[tok] = cls(tok, adapter.text_config.vocab_size, adapter.eos_token_ids)
            return g

    def _compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        with self._lock:
            hit = self._compiled.get(so)
            if hit is not None:
                self._compiled.move_to_end(so)
                return hit
            if self._compiler is None:
                tok, vocab, eos = self._args
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        compiled = self._compiler.compile_grammar(parse(so))
        with self._lock:
            self._compiled[so] = compiled
            while len(self._compiled) > _COMPILED_ENTRIES:
                self._compiled.popitem(last=False)
        return compiled

    def start(self, so: StructuredOutput) -> GrammarState:
        """A fresh state at the start of `so`'s grammar; InvalidRequest if it does not compile."""
        matcher = xgr.GrammarMatcher(self._compile(so))
        if so.kind in ("json", "json_object"):
            return GrammarState(matcher, self._plain(""))
        return GrammarState(matcher, self._plain("\n") if so.kind == "tool_calls" else None)

    def _plain(self, allowed: str) -> torch.Tensor:
        """Bitmask row of the tokens whose text is whole UTF-8 characters with no control
        character but those in `allowed`."""
        with self._lock:
            row = self._plain_rows.get(allowed)
            if row is None:
                tok, vocab, _ = self._args
                ok = [_plain_text(tok.decode([i]), allowed) for i in range(min(len(tok), vocab))]
                row = self._plain_rows[allowed] = _pack(ok + [True] * (vocab - len(ok)))
            return row


def _plain_text(text: str, allowed: str) -> bool:
    return "\ufffd" not in text and not any(ord(c) < 0x20 and c not in allowed for c in text)


def _pack(allowed: list[bool]) -> torch.Tensor:
    """Booleans per token -> one row of xgrammar's bitmask (int32 words, bit i % 32 of word i // 32)."""
    words = (len(allowed) + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:len(allowed)] = torch.tensor(allowed, dtype=torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


def mask(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """-inf, in place, on the [N, V] logits of tokens each row's grammar does not allow next
    (rows without a state, or whose grammar has ended, are left as they are)."""
    rows = [i for i, s in enumerate(states) if s is not None and not s.done]
    if not rows:
        return
    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for j, i in enumerate(rows):
        states[i].fill(bitmask, j)
    index = torch.tensor(rows, device=logits.device)
    sub = logits[index]
    xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device), vocab_size=vocab)
    logits[index] = sub
