"""A request's body, checked field by field before anything reaches the tokenizer or the engine:
types, ranges, sizes and nesting, each failure an OpenAI-style 4xx naming the field.

The engine's own checks (Engine.check, Sampling: top_k within the vocabulary, the context) run
too, so the server, the API, the CLI and GRPO refuse the same settings with the same words.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from typing import Any

from tunix_train.config import ConfigError

MAX_DEPTH = 16  # JSON nesting of a body (a conversation is 3 deep)
MAX_MESSAGES = 1024
MAX_STOPS, MAX_STOP_CHARS = 4, 256
MAX_N = 16
MAX_PROMPTS = 64  # prompts of one /v1/completions request (lm-eval sends a batch as one)
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs)
SEED_RANGE = (-(1 << 63), 1 << 64)  # OpenAI's int64, and uint64; the engine keeps seed mod 2**32

# Fields OpenAI defines that this server accepts only at the value that changes nothing (chat's
# logprobs; /v1/completions reads logprobs and echo)
NEUTRAL = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logprobs": (False,),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True, False),
    "store": (False,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}
IGNORED = {"user", "metadata", "service_tier"}  # bookkeeping of OpenAI's, without effect on a reply
CHAT_FIELDS = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "speculative",  # ours: false draws as without speculative decoding (--draft, --prompt_lookup)
}
TEXT_FIELDS = (CHAT_FIELDS - {"messages", "max_completion_tokens"}) | {"prompt", "logprobs", "echo"}


class BadRequest(Exception):
    """A request refused: its message, the field, the HTTP status and OpenAI's error code."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.param, self.status, self.code, self.headers = param, status, code, headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def parse_json(data: bytes) -> dict:
    """The body as a JSON object: UTF-8, no NaN or Infinity, at most MAX_DEPTH deep."""

    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    try:
        body = json.loads(data.decode("utf-8"), parse_constant=no_constant)
    except RecursionError:
        raise BadRequest(f"the body is nested more than {MAX_DEPTH} deep") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not valid JSON ({' '.join(str(err).split())[:200]})") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(
            "the body is not valid text: it holds an unpaired surrogate (\\ud800-\\udfff)"
        ) from None
    level, depth = [body], 1
    while level:
        level = [
            v
            for x in level
            for v in (x.values() if isinstance(x, dict) else x)
            if isinstance(v, (dict, list))
        ]
        depth += bool(level)
        if depth > MAX_DEPTH:
            raise BadRequest(f"the body is nested more than {MAX_DEPTH} deep")
    return body


def _number(body: dict, name: str, kind: type, default, low=None, high=None, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f"'{name}' must be {'a number' if kind is float else 'an integer'}", name)
    if (low is not None and (value <= low if low_open else value < low)) or (
        high is not None and value > high
    ):
        raise BadRequest(f"'{name}'={value} is out of range", name)
    return value


@dataclasses.dataclass(frozen=True)
class Ask:
    """A checked request: the prompt (text, or a conversation) and how to continue it."""

    chat: bool
    prompt: Any  # a list of {role, content} messages; /v1/completions: a tuple of texts and token-id tuples
    max_tokens: int | None  # None: as many as the context leaves; 0: none (echo only)
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # alternatives reported per token; None: no log-probabilities
    echo: bool = False  # the prompt's tokens come back before the completion's (and their logprobs)
    speculative: bool = True  # false: drawn as without the server's speculative decoding


def read(body: dict, chat: bool, name: str) -> Ask:
    """Every field of a completion request checked; no tokenizer involved."""
    from tunix_train.data.chat import check_messages

    known = CHAT_FIELDS if chat else TEXT_FIELDS
    for field, value in body.items():
        if field in known or field in IGNORED:
            continue
        if field in NEUTRAL and value is not None:
            if value not in NEUTRAL[field]:
                raise BadRequest(f"'{field}'={json.dumps(value)[:80]} is not supported by this server", field)
        elif field not in NEUTRAL:
            raise BadRequest(f"Unrecognized request argument supplied: {field[:80]}", field[:80])
    if body.get("model") is not None and body["model"] != name:
        raise BadRequest(
            f"The model '{str(body['model'])[:80]}' does not exist (this server has '{name}')",
            "model",
            404,
            "model_not_found",
        )
    if chat:
        messages = body.get("messages")
        if messages is None:
            raise BadRequest("'messages' is a required property", "messages")
        if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
            raise BadRequest(f"'messages' holds more than {MAX_MESSAGES} messages", "messages")
        try:
            prompt = check_messages(messages, "messages", parts=True)
        except ConfigError as err:
            raise BadRequest(str(err), "messages") from None
    else:
        prompt = _prompts(body.get("prompt"))
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise BadRequest(
            f"'stop' must be a string or a list of up to {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} "
            f"characters",
            "stop",
        )
    field = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _number(body, field, int, None if chat else 16)
    echo = body.get("echo") if not chat else None
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest("'echo' must be true or false", "echo")
    if max_tokens is not None and (max_tokens < 0 or max_tokens == 0 and not echo):
        raise BadRequest(f"'{field}'={max_tokens} must be positive (0 only with echo)", field)
    logprobs = None if chat else _number(body, "logprobs", int, None, 0, MAX_LOGPROBS)
    options = body.get("stream_options")
    if options is not None and (
        not isinstance(options, dict)
        or set(options) - {"include_usage"}
        or not isinstance(options.get("include_usage", False), bool)
    ):
        raise BadRequest(
            "'stream_options' must be an object {\"include_usage\": true|false}", "stream_options"
        )
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    if stream and (echo or logprobs is not None):
        raise BadRequest("'logprobs' and 'echo' are answered whole: send them with 'stream': false", "stream")
    seed = _number(body, "seed", int, None, SEED_RANGE[0], SEED_RANGE[1] - 1)
    speculative = body.get("speculative", True)
    if not isinstance(speculative, bool):
        raise BadRequest("'speculative' must be true or false", "speculative")
    return Ask(
        chat,
        prompt,
        max_tokens,
        _number(body, "temperature", float, 1.0, 0, 2),
        _number(body, "top_k", int, None, 1),
        _number(body, "top_p", float, None, 0, 1, low_open=True),
        seed if seed is not None else uuid.uuid4().int & 0x7FFFFFFF,
        _number(body, "n", int, 1, 1, MAX_N),
        tuple(stop),
        bool(stream),
        bool((options or {}).get("include_usage")),
        logprobs,
        bool(echo),
        speculative,
    )


def _prompts(prompt) -> tuple:
    """/v1/completions' prompt as OpenAI writes it (a text, token ids, or a list of either) as a
    tuple of texts and token-id tuples; the ids' range is the tokenizer's (Api.prepare)."""

    def ids(value) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str) or ids(prompt) and prompt:
        prompt = [prompt]
    if not isinstance(prompt, list) or not 0 < len(prompt) <= MAX_PROMPTS:
        raise BadRequest(
            f"'prompt' must be a string, a list of token ids, or a list of 1 to {MAX_PROMPTS} of either",
            "prompt",
        )
    for one in prompt:
        if not (isinstance(one, str) or ids(one) and one):
            raise BadRequest("each prompt must be a string or a non-empty list of token ids", "prompt")
    return tuple(p if isinstance(p, str) else tuple(p) for p in prompt)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (its pieces' lengths bound it)."""
    return max(len(tokenizer.token(i) or "") for i in range(tokenizer.vocab_size)) or 1


def prompt_chars(ask: Ask) -> int:
    """The longest prompt's characters of text (an image's tokens are counted when it is read;
    token ids are counted as tokens)."""
    if not ask.chat:
        return max(len(p) if isinstance(p, str) else 0 for p in ask.prompt)
    return sum(
        len(m["content"])
        if isinstance(m["content"], str)
        else sum(len(p.get("text", "")) for p in m["content"] if p["type"] == "text")
        for m in ask.prompt
    )


def at_least_tokens(ask: Ask, longest: int) -> int:
    """A bound below the prompt's tokens, without tokenizing it: each token covers at most
    `longest` characters (halved: a normalizer may fold two characters into one)."""
    return math.ceil(prompt_chars(ask) / (2 * longest))
