"""Chat templates: a conversation rendered to token ids, and which of them a role wrote.

Where a run's template comes from, first found: `data.chat_template` (a Jinja file); beside the
tokenizer, `chat_template.jinja`, else tokenizer_config.json's `chat_template`; a GGUF file's
`tokenizer.chat_template`; else Gemma's turn format (GEMMA_TEMPLATE: every model here is a Gemma).

Rendering is transformers' `apply_chat_template`'s (utils/chat_template_utils.py): Jinja2's
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks and the loopcontrols extension, the
globals raise_exception and strftime_now, a tojson that leaves HTML alone, the tokenizer's special
tokens as variables (bos_token, eos_token, ...), and `{% generation %}` blocks marking the text the
assistant writes. The text is tokenized whole, the template's special tokens becoming their ids,
and a token belongs to a span of text when it overlaps it (transformers' assistant mask).

A message's span: for the assistant, its `{% generation %}` text where the template has those
markers; otherwise what rendering the conversation up to it adds to rendering the messages before
it (for the assistant, before it and the generation prompt, so that the turn's header, which the
prompt supplies at inference, is not the assistant's), less the whitespace that ends it (the
separator after a turn's end token, which no model generates).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tunix_train.config import CHAT_ROLES as ROLES
from tunix_train.config import ConfigError
from tunix_train.data.images import ImageTokens, content_parts, split_images
from tunix_train.data.jinja_sandbox import Rendering, compiled_template
from tunix_train.data.tokenizer import with_bos

# Gemma's turn format (Gemma 1-3 "-it" models): a system message opens the first user turn, the
# assistant speaks as "model", each turn ends with <end_of_turn>. The assistant's text and its
# <end_of_turn> are what it generates.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- macro text_of(content) -%}
{%- if content is string -%}{{ content | trim }}
{%- else -%}{%- for part in content -%}
{%- if part['type'] == 'image' -%}{{ image_marker | default('<start_of_image>') }}{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}
{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = text_of(messages[0]['content']) + '\n\n' -%}
{%- set turns = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set turns = messages -%}
{%- endif -%}
{%- if tools -%}
{%- set declarations -%}
{%- for tool in tools -%}
{%- set f = tool['function'] if tool['function'] is defined else tool -%}
{%- set properties = f['parameters']['properties'] if f['parameters'] is defined and f['parameters']['properties'] is defined else {} -%}
{{ f['name'] }}({% for name, p in properties.items() %}{{ name }}: {{ p['type'] }}{{ ', ' if not loop.last }}{% endfor %}): {{ f['description'] }}
{% endfor -%}
{%- endset -%}
{%- set first_user_prefix = 'Tools:\n' + declarations + 'Call one as <tool_call>{"name":...,"arguments":{...}}</tool_call>.\n\n' + first_user_prefix -%}
{%- endif -%}
{%- for message in turns -%}
{%- set previous = turns[loop.index0 - 1]['role'] if not loop.first else 'assistant' -%}
{%- if (message['role'] == 'assistant') == (previous == 'assistant') and not (message['role'] == 'tool' and previous == 'tool') or (message['role'] == 'tool' and loop.first) -%}
{{ raise_exception('Gemma conversations alternate user and assistant turns, starting with the user; tool results follow the assistant') }}
{%- endif -%}
{%- if message['role'] == 'assistant' -%}
<start_of_turn>model
{% generation %}{{ text_of(message['content']) }}<end_of_turn>{% endgeneration %}{{ '\n' }}
{%- elif message['role'] == 'tool' -%}
{{ '<start_of_turn>user\n' if previous != 'tool' else '' }}<tool_response>{{ message['content'] | trim }}</tool_response>
{{- '<end_of_turn>\n' if loop.last or turns[loop.index0 + 1]['role'] != 'tool' else '\n' }}
{%- else -%}
<start_of_turn>user
{{ (first_user_prefix if loop.first else '') + text_of(message['content']) }}<end_of_turn>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<start_of_turn>model
{% endif -%}
"""  # noqa: E501 (a template: its lines are its text)


class ChatTemplate:
    """A Jinja chat template and the tokenizer whose special tokens it writes; image_tokens: how
    the images it places become tokens (a model with model.vision), else None."""

    def __init__(self, template: str, source: str, tokenizer, image_tokens: ImageTokens | None = None):
        self.template, self.tokenizer, self.source = template, tokenizer, source
        self.image_tokens = image_tokens
        self.allow_control_tokens = False  # may a message's text write control_tokens?
        # Gemma's turn format writes this for an image part (a tokenizer's own template, its own)
        self._image_marker = {} if image_tokens is None else {"image_marker": image_tokens.marker}
        self.has_generation_markers = re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None
        try:
            self._compiled, self._tracked = compiled_template(template)
        except Exception as err:
            raise ConfigError(f"{source}: not a Jinja template ({' '.join(str(err).split())})") from None
        self.variables = {
            name: tokenizer.token(i)
            for name, i in (
                ("bos_token", tokenizer.bos_id),
                ("eos_token", tokenizer.eos_id),
                ("pad_token", tokenizer.pad_id),
            )
            if i >= 0
        }

    def render(
        self, messages: Sequence[dict], add_generation_prompt: bool = False, **variables
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its {% generation %} blocks."""
        blocks: list[str] = []
        rendering = Rendering()
        token = self._tracked.set(rendering)
        try:
            for block in self._compiled.generate(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **{**self.variables, **self._image_marker, **variables},
            ):
                blocks.append(block)
                rendering.grew(len(block))
        except Exception as err:  # RecursionError and MemoryError too: a conversation or template gone wrong
            raise ConfigError(
                f"{self.source} fails on a conversation: {' '.join(str(err).split())[:300]}"
            ) from None
        finally:
            self._tracked.reset(token)
        return "".join(blocks), rendering.spans

    def spans(
        self, messages: Sequence[dict], roles: Sequence[str], **variables
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the spans of the messages whose role is in `roles`."""
        text, generated = self.render(messages, **variables)
        spans = list(generated) if "assistant" in roles and self.has_generation_markers else []
        for i, message in enumerate(messages):
            role = message["role"]
            if role not in roles or (role == "assistant" and self.has_generation_markers):
                continue
            before, _ = self.render(messages[:i], add_generation_prompt=role == "assistant", **variables)
            through, _ = self.render(messages[: i + 1], **variables)
            if not (text.startswith(through) and through.startswith(before)):
                raise ConfigError(
                    f"{self.source} does not render a conversation's first messages as the start of "
                    f"the whole, so a message's tokens cannot be told apart: use a template with "
                    f"{{% generation %}} markers (data.chat_template)"
                )
            spans.append((len(before), len(through.rstrip())))
        return text, sorted(spans)

    @functools.cached_property
    def control_tokens(self) -> tuple[str, ...]:
        """The tokens that structure a conversation, which a message's text may not write (it would
        open a turn, or place an image, that the template did not): BOS, EOS, pad, the image
        tokens, and each marker token (<...>) the template writes around a sample conversation."""
        t = self.tokenizer
        found = {t.token(i) for i in (t.bos_id, t.eos_id, t.pad_id) if i >= 0}
        if self.image_tokens is not None:
            it = self.image_tokens
            found |= {it.boi, it.eoi, it.image, it.marker}
        sample = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        for messages in ([{"role": "system", "content": "s"}, *sample], sample):
            try:
                text = self.render(messages, add_generation_prompt=False)[0]
            except ConfigError:  # a template without a system role
                continue
            found |= {t.token(i) or "" for i in t.encode_with_offsets(text)[0]}
        return tuple(sorted(x for x in found if re.fullmatch(r"<[^<>\s]+>", x or "")))

    def control_token_in(self, text: str) -> str | None:
        """The first of control_tokens that `text` writes, or None."""
        return next((c for c in self.control_tokens if c in text), None)

    def refuse_control_tokens(self, messages: Sequence[dict]) -> None:
        """A one-line error for a message whose text writes one of control_tokens."""
        for i, message in enumerate(messages):
            content = message.get("content")
            parts = [content] if isinstance(content, str) else [p.get("text") for p in content or []]
            for text in (p for p in parts if isinstance(p, str)):
                if found := self.control_token_in(text):
                    raise ConfigError(
                        f"message {i}'s text writes {found}, a control token of this template, which "
                        f"a message may not: it would become a turn or an image the template did not "
                        f"write (a data file that means it: data.control_tokens_in_messages=true)"
                    )

    def end_of_turn(self) -> str:
        """The text the template writes after an assistant's message ('<end_of_turn>' in Gemma's
        format): where a reply stops. The end of sequence a template writes after the last message
        (Phi-3's) ends the conversation, not the turn."""
        marker = "\u2063reply\u2063"  # no template writes it
        text, _ = self.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": marker}])
        if marker not in text:
            raise ConfigError(f"{self.source} does not write an assistant's message")
        end = text[text.rindex(marker) + len(marker) :].strip()
        eos = self.variables.get("eos_token")
        return end.removesuffix(eos).strip() if eos and end != eos and end.endswith(eos) else end

    def end_of_turn_id(self) -> int:
        """The end of turn's token id, where a generated reply stops; a ConfigError when it is not one
        token."""
        ids = self.tokenizer.encode_with_offsets(self.end_of_turn())[0]
        if len(ids) != 1:
            raise ConfigError(
                f"{self.source}: its end of turn {self.end_of_turn()!r} is not one token of this "
                f"tokenizer, so a reply cannot stop at it; use a tokenizer that has it (the bundled "
                f"one with Gemma's turn tokens: tunix_train.rewards.calculator.write_tokenizer)"
            )
        return ids[0]

    def encode(
        self,
        messages: Sequence[dict],
        roles: Sequence[str] = ("assistant",),
        add_generation_prompt: bool = False,
        images=None,
        crops=None,
        **variables,
    ) -> tuple[list[int], list[bool]]:
        """Token ids of the rendered conversation and, for each, whether a message of `roles` wrote
        it (never an image's token); `variables` (tools=[schemas]) go to the template. Image parts
        should come as split_images leaves them; with image_tokens each becomes its tokens (images:
        their arrays, which say how many where an image's count is its own; crops: pan-and-scan's
        crops after each image, ImageTokens.expand). A message's text may write control_tokens only
        where the template allows it (allow_control_tokens: a data file's data.control_tokens_in_messages)."""
        if not self.allow_control_tokens:
            self.refuse_control_tokens(messages)
        if add_generation_prompt:
            text, spans = self.render(messages, add_generation_prompt=True, **variables)[0], []
        else:
            text, spans = self.spans(messages, roles, **variables)
        if self.image_tokens is not None:
            text, spans = self.image_tokens.expand(text, spans, images, crops)
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        mask = _overlapping(offsets, spans)
        if self.image_tokens is not None:
            mask = [m and i != self.image_tokens.image_id for m, i in zip(mask, ids)]
        return ids, mask


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """For each token's (start, end), whether it overlaps one of `spans`: in n log n (a conversation
    of 10,000 turns has as many spans)."""
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    if not merged or not offsets:
        return [False] * len(offsets)
    starts, ends = np.array(merged).T
    token = np.asarray(offsets).reshape(-1, 2)
    first = np.searchsorted(ends, token[:, 0], side="right")  # the first span ending after the start
    inside = first < len(ends)
    return (inside & (starts[np.minimum(first, len(ends) - 1)] < token[:, 1])).tolist()


def check_messages(messages: Any, where: str, field: str = "messages", parts: bool = False) -> list[dict]:
    """A conversation as a list of {role, content} dicts, or a one-line error naming `where`.
    parts: a content may also be a list of parts as transformers' processors take them,
    {"type": "text", "text": ...}, {"type": "image", ...} and {"type": "image_url", "image_url":
    {"url": ...}} (split_images reads the images)."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: {field!r} must be a non-empty list of {{role, content}} objects")
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str) and not (parts and content_parts(content, where)):
            raise ConfigError(
                f"{where}: every message needs a string 'content'{' or a list of parts' if parts else ''} "
                f"(got {json.dumps(message, default=str)[:80]})"
            )
        if message.get("role") not in ROLES:
            raise ConfigError(f"{where}: unknown role {message.get('role')!r} (roles: {', '.join(ROLES)})")
    return messages


def find_template(override: str | None, tokenizer_source: str | Path | None) -> tuple[str, str]:
    """The chat template's text and where it came from (see the module's docstring)."""
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.chat_template: no such file {path}")
        return path.read_text(encoding="utf-8"), str(path)
    if tokenizer_source:
        source = Path(tokenizer_source).expanduser()
        if source.suffix == ".gguf":
            from tunix_train.interop.gguf import open_gguf

            field = open_gguf(source).get_field("tokenizer.chat_template")
            if field is not None:
                return field.contents(), f"{source} (tokenizer.chat_template)"
        else:
            directory = source if source.is_dir() else source.parent
            if (directory / "chat_template.jinja").is_file():
                return (directory / "chat_template.jinja").read_text(encoding="utf-8"), str(
                    directory / "chat_template.jinja"
                )
            config = directory / "tokenizer_config.json"
            if config.is_file():
                template = json.loads(config.read_text()).get("chat_template")
                if isinstance(template, list):  # named templates: the default one
                    template = next((t["template"] for t in template if t.get("name") == "default"), None)
                if isinstance(template, str):
                    return template, f"{config} (chat_template)"
    return GEMMA_TEMPLATE, "Gemma's turn format"


def prompt_ids(prompt: str | list[dict], tokenizer, chat: "ChatTemplate | None", images=None) -> list[int]:
    """A prompt's token ids: text as [BOS] text; a conversation as the chat template renders it
    with the generation prompt (the assistant's turn opened), its images' arrays saying how many
    tokens each takes where that varies (Gemma 4)."""
    if isinstance(prompt, str):
        return with_bos(tokenizer, tokenizer.encode(prompt))
    return chat.encode(split_images(prompt)[0], add_generation_prompt=True, images=images)[0]


def completion_ids(
    prompt: str | list[dict],
    completion: str | list[dict],
    tokenizer,
    chat: "ChatTemplate | None",
    images=None,
) -> list[int]:
    """The tokens that follow the prompt's (prompt_ids) for a completion: after a text prompt, the
    text and EOS; after a conversation, the assistant's turn (a string, or assistant messages) as
    the template renders it, through its end of turn."""
    if isinstance(prompt, str):
        if not isinstance(completion, str):
            raise ConfigError("a completion in messages needs its prompt in messages too")
        return [*tokenizer.encode(completion), tokenizer.eos_id]
    turns = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
    start = prompt_ids(prompt, tokenizer, chat, images)
    ids, mask = chat.encode(split_images([*prompt, *turns])[0], images=images)
    if ids[: len(start)] != start:
        raise ConfigError(
            f"{chat.source} does not render a prompt with its generation prompt as the start of the "
            f"prompt and its answer, so the answer's tokens cannot be told apart"
        )
    last = max((k for k, m in enumerate(mask) if m), default=len(ids) - 1)
    return ids[len(start) : last + 1]  # not the separator after the end of turn
