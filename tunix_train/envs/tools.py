"""Tools: plain Python functions, offered to the model through the chat template and called when it
writes a call.

A tool's schema is what transformers' `get_json_schema` makes of its type hints and Google-style
docstring (`{"type": "function", "function": {name, description, parameters}}`, what
`apply_chat_template(tools=[fn])` passes), so a template that renders tools gets what it would
get from transformers.

Calls are parsed in the format the chat template defines:
- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a JSON object between tags (Hermes,
  Qwen 2.5, and the Gemma turn format built in here, data/chat.py: Gemma 3 has no tool format of its
  own, so this one is defined and documented in docs/objectives/tools.md);
- Gemma 4's, where the template writes `<|tool_call>`: `<|tool_call>call:NAME{key:value,...}<tool_call|>`,
  keys bare and strings between `<|"|>` delimiters (ai.google.dev/gemma/docs/capabilities/text/
  function-calling-gemma4).

A call runs in a worker thread; one that raises, returns something that is not JSON, or runs past
the timeout gives the model an error message instead of a result (a thread cannot be stopped: one
that hangs is left behind, daemonic).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import re
import threading
from typing import Any, Callable

from tunix_train.config import ConfigError

TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
GEMMA4 = re.compile(r"<\|tool_call>call:([\w.-]+)(\{.*?\})<tool_call\|>", re.DOTALL)
GEMMA4_STRING = '<|"|>'


@dataclasses.dataclass
class Call:
    name: str
    arguments: dict
    error: str | None = None  # a call written wrong: what is wrong with it


def import_object(name: str, key: str) -> Any:
    """`module:attribute` -> the attribute; a ConfigError naming `key` when it cannot be imported."""
    module_name, _, attribute = name.partition(":")
    try:
        value = getattr(importlib.import_module(module_name), attribute) if attribute else None
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{key}: cannot import {name!r} ({type(err).__name__}: {err})") from None
    if value is None:
        raise ConfigError(f"{key}: {name!r} is not module:name")
    return value


def load_tools(names: list[str]) -> dict[str, Callable]:
    """training.grpo.tools -> {tool name: function}, each checked to make a schema."""
    tools = {}
    for name in names:
        function = import_object(name, "training.grpo.tools")
        if not inspect.isfunction(function):
            raise ConfigError(f"training.grpo.tools: {name!r} is a {type(function).__name__}, not a function")
        tools[function.__name__] = function
        schema(function, name)
    return tools


def schema(function: Callable, name: str = "") -> dict:
    """The function's tool schema, as transformers builds it; a ConfigError naming it when its
    annotations or docstring cannot make one."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise ConfigError("training.grpo.tools needs transformers for the tools' schemas: "
                          "pip install 'tunix_train[tools]'") from None
    try:
        return get_json_schema(function)
    except Exception as err:  # transformers' TypeHintParsingException, DocstringParsingException
        raise ConfigError(f"training.grpo.tools: {name or function.__name__!r} cannot make a tool schema "
                          f"({' '.join(str(err).split())}); give every argument a type hint and a line under Args: "
                          f"in its docstring") from None


def call_style(template: str) -> str:
    """Which call format a chat template defines: 'gemma4' or 'tagged'."""
    return "gemma4" if "<|tool_call>" in template else "tagged"


def parse_calls(text: str, style: str) -> list[Call]:
    """The tool calls a model's turn writes, in order; each written wrong carries its error."""
    if style == "gemma4":
        return [_gemma4_call(name, body) for name, body in GEMMA4.findall(text)]
    calls = []
    for body in TAGGED.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(Call("", {}, f"the call is not JSON ({err.msg})"))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) \
                or not isinstance(value.get("arguments", {}), dict):
            calls.append(Call("", {}, 'a call is {"name": "...", "arguments": {...}}'))
            continue
        calls.append(Call(value["name"], value.get("arguments", {})))
    return calls


def _gemma4_call(name: str, body: str) -> Call:
    """Gemma 4's `{key:<|"|>text<|"|>,n:3}` as JSON: strings quoted, bare keys quoted."""
    parts = body.split(GEMMA4_STRING)
    if len(parts) % 2 == 0:
        return Call(name, {}, "a string is not closed")
    for i in range(0, len(parts), 2):  # outside strings: quote the keys
        parts[i] = re.sub(r"([{,]\s*)([A-Za-z_][\w-]*)\s*:", r'\1"\2":', parts[i])
    for i in range(1, len(parts), 2):
        parts[i] = json.dumps(parts[i])
    try:
        arguments = json.loads("".join(parts))
    except json.JSONDecodeError as err:
        return Call(name, {}, f"the arguments do not parse ({err.msg})")
    return Call(name, arguments) if isinstance(arguments, dict) else Call(name, {}, "the arguments are not an object")


def call_tool(tools: dict[str, Callable], call: Call, timeout_s: float) -> tuple[str, bool]:
    """(the result as text, whether it is an error)."""
    if call.error:
        return f"error: {call.error}", True
    if call.name not in tools:
        return f"error: no tool named {call.name!r} (tools: {', '.join(tools)})", True
    ok, value = run_with_timeout(lambda: tools[call.name](**call.arguments), timeout_s)
    if not ok:
        return f"error: {value}", True
    try:
        return (value if isinstance(value, str) else json.dumps(value)), False
    except TypeError:
        return f"error: {call.name} returned a {type(value).__name__}, which is not JSON", True


def run_with_timeout(function: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """(True, its value) or (False, what went wrong: the exception, or the timeout)."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = function()
        except BaseException as err:  # noqa: BLE001 - reported to the model, the run goes on
            box["error"] = f"{type(err).__name__}: {err}"

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return False, f"timed out after {timeout_s:g} s"
    return ("error" not in box), box.get("error", box.get("value"))
