"""The OpenAI-compatible server under load: 32 streaming requests at once against the same 32 one
after another, through the `openai` client on 127.0.0.1.

    python scripts/benchmark_serve.py [--model gemma3_tiny] [--requests 32] [--max-tokens 32] [--slots 32]

A run of --model (random weights after 1 training step, the bundled tokenizer) is served on 2 fake
CPU devices (fsdp); each request is a completion of max_tokens tokens (no stop: ignore_eos by
sampling with a seed until the length), its text checked to be the same both ways. Useful tokens/s
is the tokens the requests produced over wall time, after rounds that compile the shapes both ways
use; engine_during_concurrent is the engine's own count (/metrics) over the timed concurrent round.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
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
    args = parser.parse_args(argv)
    import openai

    from tunix_train.cpu_devices import cpu_devices_env

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        trained = subprocess.run([sys.executable, str(REPO / "run_training.py"), f"model={args.model}",
                                  "model.vocab_size=4096", "data.seq_len=64", "training.max_steps=1",
                                  'model.mesh_shape=[[1],["fsdp"]]', f"hydra.run.dir={run}"], cwd=REPO,
                                 env=cpu_devices_env(1), capture_output=True, text=True)
        if trained.returncode:
            print(trained.stderr[-2000:], file=sys.stderr)
            return 1
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-m", "tunix_train.serve", str(run), "--port", str(port), "--slots",
                                   str(args.slots), "--max_len", "128", "--name", "m", "--mesh_shape",
                                   '[[2],["fsdp"]]'], cwd=REPO, env=cpu_devices_env(2))
        try:
            for _ in range(1200):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.25)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600)

            def ask(i: int) -> tuple[str, int]:
                stream = client.completions.create(model="m", prompt=f"Speak {i}:", max_tokens=args.max_tokens,
                                                   temperature=1.0, seed=i, stream=True,
                                                   stream_options={"include_usage": True})
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
            metrics = lambda: json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
            before = metrics()
            start = time.perf_counter()
            with ThreadPoolExecutor(args.requests) as pool:
                concurrent = list(pool.map(ask, range(args.requests)))
            concurrent_s = time.perf_counter() - start
            engine = {k: round(v - before.get(k, 0), 3) for k, v in metrics().items() if k != "cache_bytes"}
        finally:
            server.terminate()
            server.wait(timeout=60)
    tokens = sum(n for _, n in sequential)
    figures = {"model": args.model, "requests": args.requests, "max_tokens": args.max_tokens, "slots": args.slots,
               "same_texts": [t for t, _ in sequential] == [t for t, _ in concurrent], "tokens": tokens,
               "sequential_tokens_per_s": tokens / sequential_s, "concurrent_tokens_per_s": tokens / concurrent_s,
               "speedup": sequential_s / concurrent_s, "engine_during_concurrent": engine}
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
