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
    parser.add_argument("--slots", type=int, default=16, help="requests decoded at once")
    parser.add_argument(
        "--max_len", type=int, default=2048, help="prompt plus completion tokens of one request, at most"
    )
    parser.add_argument("--name", default=None, help="the model's name in the API (default: the path's)")
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
        "--max_queue", type=int, default=256, help="requests waiting for a slot, at most (then 429)"
    )
    parser.add_argument(
        "--max_body_bytes", type=int, default=2 << 20, help="a request body's size, at most (then 413)"
    )
    parser.add_argument(
        "--request_timeout_s", type=float, default=600.0, help="a reply's time, at most (then 504)"
    )
    parser.add_argument(
        "--max_image_bytes",
        type=int,
        default=10 << 20,
        help="an image's size in a chat request, at most (then 413; the body must fit --max_body_bytes too)",
    )
    parser.add_argument(
        "--max_images", type=int, default=8, help="images in one chat request, at most (then 400)"
    )
    parser.add_argument(
        "--max_image_pixels",
        type=int,
        default=32 << 20,
        help="pixels of one request's images together, read from their headers before any is decoded, "
        "at most (then 400)",
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
    except ValueError as err:
        return fail(err)
    for flag, value in (
        ("--slots", args.slots),
        ("--max_queue", args.max_queue + 1),
        ("--max_body_bytes", args.max_body_bytes),
        ("--request_timeout_s", args.request_timeout_s),
        ("--max_image_bytes", args.max_image_bytes),
        ("--max_images", args.max_images + 1),
        ("--max_image_pixels", args.max_image_pixels),
    ):
        if value <= 0:
            return fail(f"{flag}={value} must be positive")
    if args.max_len < 2:
        return fail("--max_len must be >= 2")
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

    server = None

    def on_death():  # the engine's thread has died: stop serving, exit non-zero
        if server is not None:
            server.should_exit = True

    try:
        model = api.load(args.path, mesh_shape)
        if model.tokenizer is None:
            raise ConfigError(f"{args.path} carries no tokenizer: a server needs one")
        limit = model.config.context_length
        generator = Generator(
            model, args.slots, min(args.max_len, limit or args.max_len), args.max_queue, on_death
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
