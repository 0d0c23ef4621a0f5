"""The OpenAI-compatible server under load: 32 streaming requests at once against the same 32 one
after another, through the `openai` client on 127.0.0.1; or, with --soak, a soak test.

    python scripts/benchmark_serve.py [--model gemma3_tiny] [--requests 32] [--max-tokens 32] [--slots 32]
    python scripts/benchmark_serve.py --soak 600 [--clients 256]
    python scripts/benchmark_serve.py --soak 600 --model gemma3_vision_tiny --images 0.3

--soak SECONDS: --clients threads each send, in a loop, a valid request (70%, half of them
streamed; one of 64 fixed requests, sampled with its seed), an invalid one (15%) or a stream they
leave after its first event (15%). At the end every valid reply must equal its request's solo
reply (sent again alone), /health must show nothing running or queued, and the server's RSS must
be within 10% of its value after a warm-up of the same mix (a tenth of the time, 10 to 60 s); the JSON
reports requests, outcomes by kind and
status, p50/p99 latency of valid requests and their tokens/s, and ok (exit 1 when not). --images
SHARE (a model with an image tower): that share of the requests are chats with images instead,
half a chat about one of 8 small pictures (checked against its solo reply like the rest), half a
bomb that must be a 400 (two 8192² images, 10,000 tiny ones, or EPS sent as a PNG).

A run of --model (random weights after 1 training step, the bundled tokenizer) is served on 2 fake
CPU devices (fsdp); each request is a completion of max_tokens tokens (no stop: ignore_eos by
sampling with a seed until the length), its text checked to be the same both ways. Useful tokens/s
is the tokens the requests produced over wall time, after rounds that compile the shapes both ways
use; engine_during_concurrent is the engine's own count (/metrics) over the timed concurrent round.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3_tiny")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument(
        "--soak",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="instead: --clients clients sending valid, invalid and departing requests for SECONDS",
    )
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument(
        "--images",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="with --soak and a model with an image tower (gemma3_vision_tiny): this share of the "
        "requests are chats with images, half valid (checked against their solo reply), half bombs",
    )
    args = parser.parse_args(argv)
    if args.images and "vision" not in args.model:
        parser.error("--images needs a model with an image tower (--model gemma3_vision_tiny)")
    with _served(args) as (port, pid):
        figures = _soak(port, pid, args) if args.soak else _throughput(port, args)
    print(json.dumps(figures), flush=True)
    return 0 if figures.get("ok", True) else 1


@contextlib.contextmanager
def _served(args):
    """A 1-step run of --model served on 2 fake CPU devices: (port, the server's pid)."""
    from tunix_train.cpu_devices import cpu_devices_env

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        vocabulary = ["model.vocab_size=4096"]
        if "vision" in args.model:  # the bundled tokenizer with Gemma's turn and image tokens
            from tunix_train.data.tokenizer import bundled_with_pieces

            pieces = (
                "<start_of_turn>",
                "<end_of_turn>",
                "<start_of_image>",
                "<end_of_image>",
                "<image_soft_token>",
            )
            bundled_with_pieces(Path(tmp) / "tokenizer" / "tokenizer.model", pieces)
            tokenizer = f"data.tokenizer={Path(tmp) / 'tokenizer'}"
            vocabulary = ["model.vocab_size=4104", "model.vision.image_token_id=4100", tokenizer]
        trained = subprocess.run(
            [
                sys.executable,
                str(REPO / "run_training.py"),
                f"model={args.model}",
                *vocabulary,
                "data.seq_len=64",
                "training.max_steps=1",
                'model.mesh_shape=[[1],["fsdp"]]',
                f"hydra.run.dir={run}",
            ],
            cwd=REPO,
            env=cpu_devices_env(1),
            capture_output=True,
            text=True,
        )
        if trained.returncode:
            raise SystemExit(trained.stderr[-2000:])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tunix_train.serve",
                str(run),
                "--port",
                str(port),
                "--slots",
                str(args.slots),
                "--max_len",
                "128",
                "--name",
                "m",
                "--mesh_shape",
                '[[2],["fsdp"]]',
            ],
            cwd=REPO,
            env=cpu_devices_env(2),
        )
        try:
            for _ in range(1200):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.25)
            yield port, server.pid
        finally:
            server.terminate()
            server.wait(timeout=60)


def _throughput(port: int, args) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600)

    def ask(i: int) -> tuple[str, int]:
        stream = client.completions.create(
            model="m",
            prompt=f"Speak {i}:",
            max_tokens=args.max_tokens,
            temperature=1.0,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, tokens = "", 0
        for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return text, tokens

    # Compiles the shapes both ways use: one request alone, then all at once, three times
    # (how arrivals group into prefills varies, and each new group size is a new prefill)
    ask(0)
    for _ in range(3):
        with ThreadPoolExecutor(args.requests) as pool:
            list(pool.map(ask, range(args.requests)))
    start = time.perf_counter()
    sequential = [ask(i) for i in range(args.requests)]
    sequential_s = time.perf_counter() - start
    before = _get(port, "/metrics")
    start = time.perf_counter()
    with ThreadPoolExecutor(args.requests) as pool:
        concurrent = list(pool.map(ask, range(args.requests)))
    concurrent_s = time.perf_counter() - start
    engine = {
        k: round(v - before.get(k, 0), 3) for k, v in _get(port, "/metrics").items() if k != "cache_bytes"
    }
    tokens = sum(n for _, n in sequential)
    return {
        "model": args.model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "slots": args.slots,
        "same_texts": [t for t, _ in sequential] == [t for t, _ in concurrent],
        "tokens": tokens,
        "sequential_tokens_per_s": tokens / sequential_s,
        "concurrent_tokens_per_s": tokens / concurrent_s,
        "speedup": sequential_s / concurrent_s,
        "engine_during_concurrent": engine,
    }


def _get(port: int, path: str) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read())


def _post(
    port: int, body: bytes, timeout: float = 120.0, path: str = "/v1/completions"
) -> tuple[int, str, float]:
    """(status, body, seconds) of one POST to `path`."""
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read().decode(), time.perf_counter() - start
    finally:
        connection.close()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# distinct valid requests; each valid request is one of them, its text checked against its solo text
SOAK_SPECS = 64
INVALID = [
    b"{not json",
    b"[1]",
    json.dumps({"prompt": "a", "top_k": 2**31}).encode(),
    json.dumps({"prompt": "a", "seed": 2**64}).encode(),
    json.dumps({"prompt": "a", "max_tokens": 0}).encode(),
    json.dumps({"prompt": "a", "temperature": "hot"}).encode(),
    json.dumps({"prompt": 5}).encode(),
    json.dumps({"prompt": "a" * 100_000}).encode(),
    b"[" * 50_000 + b"]" * 50_000,
    json.dumps({"prompt": "a", "stream_options": "x"}).encode(),
]


CHAT = "/v1/chat/completions"


def _png(width: int, height: int, blank: bool = False) -> str:
    """A data: URI of a PNG of random colours (seeded by its width), or a blank one."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    (Image.new("L", (width, height)) if blank else Image.fromarray(pixels)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _look(*uris: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


@functools.cache
def _image_bodies() -> tuple[list[bytes], list[bytes]]:
    """(8 valid chats, each about a picture of its own; 3 bombs: two 8192^2 images, 10,000 tiny
    ones, and EPS sent as a PNG), as request bodies."""
    import base64

    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n{} loop\n"
    valid = [
        json.dumps({"messages": _look(_png(20 + k, 24)), "max_tokens": 4 + k, "temperature": 0.9, "seed": k})
        for k in range(8)
    ]
    huge, tiny = _png(8192, 8192, blank=True), _png(1, 1)
    bombs = [
        {"messages": _look(huge, huge)},
        {"messages": _look(*[tiny] * 10_000)},
        {"messages": _look("data:image/png;base64," + base64.b64encode(eps).decode())},
    ]
    return [v.encode() for v in valid], [json.dumps({**b, "max_tokens": 4}).encode() for b in bombs]


def _chat_text(body: str) -> str:
    return json.loads(body)["choices"][0]["message"]["content"]


def _reply(body: str) -> tuple[str, int]:
    """A completion's text and tokens, from its JSON or its event stream."""
    if not body.startswith("data: "):
        reply = json.loads(body)
        return reply["choices"][0]["text"], reply["usage"]["completion_tokens"]
    events = [json.loads(line[6:]) for line in body.split("\n\n") if line.startswith("data: {")]
    return "".join(c["text"] for e in events for c in e["choices"]), events[-1]["usage"]["completion_tokens"]


def _spec(k: int) -> dict:
    return {"prompt": f"Speak {k}:", "max_tokens": 4 + k % 29, "temperature": 0.9, "seed": k}


def _soak(port: int, pid: int, args) -> dict:
    """--clients threads for --soak seconds, each in a loop: 70% a valid request (half streamed),
    15% an invalid one, 15% a stream it leaves after the first event. Then every valid text is
    compared with its request's solo text, the queue must be empty, and the server's memory back
    within 10% of where it was after a warm-up of the same mix (a tenth of the time, 10 to 60 s)."""
    import random

    texts: dict[int, set] = collections.defaultdict(set)
    latencies, tokens, outcomes = [], [0], collections.Counter()
    lock = threading.Lock()

    def client(c: int, deadline: float) -> None:
        rng = random.Random(c)
        while time.monotonic() < deadline:
            roll, k = rng.random(), rng.randrange(SOAK_SPECS)
            try:
                if rng.random() < args.images:
                    valid, bombs = _image_bodies()
                    if roll < 0.5:
                        status, body, seconds = _post(port, valid[k % 8], path=CHAT)
                        if status == 200:
                            with lock:
                                texts[("image", k % 8)].add(_chat_text(body))
                                latencies.append(seconds)
                        kind = f"image {status}"
                    else:
                        status, _, _ = _post(port, rng.choice(bombs), path=CHAT)
                        kind = f"image bomb {status}"
                elif roll < 0.7:
                    stream = (
                        {"stream": True, "stream_options": {"include_usage": True}} if roll < 0.35 else {}
                    )
                    status, body, seconds = _post(port, json.dumps({**_spec(k), **stream}).encode())
                    if status == 200:
                        text, count = _reply(body)
                        with lock:
                            texts[k].add(text)
                            latencies.append(seconds)
                            tokens[0] += count
                    kind = f"valid {status}"
                elif roll < 0.85:
                    status, _, _ = _post(port, rng.choice(INVALID))
                    kind = f"invalid {status}"
                else:
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                    connection.request(
                        "POST",
                        "/v1/completions",
                        body=json.dumps({**_spec(k), "stream": True}),
                        headers={"Content-Type": "application/json"},
                    )
                    response = connection.getresponse()
                    response.readline()
                    connection.close()
                    kind = f"left {response.status}"
            except (OSError, http.client.HTTPException, ValueError) as err:
                kind = f"client error {type(err).__name__}"
            with lock:
                outcomes[kind] += 1

    def run(seconds: float) -> None:
        threads = [
            threading.Thread(target=client, args=(c, time.monotonic() + seconds)) for c in range(args.clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # a warm-up of the same mix: the compilations, and the allocator's arenas for as many threads
    run(min(60.0, max(args.soak / 10, 10.0)))
    texts.clear(), latencies.clear(), outcomes.clear()
    tokens[0], rss_start, rss = 0, _rss_bytes(pid), []
    start = time.perf_counter()

    def sample() -> None:
        while time.perf_counter() - start < args.soak:
            rss.append(round(_rss_bytes(pid) / 2**20, 1))
            time.sleep(args.soak / 10)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    run(args.soak)
    wall_s = time.perf_counter() - start
    time.sleep(2)  # the departed streams' cancellations reach the engine
    health = _get(port, "/health")
    solo = {
        k: _chat_text(_post(port, _image_bodies()[0][k[1]], path=CHAT)[1])
        if isinstance(k, tuple)
        else _reply(_post(port, json.dumps(_spec(k)).encode())[1])[0]
        for k in texts
    }
    mismatched = sum(text != solo[k] for k in texts for text in texts[k])
    rss_end = _rss_bytes(pid)
    latencies.sort()

    def quantile(q: float) -> float | None:
        return round(latencies[min(int(q * len(latencies)), len(latencies) - 1)], 3) if latencies else None

    ok = (
        mismatched == 0
        and health["running"] == 0
        and health["queued"] == 0
        and abs(rss_end - rss_start) <= 0.1 * rss_start
        and not any(k.startswith("client") for k in outcomes)
        and not any(k.startswith("image bomb") and not k.endswith("400") for k in outcomes)
    )
    return {
        "soak_s": args.soak,
        "clients": args.clients,
        "image_share": args.images,
        "slots": args.slots,
        "requests": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "distinct_valid_texts": sum(map(len, texts.values())),
        "mismatched_texts": mismatched,
        "health_after": health,
        "rss_start_mb": round(rss_start / 2**20, 1),
        "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_mb_through": rss,
        "latency_p50_s": quantile(0.5),
        "latency_p99_s": quantile(0.99),
        "valid_tokens_per_s": round(tokens[0] / wall_s, 1),
        "ok": ok,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
