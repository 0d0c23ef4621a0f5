"""python -m tunix_train.serve PATH: load a model, start the engine's thread, serve until SIGTERM
(uvicorn finishes the requests in flight, up to --drain_s, and re-raises the signal) or until the
engine's thread dies (exit 1, so that a supervisor restarts the server)."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from tunix_train import exit_codes
from tunix_train.cpu_devices import mesh_shape_argument

API_KEY_VARIABLE = "TUNIX_API_KEY"
# What the server holds and what one request may take: flag, type, default, least value, help
BOUNDS = (
    ("--slots", int, 16, 1, "requests decoded at once"),
    ("--max_len", int, 2048, 2, "prompt plus completion tokens of one request, at most"),
    ("--max_queue", int, 256, 0, "requests waiting for a slot, at most (then 429)"),
    ("--max_body_bytes", int, 2 << 20, 1, "a request body's size, at most (then 413)"),
    ("--request_timeout_s", float, 600.0, 1e-3, "a reply's time, at most (then 504)"),
    (
        "--max_image_bytes",
        int,
        10 << 20,
        1,
        "an image's size in a chat request, at most (then 413; the body must fit --max_body_bytes too)",
    ),
    ("--max_images", int, 8, 0, "images in one chat request, at most (then 400)"),
    (
        "--max_image_pixels",
        int,
        32 << 20,
        1,
        "pixels of one request's images together, read from their headers before any is decoded, "
        "at most (then 400)",
    ),
)


def _arguments(argv):
    parser = argparse.ArgumentParser(
        prog="python -m tunix_train.serve",
        description="An OpenAI-compatible server on the engine (docs/serving.md)",
    )
    parser.add_argument("path", help="a run, a Hugging Face directory or a GGUF file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--mesh_shape", default=None, help="JSON [[sizes], [axis names]] (default: all devices on fsdp)"
    )
    for flag, kind, default, _, text in BOUNDS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--name", default=None, help="the model's name in the API (default: the path's)")
    parser.add_argument("--draft", default=None, help="a draft model's checkpoint: speculative decoding")
    parser.add_argument(
        "--prompt_lookup", type=int, default=0, help="speculative decoding by n-grams up to N of the context"
    )
    parser.add_argument(
        "--draft_mesh_shape",
        default=None,
        help="the draft's own split of the devices, JSON [[sizes], [axis names]] (default: the model's mesh)",
    )
    parser.add_argument("--speculative_tokens", type=int, default=4, help="tokens drafted a round")
    parser.add_argument(
        "--adaptive_speculation",
        action="store_true",
        help="each chunk drafts as many of up to --speculative_tokens as pay (none when none do)",
    )
    parser.add_argument(
        "--drain_s", type=float, default=30.0, help="on SIGTERM, seconds for requests in flight"
    )
    parser.add_argument(
        "--api_key",
        default=None,
        help=f"the key clients send as 'Authorization: Bearer KEY' (default: ${API_KEY_VARIABLE}; "
        f"none: no key asked)",
    )
    parser.add_argument(
        "--allow_remote_images",
        action="store_true",
        help="fetch image_url parts' http(s) URLs (default: data: URIs only; files never)",
    )
    parser.add_argument(
        "--allowed_hosts",
        default=None,
        help="comma-separated Host names the server answers to, '*' for any (default: localhost "
        "names and --host's; the machine's names and addresses when --host is 0.0.0.0 or ::)",
    )
    parser.add_argument(
        "--allowed_origins",
        default=None,
        help="comma-separated host names browsers may call from (Origin), '*' for any (default: "
        "localhost names)",
    )
    return parser.parse_args(argv)


def _default_hosts(host: str) -> tuple[str, ...]:
    from tunix_train.serve.access import LOOPBACK

    if host not in ("0.0.0.0", "::", ""):
        return (*LOOPBACK, host.lower().strip("[]"))
    name = socket.gethostname()
    try:
        addresses = socket.gethostbyname_ex(name)[2]
    except OSError:
        addresses = []
    return (*LOOPBACK, name.lower(), socket.getfqdn().lower(), *addresses)


def _names(value: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    return (
        default
        if value is None
        else tuple(v.strip().lower().strip("[]") for v in value.split(",") if v.strip())
    )


def fail(message) -> int:
    print(f"tunix_train.serve: error: {message}", file=sys.stderr)
    return exit_codes.CONFIG_ERROR


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    try:
        mesh_shape = mesh_shape_argument(args.mesh_shape)
        draft_mesh_shape = mesh_shape_argument(args.draft_mesh_shape, "--draft_mesh_shape")
    except ValueError as err:
        return fail(err)
    for flag, _, _, least, _ in BOUNDS:
        value = getattr(args, flag[2:])
        if not value >= least:  # nan too
            return fail(f"{flag}={value} must be at least {least}")
    try:
        import uvicorn

        from tunix_train.serve.access import Access
        from tunix_train.serve.app import app_for
        from tunix_train.serve.connections import header_deadline
        from tunix_train.serve.images import Images
        from tunix_train.serve.worker import Generator
    except ImportError:
        return fail("serving needs FastAPI and uvicorn: pip install -e '.[serve]'")
    from pathlib import Path

    from tunix_train import api
    from tunix_train.config import ConfigError
    from tunix_train.generate.speculative import Speculation

    server = None

    def on_death():  # the engine's thread has died: stop serving, exit non-zero
        if server is not None:
            server.should_exit = True

    try:
        if args.draft and args.prompt_lookup:  # before the model loads
            raise ConfigError("give --draft or --prompt_lookup, not both")
        if args.adaptive_speculation and not (args.draft or args.prompt_lookup):
            raise ConfigError("--adaptive_speculation needs a drafter: give --draft or --prompt_lookup")
        if draft_mesh_shape and not args.draft:
            raise ConfigError("--draft_mesh_shape is a draft model's: give --draft")
        model = api.load(args.path, mesh_shape)
        if model.tokenizer is None:
            raise ConfigError(f"{args.path} carries no tokenizer: a server needs one")
        limit = model.config.context_length
        generator = Generator(
            model,
            args.slots,
            min(args.max_len, limit or args.max_len),
            args.max_queue,
            on_death,
            Speculation(
                args.speculative_tokens, lookup=args.prompt_lookup, adaptive=args.adaptive_speculation
            )
            if args.prompt_lookup
            else args.draft and model.load_draft(args.draft, draft_mesh_shape),
            args.speculative_tokens,
            args.adaptive_speculation,
        )
    except ConfigError as err:
        return fail(err)
    name = args.name or Path(args.path).name
    access = Access(
        args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
        _names(args.allowed_hosts, _default_hosts(args.host)),
        _names(args.allowed_origins, Access.origins),
        args.max_body_bytes,
    )
    images = Images(
        args.max_image_bytes,
        args.allow_remote_images,
        max_images=args.max_images,
        max_pixels=args.max_image_pixels,
    )
    app = app_for(model, generator, name, access, args.request_timeout_s, images=images)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=args.drain_s,
            http=header_deadline(),
        )
    )
    print(
        f"serving {name} on http://{args.host}:{args.port}/v1"
        f"{'' if access.api_key else ' (no API key asked: --api_key)'}",
        flush=True,
    )
    server.run()
    generator.stop()
    if generator.error is not None:
        print(f"tunix_train.serve: error: the engine stopped ({generator.error})", file=sys.stderr)
        return exit_codes.FAILED
    return exit_codes.OK
