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
- Llama 3.1's, where the template asks for `{"name": ..., "parameters": ...}`: the whole turn is
  one JSON object (after an optional `<|python_tag|>`), its arguments under "parameters" (or
  "arguments");
- Gemma 4's, where the template writes `<|tool_call>`: `<|tool_call>call:NAME{key:value,...}<tool_call|>`,
  keys bare and strings between `<|"|>` delimiters (ai.google.dev/gemma/docs/capabilities/text/
  function-calling-gemma4).

The model's output is untrusted: a call's text is read up to MAX_CALL_CHARS characters and
MAX_DEPTH levels of nesting, its arguments are checked against the tool's schema (jsonschema), and
a turn runs at most `max_calls` calls. A call runs in a worker thread, or with `processes` in a
process of its own pool; one that raises, returns something that is not JSON, or runs past the
timeout gives the model an error message instead of a result. A thread cannot be stopped: one
that hangs is left behind (daemonic) and counted in `Toolbox.hung`; a process that hangs is killed.
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

MAX_CALL_CHARS = 1 << 16  # one call's text
MAX_DEPTH = 32  # one call's nesting
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
    """training.rollout.tools -> {tool name: function}, each checked to make a schema."""
    tools = {}
    for name in names:
        function = import_object(name, "training.rollout.tools")
        if not inspect.isfunction(function):
            raise ConfigError(
                f"training.rollout.tools: {name!r} is a {type(function).__name__}, not a function"
            )
        tools[function.__name__] = function
        schema(function, name)
    return tools


def schema(function: Callable, name: str = "") -> dict:
    """The function's tool schema, as transformers builds it; a ConfigError naming it when its
    annotations or docstring cannot make one."""
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise ConfigError(
            "training.rollout.tools needs transformers for the tools' schemas: "
            "pip install 'tunix_train[tools]'"
        ) from None
    try:
        return get_json_schema(function)
    except Exception as err:  # transformers' TypeHintParsingException, DocstringParsingException
        raise ConfigError(
            f"training.rollout.tools: {name or function.__name__!r} cannot make a tool schema "
            f"({' '.join(str(err).split())}); give every argument a type hint and a line under Args: "
            f"in its docstring"
        ) from None


def call_style(template: str) -> str:
    """Which call format a chat template defines: 'gemma4', 'llama3' or 'tagged'."""
    if "<|tool_call>" in template:
        return "gemma4"
    if "<|start_header_id|>" in template and '"parameters": ' in template:
        return "llama3"
    return "tagged"


def parse_calls(text: str, style: str) -> list[Call]:
    """The tool calls a model's turn writes, in order; each written wrong carries its error."""
    if style == "gemma4":
        return [_bounded(body, lambda: _gemma4_call(name, body)) for name, body in GEMMA4.findall(text)]
    if style == "llama3":  # a turn that is one JSON object is a call; any other text is a reply
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not (body.startswith("{") and body.endswith("}")):
            return []
        return [_bounded(body, lambda: _tagged_call(body, "parameters"))]
    return [_bounded(body, lambda: _tagged_call(body)) for body in TAGGED.findall(text)]


def _bounded(body: str, parse: Callable[[], Call]) -> Call:
    """parse(), unless the call's text is too long or too deep to read."""
    if len(body) > MAX_CALL_CHARS:
        return Call("", {}, f"the call is {len(body)} characters long; at most {MAX_CALL_CHARS}")
    try:
        call = parse()
    except RecursionError:
        return Call("", {}, f"the call is nested more than {MAX_DEPTH} levels deep")
    if call.error is None and _depth(call.arguments) > MAX_DEPTH:
        return Call(call.name, {}, f"the call is nested more than {MAX_DEPTH} levels deep")
    return call


def _depth(value) -> int:
    level, depth = [value], 0
    while level and depth <= MAX_DEPTH:
        level = [
            v
            for x in level
            if isinstance(x, (dict, list))
            for v in (x.values() if isinstance(x, dict) else x)
        ]
        depth += 1
    return depth


def _tagged_call(body: str, key: str = "arguments") -> Call:
    """A JSON call, its arguments under `key` (Llama 3.1's "parameters"; "arguments" is read too)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return Call("", {}, f"the call is not JSON ({err.msg})")
    arguments = value.get(key, value.get("arguments", {})) if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or not isinstance(value.get("name"), str)
        or not isinstance(arguments, dict)
    ):
        return Call("", {}, f'a call is {{"name": "...", "{key}": {{...}}}}')
    return Call(value["name"], arguments)


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
    return (
        Call(name, arguments)
        if isinstance(arguments, dict)
        else Call(name, {}, "the arguments are not an object")
    )


def check_arguments(schema: dict, arguments: dict) -> str | None:
    """What is wrong with a call's arguments for the tool's schema (jsonschema), or None."""
    import jsonschema

    parameters = {"additionalProperties": False, **schema["function"]["parameters"]}  # a Python function's
    errors = sorted(
        jsonschema.Draft202012Validator(parameters).iter_errors(arguments),
        key=lambda e: list(e.absolute_path),
    )
    if not errors:
        return None
    return "; ".join(
        (f"'{'.'.join(map(str, e.absolute_path))}': " if e.absolute_path else "") + e.message[:200]
        for e in errors[:3]
    )


class Toolbox:
    """The tools, their schemas, and how a call runs: in a thread (hung ones counted in `hung`) or,
    with `processes`, in a process of a pool of one, killed with its pool when it hangs."""

    def __init__(self, tools: dict[str, Callable], timeout_s: float, processes: bool = False):
        self.tools, self.timeout_s, self.processes = tools, timeout_s, processes
        self.schemas = {name: schema(f, name) for name, f in tools.items()}
        try:
            import jsonschema  # noqa: F401
        except ImportError:
            if tools:
                raise ConfigError(
                    "training.rollout.tools needs jsonschema to check the calls' arguments: "
                    "pip install 'tunix_train[tools]'"
                ) from None
        self.hung = 0  # calls that ran past the timeout
        self._pool = None

    def call(self, call: Call) -> tuple[str, bool]:
        """(the result as text, whether it is an error)."""
        if call.error:
            return f"error: {call.error}", True
        if call.name not in self.tools:
            return f"error: no tool named {call.name!r} (tools: {', '.join(self.tools)})", True
        wrong = check_arguments(self.schemas[call.name], call.arguments)
        if wrong:
            return f"error: the arguments of {call.name} do not fit its schema: {wrong}", True
        ok, value = self._run(self.tools[call.name], call.arguments)
        if not ok:
            return f"error: {value}", True
        try:
            return (value if isinstance(value, str) else json.dumps(value)), False
        except (TypeError, ValueError):
            return f"error: {call.name} returned a {type(value).__name__}, which is not JSON", True

    def _run(self, function: Callable, arguments: dict) -> tuple[bool, Any]:
        if not self.processes:
            status, value = _in_thread(lambda: function(**arguments), self.timeout_s)
            self.hung += status == "timeout"
            return _reported(status, value, self.timeout_s)
        import concurrent.futures
        import multiprocessing

        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn")
            )
        future = self._pool.submit(function, **arguments)
        try:
            return True, future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            self.hung += 1
            self.close()  # the process that runs it is killed
            return False, f"timed out after {self.timeout_s:g} s (its process was killed)"
        except concurrent.futures.process.BrokenProcessPool:
            self.close()
            return False, "its process died"
        except Exception as err:  # noqa: BLE001 - reported to the model, the run goes on
            return False, f"{type(err).__name__}: {err}"

    def close(self) -> None:
        if self._pool is not None:  # a pool cannot kill its workers before Python 3.14: its _processes
            processes = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.kill()
                process.join(5)
            self._pool = None


def cut(result: str, tokenizer, max_tokens: int) -> str:
    """A tool's result cut to max_tokens tokens, saying so (read up to 16 characters a token)."""
    head = result[: max_tokens * 16]
    ids = tokenizer.encode(head)
    if len(ids) <= max_tokens and len(head) == len(result):
        return result
    return (
        f"{tokenizer.decode(ids[:max_tokens])}... [cut: the result was {len(result)} characters, more than "
        f"{max_tokens} tokens]"
    )


def run_with_timeout(function: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """(True, its value) or (False, what went wrong: the exception, or the timeout)."""
    return _reported(*_in_thread(function, timeout_s), timeout_s)


def _reported(status: str, value: Any, timeout_s: float) -> tuple[bool, Any]:
    return status == "ok", f"timed out after {timeout_s:g} s" if status == "timeout" else value


def _in_thread(function: Callable[[], Any], timeout_s: float) -> tuple[str, Any]:
    """("ok", its value), ("error", what it raised) or ("timeout", None), run in a daemonic thread."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["ok"] = function()
        except BaseException as err:  # noqa: BLE001 - reported to the model, the run goes on
            box["error"] = f"{type(err).__name__}: {err}"

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return "timeout", None
    return next(iter(box.items()))
