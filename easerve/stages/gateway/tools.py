"""Structured outputs and tool calls at the OpenAI front (pure, no I/O).

A body's `response_format` / vLLM `structured_outputs`, or its `tool_choice` `required` / a
named function, become the request's `StructuredOutput` (the grammar the engine masks with).
Tools reach the model in the hermes format Qwen2.5's chat templates use: a `# Tools` block in
the system message listing each function's signature, calls as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, and results as user turns in
`<tool_response>` tags. The answer's text is parsed back into OpenAI's `tool_calls` shape,
whole (`split_tool_calls`) or as it streams (`ToolCallStream`).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from easerve.errors import BadRequest, InvalidRequest
from easerve.stages.gateway import openai_schema as osc
from easerve.types import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolPlan:
    """The tools a chat request offers the model and how it must use them."""

    functions: tuple[dict, ...]  # OpenAI function objects: name, description, parameters
    forced: str | None           # None: the model may call any or none ("auto"); "": must call
                                 # one of them ("required"); a name: must call that one


def tool_plan(chat: osc.ChatBody) -> ToolPlan | None:
    """None when the request offers no tools or `tool_choice` is "none"."""
    choice = chat.tool_choice
    if not chat.tools:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice: needs tools; list the functions the model may call in tools")
        return None
    if choice == "none":
        return None
    functions = tuple(t.function.model_dump(exclude_none=True) for t in chat.tools)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise BadRequest(f"tools: function names must be unique, got {names}")
    if isinstance(choice, osc.NamedToolChoice):
        if choice.function.name not in names:
            raise BadRequest(f"tool_choice: function {choice.function.name!r} is not in tools ({', '.join(names)})")
        return ToolPlan(functions, choice.function.name)
    return ToolPlan(functions, "" if choice == "required" else None)


def structured_from(body: osc.SamplingBody, plan: ToolPlan | None = None) -> StructuredOutput | None:
    """The structured output a body asks for (at most one of response_format, structured_outputs
    and a forced tool call)."""
    try:
        asked = _asked(body)
    except InvalidRequest as e:
        raise BadRequest(str(e)) from None
    if plan is not None and plan.forced is not None:
        fns = [f for f in plan.functions if plan.forced in ("", f["name"])]
        spec = {"functions": [{"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}}
                              for f in fns]}
        asked.append(("tool_choice", StructuredOutput("tool_calls", json.dumps(spec))))
    if len(asked) > 1:
        raise BadRequest(f"{' and '.join(k for k, _ in asked)} each constrain the output; send only one")
    return asked[0][1] if asked else None


def _asked(body: osc.SamplingBody) -> list[tuple[str, StructuredOutput]]:
    asked = []
    if body.response_format is not None and body.response_format.type != "text":
        asked.append(("response_format", StructuredOutput.from_response_format(
            body.response_format.model_dump(by_alias=True, exclude_none=True))))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", StructuredOutput.from_vllm(
            body.structured_outputs.model_dump(by_alias=True, exclude_none=True))))
    return asked


# ---- prompt -----------------------------------------------------------------------------------
def tools_system_text(functions: tuple[dict, ...]) -> str:
    """The `# Tools` block of a hermes-style system message."""
    sigs = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{sigs}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)


def call_text(name: str, arguments: str) -> str:
    """One earlier call of an assistant turn, as the model writes it."""
    try:
        args = json.loads(arguments)
    except ValueError:
        raise BadRequest(f"tool_calls: arguments of {name!r} must be a JSON object's text, got {arguments[:60]!r}") from None
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def response_text(content: str) -> str:
    """A tool turn's content, as the model reads it (in a user turn)."""
    return f"<tool_response>\n{content}\n</tool_response>"


# ---- answer -----------------------------------------------------------------------------------
def _call(body: str, index: int) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A finished answer -> (its content before the first call, or None when empty; the calls).
    A block that does not parse as {"name": ..., "arguments": ...} stays content."""
    stream = ToolCallStream()
    content = stream.feed(text) + stream.flush()
    return (content.rstrip() or None) if stream.calls else content, stream.calls


class ToolCallStream:
    """Splits streamed text into content and whole tool calls: text that may start a
    `<tool_call>` tag is held back, a call is emitted once its closing tag arrives."""

    def __init__(self) -> None:
        self._buf = ""
        self.calls: list[dict] = []  # every call so far
        self._new: list[dict] = []   # calls since the last take()

    def feed(self, text: str) -> str:
        """More text -> the content that is safe to show now (new calls land in `take()`).
        Once a call came, text outside calls is dropped (as the model's chatter between them)."""
        self._buf += text
        out = []
        while True:
            start = self._buf.find(OPEN)
            if start < 0:
                cut = len(self._buf) - _partial_suffix(self._buf, OPEN)
            else:
                end = self._buf.find(CLOSE, start)
                cut = start if end < 0 else end + len(CLOSE)
                call = None if end < 0 else _call(self._buf[start + len(OPEN):end].strip(), len(self.calls))
                if call is not None:
                    cut = start
            if not self.calls:
                out.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            if start < 0 or end < 0:
                return "".join(out)
            if call is not None:
                self.calls.append(call)
                self._new.append(call)
                self._buf = self._buf[end - start + len(CLOSE):]

    def take(self) -> list[dict]:
        """The calls completed since the last take()."""
        new, self._new = self._new, []
        return new

    def flush(self) -> str:
        """The end of the answer: whatever is held back (an unfinished call) is content."""
        rest, self._buf = self._buf, ""
        return "" if self.calls else rest


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
