"""An OpenAI-compatible HTTP server on the engine (FastAPI and uvicorn: pip install -e '.[serve]').

    python -m tunix_train.serve PATH [--host 127.0.0.1] [--port 8000] [--mesh_shape JSON] [--slots 16]
        [--max_len 2048]

Endpoints: POST /v1/chat/completions (the messages rendered with the model's chat template),
POST /v1/completions, GET /v1/models, GET /health (slots running, requests queued), GET /metrics
(the engine's counters: prefills, decode steps, tokens, seconds). Fields: model, max_tokens, temperature, top_p,
top_k (an extension), seed, stop, n, stream (server-sent events as OpenAI sends them, then
`data: [DONE]`); each response counts its usage. Concurrent requests share the engine's slots: one
thread runs a Session, adding requests as they arrive and handing each its tokens as they come
(continuous batching). A client that goes away frees its slot. Bad requests get OpenAI's error body
{"error": {"message", "type", "param", "code"}} with a 4xx status; SIGTERM lets uvicorn finish the
requests in flight (up to --drain_s seconds) and exit, by the signal (uvicorn re-raises it).
"""


import argparse
import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from typing import Any

from tunix_train import exit_codes
from tunix_train.cpu_devices import mesh_shape_argument


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class Generator:
    """The engine's session on a thread of its own: submit() queues a request and returns the
    asyncio queue its (tokens, finish) items arrive on; cancel() drops it."""

    def __init__(self, model, slots: int, max_len: int):
        from tunix_train.generate import Engine
        from tunix_train.generate.sampling import Kinds

        self.model, self.max_len = model, max_len
        self.engine = Engine(model.config, model.mesh, model.stop_ids, slots=slots,
                             decode=model.tokenizer.decode if model.tokenizer else None)
        self.session = self.engine.session(model.params, max_len, self.engine.slots_for(slots), Kinds(False, False, False))
        self._inbox: queue.Queue = queue.Queue()
        self._outputs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = iter(range(1 << 62))
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    def check(self, request) -> None:
        from tunix_train.config import ConfigError

        try:
            self.engine.check(request)
        except ConfigError as err:
            raise BadRequest(str(err), "max_tokens" if "max_new_tokens" in str(err) else "messages") from None
        if len(request.prompt) + request.max_new_tokens > self.max_len:
            raise BadRequest(f"the prompt's {len(request.prompt)} tokens plus max_tokens={request.max_new_tokens} "
                             f"pass this server's {self.max_len} tokens (--max_len)", "max_tokens",
                             code="context_length_exceeded")

    def submit(self, request) -> tuple[int, asyncio.Queue]:
        if not self.thread.is_alive():  # the engine failed (its error went to the requests then in flight)
            raise BadRequest("the engine has stopped after an error; restart the server", status=503,
                             code="engine_stopped")
        key, output = next(self._ids), asyncio.Queue()
        self._outputs[key] = (asyncio.get_running_loop(), output)
        self._inbox.put(("add", key, request))
        return key, output

    def cancel(self, key: int) -> None:
        self._inbox.put(("cancel", key, None))

    def stop(self) -> None:
        self._stopped.set()
        self.thread.join(timeout=30)

    def occupancy(self) -> dict[str, int]:
        return {"running": sum(r is not None for r in self.session.running), "queued": len(self.session.queue)}

    def stats(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.engine.stats.items()}

    def _run(self) -> None:
        rids: dict[int, int] = {}  # our key -> the session's request id
        keys: dict[int, int] = {}
        while not self._stopped.is_set():
            try:
                items = [self._inbox.get(timeout=0.05 if not self.session.busy else 0)]
            except queue.Empty:
                items = []
            while not self._inbox.empty():
                items.append(self._inbox.get_nowait())
            for action, key, request in items:
                if action == "add":
                    self.session.widen(request.sampling)
                    rids[key] = rid = self.session.add(request)
                    keys[rid] = key
                elif key in rids:
                    self.session.cancel(rids.pop(key))
                    keys.pop(key, None)
                    self._outputs.pop(key, None)
            if not self.session.busy:
                continue
            try:
                produced = self.session.step()
            except Exception as err:  # the engine failed (out of memory): every request in flight learns why
                for key in list(self._outputs):
                    self._send(key, ([], f"error: {' '.join(str(err).split())[:300]}"))
                raise
            for rid, tokens in produced:
                key = keys.get(rid)
                done = self.session.completions.get(rid)
                if key is None or done is None:
                    continue
                self._send(key, (tokens, done.finish))
                if done.finish is not None:
                    self.session.completions.pop(rid)
                    rids.pop(key, None), keys.pop(rid, None)

    def _send(self, key: int, item) -> None:
        target = self._outputs.get(key) if item[1] is None else self._outputs.pop(key, None)
        if target is not None:
            loop, output = target
            loop.call_soon_threadsafe(output.put_nowait, item)


def _number(body: dict, name: str, kind, default, low=None, high=None, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadRequest(f"'{name}' must be a {kind.__name__ if isinstance(kind, type) else 'number'}", name)
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        raise BadRequest(f"'{name}'={value} is out of range", name)
    return value


class Api:
    """The requests' parsing and the responses' shapes; `generator` does the work."""

    def __init__(self, model, generator: Generator, name: str):
        self.model, self.generator, self.name = model, generator, name

    def requests(self, body: dict, chat: bool):
        """The engine's requests for one API request (n of them), and the text after which a reply ends."""
        from tunix_train.config import ConfigError
        from tunix_train.data.chat import check_messages
        from tunix_train.generate import Request, Sampling

        if body.get("model") not in (None, self.name):
            raise BadRequest(f"The model '{body.get('model')}' does not exist (this server has '{self.name}')",
                             "model", 404, "model_not_found")
        tokenizer, ends = self.model.tokenizer, []
        if tokenizer is None:
            raise BadRequest("this model carries no tokenizer: it cannot serve text")
        try:
            if chat:
                messages = body.get("messages")
                if messages is None:
                    raise BadRequest("'messages' is a required property", "messages")
                prompt, _ = self.model.chat.encode(check_messages(messages, "messages"), add_generation_prompt=True)
                end = self.model.chat.end_of_turn()
                ends = [end] if end and len(tokenizer.encode(end)) > 1 else []
            else:
                text = body.get("prompt")
                if not isinstance(text, str):
                    raise BadRequest("'prompt' must be a string", "prompt")
                prompt = [tokenizer.bos_id, *tokenizer.encode(text)]
            stop = body.get("stop") or []
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
                raise BadRequest("'stop' must be a string or a list of up to 4 strings", "stop")
            max_tokens = _number(body, "max_tokens", int, 16) if not chat else _number(
                body, "max_completion_tokens", int, _number(body, "max_tokens", int, 256))
            if max_tokens <= 0:
                raise BadRequest(f"'max_tokens'={max_tokens} must be positive", "max_tokens")
            sampling = Sampling(_number(body, "temperature", (int, float), 1.0, 0, 2),
                                _number(body, "top_k", int, None, 1), _number(body, "top_p", (int, float), None, 0, 1,
                                                                             low_open=True))
            n, seed = _number(body, "n", int, 1, 1, 16), _number(body, "seed", int, None)
        except ConfigError as err:
            raise BadRequest(str(err)) from None
        seed = seed if seed is not None else uuid.uuid4().int & 0x7FFFFFFF
        requests = [Request(tuple(prompt), max_tokens, sampling, seed, i, tuple(stop + ends)) for i in range(n)]
        for request in requests:
            self.generator.check(request)
        return requests, ends

    def choice(self, chat: bool, index: int, text: str, finish: str | None, delta: bool) -> dict:
        if not chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if delta:
            return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def envelope(self, chat: bool, rid: str, choices: list, chunk: bool, usage: dict | None = None) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        out = {"id": rid, "object": kind, "created": int(time.time()), "model": self.name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


def app_for(model, generator: Generator, name: str):
    from fastapi import FastAPI, Request as HttpRequest

    from tunix_train.generate.session import before_stop
    from fastapi.responses import JSONResponse, StreamingResponse

    api, app = Api(model, generator, name), FastAPI(title="tunix_train")

    def error(err: BadRequest) -> JSONResponse:
        kind = "invalid_request_error" if err.status < 500 else "server_error"
        return JSONResponse({"error": {"message": str(err), "type": kind, "param": err.param, "code": err.code}},
                            status_code=err.status)

    @app.get("/health")
    def health():
        return {"status": "ok", "model": name, **generator.occupancy()}

    @app.get("/metrics")
    def metrics():
        return generator.stats()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tunix_train"}]}

    async def complete(http: HttpRequest, chat: bool):
        try:
            try:
                body = json.loads(await http.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise BadRequest(f"the body is not valid JSON ({err})") from None
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            requests, ends = api.requests(body, chat)
        except BadRequest as err:
            return error(err)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stops = list(requests[0].stop_strings)
        try:
            submitted = [generator.submit(r) for r in requests]
        except BadRequest as err:
            return error(err)
        tokenizer = model.tokenizer

        async def choices():
            """(index, new visible text, finish or None) as each request produces, then usage."""
            ids: list[list[int]] = [[] for _ in requests]
            shown = ["" for _ in requests]
            pending = {asyncio.ensure_future(out.get()): i for i, (_, out) in enumerate(submitted)}
            try:
                while pending:
                    finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for future in finished:
                        i = pending.pop(future)
                        tokens, finish = future.result()
                        if finish is not None and finish.startswith("error"):
                            raise RuntimeError(finish)
                        ids[i] += tokens
                        text, stopped = before_stop(tokenizer.decode(ids[i]), stops, finish is not None)
                        reason = None if finish is None else ("stop" if stopped or finish == "stop" else "length")
                        yield i, text[len(shown[i]):], reason, len(ids[i])
                        shown[i] = text
                        if finish is None:
                            pending[asyncio.ensure_future(submitted[i][1].get())] = i
            finally:
                for future in pending:
                    future.cancel()
                for key, _ in submitted:  # a client gone, or done: either way the slots are free
                    generator.cancel(key)

        prompt_tokens = len(requests[0].prompt) * len(requests)

        def usage(completion_tokens: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}

        if body.get("stream"):
            async def events():
                counts = [0] * len(requests)
                if chat:
                    first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(requests))]
                    yield f"data: {json.dumps(api.envelope(chat, rid, first, True))}\n\n"
                async for i, text, reason, count in choices():
                    counts[i] = count
                    if text or reason:
                        yield f"data: {json.dumps(api.envelope(chat, rid, [api.choice(chat, i, text, reason, True)], True))}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps(api.envelope(chat, rid, [], True, usage(sum(counts))))}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        texts, reasons, counts = [""] * len(requests), [None] * len(requests), [0] * len(requests)
        async for i, text, reason, count in choices():
            texts[i] += text
            reasons[i], counts[i] = reason, count
            if await http.is_disconnected():
                break
        return api.envelope(chat, rid, [api.choice(chat, i, texts[i], reasons[i], False) for i in range(len(requests))],
                            False, usage(sum(counts)))

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await complete(http, True)

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await complete(http, False)

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunix_train.serve", description=__doc__.split("\n")[0])
    parser.add_argument("path", help="a run, a Hugging Face directory or a GGUF file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--mesh_shape", default=None, help="JSON [[sizes], [axis names]] (default: all devices on fsdp)")
    parser.add_argument("--slots", type=int, default=16, help="requests decoded at once")
    parser.add_argument("--max_len", type=int, default=2048, help="prompt plus completion tokens of one request, at most")
    parser.add_argument("--name", default=None, help="the model's name in the API (default: the path's)")
    parser.add_argument("--drain_s", type=float, default=30.0, help="on SIGTERM, seconds for requests in flight")
    args = parser.parse_args(argv)
    try:
        mesh_shape = mesh_shape_argument(args.mesh_shape)
    except ValueError as err:
        print(f"tunix_train.serve: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    try:
        import uvicorn
    except ImportError:
        print("tunix_train.serve: error: serving needs FastAPI and uvicorn: pip install -e '.[serve]'", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    from pathlib import Path

    from tunix_train import api
    from tunix_train.config import ConfigError

    try:
        model = api.load(args.path, mesh_shape)
        if model.tokenizer is None:
            raise ConfigError(f"{args.path} carries no tokenizer: a server needs one")
        if args.slots < 1 or args.max_len < 2:
            raise ConfigError("--slots must be >= 1 and --max_len >= 2")
        limit = model.config.context_length
        generator = Generator(model, args.slots, min(args.max_len, limit or args.max_len))
    except ConfigError as err:
        print(f"tunix_train.serve: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    name = args.name or Path(args.path).name
    print(f"serving {name} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app_for(model, generator, name), host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=args.drain_s)
    generator.stop()
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
