"""The HTTP side: the routes (app_for) and the responses' shapes, streamed or whole (Api). Who may
call is access.py's; reading and tokenizing a request off the event loop, preparer.py's.

Every wait has a bound: a body is read within preparer.BODY_SECONDS, a reply within
--request_timeout_s, and a request whose engine has stopped learns it within a second.
"""

import asyncio
import dataclasses
import json
import logging
import time
import uuid

from tunix_train.serve import schema, tokens
from tunix_train.serve.access import Access, Guard
from tunix_train.serve.images import Images
from tunix_train.serve.preparer import Preparer
from tunix_train.serve.schema import BadRequest
from tunix_train.serve.worker import Generator


class Api:
    """A request's engine requests (tokenized here, on a worker thread), and the responses' shapes."""

    def __init__(self, model, generator: Generator, name: str, images: Images = Images()):
        self.model, self.generator, self.name, self.images = model, generator, name, images
        self.longest = schema.longest_token_chars(model.tokenizer)

    def prepare(self, data: bytes, chat: bool):
        """(the checked request, its engine requests: n for each prompt, choice j * n + i)."""
        from tunix_train.config import ConfigError
        from tunix_train.generate import Request, Sampling

        if chat:  # before parsing: a body of 10,000 images would be 50,000 objects to collect
            self.images.count_marks(data)
        ask = schema.read(schema.parse_json(data), chat, self.name)
        limit = self.generator.max_len
        at_least = schema.at_least_tokens(ask, self.longest)
        if at_least >= limit:
            raise BadRequest(
                f"the prompt's {schema.prompt_chars(ask)} characters are more tokens than this server's "
                f"{limit} (--max_len)",
                "messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        tokenizer, ends, pixels = self.model.tokenizer, [], None
        try:
            sampling = Sampling(ask.temperature, ask.top_k, ask.top_p)
            if chat:
                from tunix_train.data.images import fewest_tokens, split_images

                messages, urls = split_images(ask.prompt)
                if urls:
                    self.images.count(urls, at_least, fewest_tokens(self.model.config.vision), limit)
                    blobs = [self.images.read(u) for u in urls]
                    pixels = self.images.decoded_pixels(self.model, blobs)
                prompt, _ = self.model.chat.encode(messages, add_generation_prompt=True, images=pixels)
                prompts = [prompt]
                end = self.model.chat.end_of_turn()
                ends = [end] if end and len(tokenizer.encode(end)) > 1 else []
            else:
                prompts = [self._text_prompt(p) for p in ask.prompt]
        except ConfigError as err:
            raise BadRequest(str(err), "messages" if chat else None) from None
        longest = max(len(p) for p in prompts)
        max_tokens = max(limit - longest, 1) if ask.max_tokens is None else ask.max_tokens
        requests = [
            Request(
                tuple(p),
                max_tokens,
                sampling,
                ask.seed,
                j * ask.n + i,
                ask.stop + tuple(ends),
                pixels,
                ask.speculative,
            )
            for j, p in enumerate(prompts)
            for i in range(ask.n)
        ]
        for request in requests:  # echo's max_tokens=0 generates nothing, but the prompt must fit
            self.generator.check(dataclasses.replace(request, max_new_tokens=max(max_tokens, 1)))
        return ask, requests

    def _text_prompt(self, prompt) -> list[int]:
        """A text (BOS first where the tokenizer adds one) or token ids (as they are) as ids."""
        from tunix_train.data.tokenizer import with_bos

        tokenizer = self.model.tokenizer
        if not isinstance(prompt, str):
            if not all(0 <= t < tokenizer.vocab_size for t in prompt):
                raise BadRequest(f"a prompt's token ids must be in [0, {tokenizer.vocab_size})", "prompt")
            return list(prompt)
        if found := self.model.chat.control_token_in(prompt):
            raise BadRequest(
                f"the prompt writes {found}, a control token of this model's template, which a "
                f"prompt's text may not; send a conversation to /v1/chat/completions",
                "prompt",
                code="control_token",
            )
        return with_bos(tokenizer, tokenizer.encode(prompt))

    def choice(
        self, chat: bool, index: int, text: str, finish: str | None, delta: bool, logprobs: dict | None = None
    ) -> dict:
        if not chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if delta:
            return {
                "index": index,
                "delta": {"content": text} if text else {},
                "logprobs": None,
                "finish_reason": finish,
            }
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }

    def envelope(self, chat: bool, rid: str, choices: list, chunk: bool, usage: dict | None = None) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        out = {"id": rid, "object": kind, "created": int(time.time()), "model": self.name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


def app_for(
    model,
    generator: Generator,
    name: str,
    access: Access = Access(),
    request_timeout_s: float = 600.0,
    max_preparing: int = 64,
    images: Images = Images(),
):
    from fastapi import FastAPI
    from fastapi import Request as HttpRequest
    from fastapi.responses import JSONResponse

    api, app = (
        Api(model, generator, name, images),
        FastAPI(title="tunix_train", docs_url=None, redoc_url=None, openapi_url=None),
    )
    preparer = Preparer(request_timeout_s, access.max_body_bytes, max_preparing)

    @app.get("/health")
    def health():
        if not generator.alive:
            return JSONResponse({"status": "engine stopped", "model": name, "error": generator.error}, 503)
        if stuck := preparer.stuck_s():
            why = f"a request has been read and tokenized for {stuck:.0f} s (--request_timeout_s)"
            return JSONResponse({"status": "worker stuck", "model": name, "error": why}, 503)
        return {"status": "ok", "model": name, **generator.occupancy()}

    @app.get("/metrics")
    def metrics():
        return generator.stats()

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tunix_train"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await _complete(api, preparer, http, True, request_timeout_s)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await _complete(api, preparer, http, False, request_timeout_s)

    @app.get("/tokenizer_info")
    def tokenizer_info():
        return tokens.tokenizer_info(model.tokenizer, generator.max_len)

    async def tokenizer_call(http: HttpRequest, work):
        try:
            return await preparer.read(http, work, time.monotonic() + request_timeout_s)
        except BadRequest as err:
            return error(err)

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest):
        return await tokenizer_call(
            http, lambda data: tokens.tokenize(model.tokenizer, data, generator.max_len)
        )

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest):
        return await tokenizer_call(http, lambda data: tokens.detokenize(model.tokenizer, data))

    @app.exception_handler(Exception)
    async def unexpected(
        http: HttpRequest, err: Exception
    ):  # a bug of ours: the client gets JSON, the log its traceback, and the server goes on
        logging.getLogger("tunix_train.serve").error("internal error", exc_info=err)
        return error(BadRequest(f"internal error ({type(err).__name__})", status=500, code="internal_error"))

    return Guard(app, access)


def error(err: BadRequest):
    from fastapi.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _complete(api: Api, preparer: Preparer, http, chat: bool, request_timeout_s: float):
    """A completion's response: whole, or (stream) its events."""
    from fastapi.responses import StreamingResponse

    generator, model = api.generator, api.model
    deadline = time.monotonic() + request_timeout_s  # reading, tokenizing and decoding count
    try:
        ask, requests = await preparer.read(http, lambda data: api.prepare(data, chat), deadline)
        submitted = generator.submit(requests) if ask.max_tokens != 0 else []
    except BadRequest as err:
        return error(err)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    stops = list(requests[0].stop_strings)
    prompt_tokens = sum(len(r.prompt) for r in requests)

    def usage(completion_tokens: int) -> dict:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    replies = _replies(http, generator, model.tokenizer, ask, submitted, stops, deadline, request_timeout_s)
    if ask.stream:
        return StreamingResponse(
            _events(api, chat, rid, ask, len(requests), replies, usage), media_type="text/event-stream"
        )
    texts, reasons, ids = [""] * len(requests), ["length"] * len(requests), [[] for _ in requests]
    try:
        async for i, text, reason, got in replies:
            texts[i] += text
            reasons[i], ids[i] = reason, got
        scores = [None] * len(requests)
        if ask.logprobs is not None:  # the model's, after the reply: the prompt's too with echo
            scores = await preparer(b"", lambda _: tokens.logprobs(model, ask, requests, ids), deadline)
    except BadRequest as failed:
        return error(failed)
    if ask.echo:
        texts = [model.tokenizer.decode(list(r.prompt)) + t for r, t in zip(requests, texts)]
    choices = [api.choice(chat, i, texts[i], reasons[i], False, scores[i]) for i in range(len(requests))]
    return api.envelope(chat, rid, choices, False, usage(sum(map(len, ids))))


async def _replies(
    http, generator: Generator, tokenizer, ask, submitted, stops, deadline: float, timeout_s: float
):
    """(index, new visible text, finish or None, its token ids so far) as each submitted request produces;
    a BadRequest when the engine stops or fails or the deadline passes; nothing more once a client
    that waits for the whole reply has gone. The requests' slots are freed however it ends."""
    from tunix_train.generate.session import before_stop

    ids: list[list[int]] = [[] for _ in submitted]
    shown = ["" for _ in submitted]
    pending = {asyncio.ensure_future(out.get()): i for i, (_, out) in enumerate(submitted)}
    looked = time.monotonic()  # when the engine, the deadline and the client were last looked at
    try:
        while pending:
            finished, _ = await asyncio.wait(pending, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if time.monotonic() - looked >= 1.0 or not finished:
                looked = time.monotonic()
                if not generator.alive:
                    raise BadRequest(
                        f"the engine has stopped ({generator.error})", status=503, code="engine_stopped"
                    )
                if looked > deadline:
                    raise BadRequest(
                        f"the reply took more than {timeout_s:g} s (--request_timeout_s)",
                        status=504,
                        code="timeout",
                    )
                if not ask.stream and await http.is_disconnected():  # a stream's is noticed by starlette
                    return
            for future in finished:
                i = pending.pop(future)
                tokens, finish = future.result()
                if finish is not None and finish.startswith("error"):
                    raise BadRequest(
                        f"the engine failed this request ({finish[7:]})", status=500, code="engine_error"
                    )
                ids[i] += tokens
                text, stopped = before_stop(tokenizer.decode(ids[i]), stops, finish is not None)
                reason = None if finish is None else ("stop" if stopped or finish == "stop" else "length")
                yield i, text[len(shown[i]) :], reason, list(ids[i])
                shown[i] = text
                if finish is None:
                    pending[asyncio.ensure_future(submitted[i][1].get())] = i
    finally:
        for future in pending:
            future.cancel()
        for key, _ in submitted:  # a client gone, or done: either way the slots are free
            generator.cancel(key)


async def _events(api: Api, chat: bool, rid: str, ask, n: int, replies, usage):
    """A streamed reply's server-sent events: (for chat) each choice's role first, then each piece
    of text and finish, the usage if asked, an engine's failure as one event, and [DONE]."""
    counts = [0] * n
    if chat:
        first = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(n)
        ]
        yield f"data: {json.dumps(api.envelope(chat, rid, first, True))}\n\n"
    try:
        async for i, text, reason, tokens in replies:
            counts[i] = len(tokens)
            if text or reason:
                choice = api.choice(chat, i, text, reason, True)
                yield f"data: {json.dumps(api.envelope(chat, rid, [choice], True))}\n\n"
        if ask.include_usage:
            yield f"data: {json.dumps(api.envelope(chat, rid, [], True, usage(sum(counts))))}\n\n"
    except BadRequest as failed:  # the engine's failure, as OpenAI streams one: an event
        yield f"data: {json.dumps(failed.body())}\n\n"
    yield "data: [DONE]\n\n"
