"""Chat templates rendered as transformers renders them (Jinja2's ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loopcontrols, raise_exception, strftime_now, a tojson that leaves HTML
alone, `{% generation %}` blocks), within bounds, since templates come from model files and are
untrusted: a deadline checked at every call, attribute, item and operator, and no string or list
past RENDER_CHARS, whether repeated (*), joined (~, +), replaced, padded or formatted wide."""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import re
import time

from tunix_train.config import ConfigError

# Bounds on one rendering: templates come from model files, untrusted (a GGUF, tokenizer_config.json)
RENDER_SECONDS = 10.0
RENDER_CHARS = 1 << 26


class Rendering:
    """One rendering's progress: its text's length so far, its {% generation %} spans, its deadline."""

    def __init__(self):
        self.length, self.spans, self.deadline = 0, [], time.monotonic() + RENDER_SECONDS

    def grew(self, chars: int) -> None:
        self.length += chars
        if self.length > RENDER_CHARS:
            raise ConfigError(f"writes more than {RENDER_CHARS} characters")
        self.on_time()

    def on_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise ConfigError(f"takes more than {RENDER_SECONDS:g} s")


_RENDERING: contextvars.ContextVar = contextvars.ContextVar("chat_rendering", default=None)


def _no_wide_format(text: str) -> None:
    """A format string may not ask for a field of 8 digits' width ('{:>99999999}', '%99999999s')."""
    if re.search(r"\d{8,}", text):
        raise ConfigError("formats a field of more than 8 digits' width")


def _check_binop(operator: str, left, right) -> None:
    """An operator's result bounded before it is computed: % formats, + joins, * repeats, ** powers."""
    if operator == "%" and isinstance(left, str):
        _no_wide_format(left)
    if operator == "+" and all(isinstance(x, (str, list, tuple)) for x in (left, right)):
        if len(left) + len(right) > RENDER_CHARS:
            raise ConfigError(f"joins a string or list past {RENDER_CHARS} items")
    sized = next((len(x) for x in (left, right) if isinstance(x, (str, list, tuple))), None)
    count = right if isinstance(right, int) else left
    if operator == "*" and sized is not None and isinstance(count, int) and sized * count > RENDER_CHARS:
        raise ConfigError(f"repeats a string or list past {RENDER_CHARS} items")
    if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
        raise ConfigError("raises to a power above 1024")


def _check_call(args: tuple, kwargs: dict) -> None:
    """A call's numbers and a str.replace's result bounded before it runs (args: the sandbox's
    (context, function, *arguments))."""
    numbers = [x for x in (*args[2:], *kwargs.values()) if isinstance(x, int)]
    if any(abs(x) > RENDER_CHARS for x in numbers):  # "x".ljust(10**10), "x".center(...)
        raise ConfigError(f"calls a function with a number past {RENDER_CHARS}")
    function = args[1] if len(args) > 1 else None
    text = getattr(function, "__self__", None)
    if isinstance(text, str) and getattr(function, "__name__", "") == "replace" and len(args) > 3:
        old, new = args[2], args[3]
        if isinstance(old, str) and isinstance(new, str) and old:
            if len(text) + text.count(old) * (len(new) - len(old)) > RENDER_CHARS:
                raise ConfigError(f"makes a string past {RENDER_CHARS} characters")


@functools.cache
def _bounded_environment():
    """transformers' sandbox, and within each rendering a deadline checked at every call,
    attribute, item and operator, and no string or list repeated past RENDER_CHARS."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedConcat(CodeGenerator):
        """`a ~ b` through Bounded.concat, which Jinja would join unchecked."""

        def visit_Concat(self, node, frame) -> None:
            self.write("environment.concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])
        code_generator_class = BoundedConcat

        def wrap_str_format(self, value):
            if isinstance(getattr(value, "__self__", None), str):  # "{:>99999999}".format(x)
                _no_wide_format(value.__self__)
            return super().wrap_str_format(value)

        def concat(self, parts) -> str:
            self._on_time()
            text = "".join(map(str, parts))
            if len(text) > RENDER_CHARS:
                raise ConfigError(f"joins a string past {RENDER_CHARS} characters")
            return text

        def call_binop(self, context, operator, left, right):
            self._on_time()
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(self, *args, **kwargs):
            self._on_time()
            _check_call(args, kwargs)
            out = super().call(*args, **kwargs)
            if isinstance(out, (str, list, tuple)) and len(out) > RENDER_CHARS:  # s.replace("x", s)
                raise ConfigError(f"makes a string or list past {RENDER_CHARS} items")
            return out

        def getattr(self, obj, attribute):
            self._on_time()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self._on_time()
            return super().getitem(obj, argument)

        @staticmethod
        def _on_time():
            if (rendering := _RENDERING.get()) is not None:
                rendering.on_time()

    return Bounded


@functools.lru_cache(maxsize=16)
def compiled_template(template: str):
    """The template compiled as transformers compiles chat templates."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        """{% generation %} ... {% endgeneration %}: records where its text starts and ends."""

        tags = {"generation"}
        tracked = _RENDERING

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if (rendering := self.tracked.get()) is not None:
                rendering.spans.append((rendering.length, rendering.length + len(text)))
            return text

    _Bounded = _bounded_environment()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = _Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    )
    env.globals.update(
        raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt)
    )
    return env.from_string(template), Generation.tracked
