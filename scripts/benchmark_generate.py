"""Generation benchmark: prefill and decode tokens/s of our engine (all prompts in one batch of slots), next
to transformers' generate on
the same weights in the same run, and next to the memory-bandwidth limit of decoding.

    python scripts/benchmark_generate.py [--model gemma3_270m] [--gguf FILE] [--prompt-len 64]
        [--new-tokens 32] [--batches 1 8] [--repeats 3] [--dtype fp32|bf16] [--chunk 8] [--json out.json]

Random weights of the named model config (or a GGUF file's), float32 or (--dtype bf16) the bf16
engine of `training.rollout.dtype=bf16`, on one CPU device (or the accelerator). Each figure is
the median of --repeats timed runs after a warm-up run that compiles. Prefill: prompt tokens / time
to the first token. Decode: the other tokens / the rest of the time. The bandwidth limit of a decode
step is the bytes it must read, parameters plus the KV cache, over the memory bandwidth measured in
the same run (numpy copying 1 GiB on a CPU, a jitted x + 1 over 4 GiB on an accelerator); at batch 1
decoding is bound by it. transformers runs with torch's threads set to the machine's cores. Each
batch's figures print as they come; the last line is one JSON object of them all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def memcpy_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a large copy (read + write counted once each): numpy's on a CPU, the
    device's own memory (a jitted copy) on an accelerator."""
    import jax
    import numpy as np

    if jax.devices()[0].platform == "cpu":
        src = np.ones(int(gib * 2**30) // 4, np.float32)
        dst = np.empty_like(src)

        def copy():
            return np.copyto(dst, src)
    else:
        src = jax.numpy.ones(int(4 * gib * 2**30) // 4, np.float32)  # 4x: a launch is a smaller part
        plus_one = jax.jit(lambda x: x + 1)  # one read and one write of every element

        def copy():
            return plus_one(src).block_until_ready()

        copy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        times.append(time.perf_counter() - start)
    return 2 * src.nbytes / min(times)


def _median_time(fn, repeats: int) -> float:
    fn()  # compiles / warms up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3_270m")
    parser.add_argument("--gguf", default=None, help="a GGUF file instead of random weights")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--chunk", type=int, default=8, help="decode steps per compiled call (Engine's chunk)"
    )
    parser.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16"], help="the engine's weights and cache"
    )
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from tunix_train import api
    from tunix_train.compose import load_config
    from tunix_train.generate import Engine, Request, Tuning
    from tunix_train.generate.cache import cache_bytes
    from tunix_train.interop import hf
    from tunix_train.model import quant
    from tunix_train.sharding import make_mesh
    from tunix_train.train.init import count_params, plan_train_state
    from tunix_train.train.optimizer import make_optimizer

    mesh_shape = [[1], ["fsdp"]]
    if args.gguf:
        loaded = api.load(args.gguf, mesh_shape, jax.devices()[:1])
        model_cfg, params, mesh = loaded.config, loaded.params, loaded.mesh
    else:
        cfg, _ = load_config([f"model={args.model}", "data=synthetic"])
        model_cfg = cfg.model
        mesh = make_mesh(mesh_shape, jax.devices()[:1])
        params = plan_train_state(model_cfg, make_optimizer(cfg.training)[0], mesh, seed=0).create().params
    if args.dtype == "bf16":
        params = quant.cast(params, jax.numpy.bfloat16)
    engine = Engine(model_cfg, mesh, slots=None, tuning=Tuning(chunk=args.chunk))
    # one cache length for the first token and the whole run: one compiled program, whose decode the
    # difference times
    max_len = args.prompt_len + args.new_tokens

    def generate(prompts, n):
        return engine.generate(params, [Request(tuple(p), n) for p in prompts.tolist()], max_len)

    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    bandwidth = memcpy_bandwidth()
    rng = np.random.default_rng(0)
    results = {
        "model": args.gguf or args.model,
        "parameters": count_params(params),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "chunk": args.chunk,
        "memcpy_gb_s": bandwidth / 1e9,
        "device": jax.devices()[0].device_kind,
        "runs": [],
    }

    reference = None
    if not args.no_transformers:
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count() or 1)
        with tempfile.TemporaryDirectory() as directory:
            hf.export(params, model_cfg, Path(directory))
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                directory, dtype=torch.float32
            ).eval()

    for batch in args.batches:
        prompts = rng.integers(3, model_cfg.vocab_size, (batch, args.prompt_len))
        first = _median_time(lambda: generate(prompts, 1), args.repeats)
        whole = _median_time(lambda: generate(prompts, args.new_tokens), args.repeats)
        kv = cache_bytes(
            model_cfg, batch, args.prompt_len + args.new_tokens, 2 if args.dtype == "bf16" else 4
        )
        run = {
            "batch": batch,
            "ours_prefill_tokens_s": batch * args.prompt_len / first,
            "ours_decode_tokens_s": batch * (args.new_tokens - 1) / (whole - first),
            "bandwidth_limit_decode_tokens_s": batch * bandwidth / (param_bytes + kv),
        }
        if reference is not None:
            import torch

            ids = torch.tensor(prompts)

            def hf_generate(n):
                return reference.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)

            with torch.no_grad():
                hf_first = _median_time(lambda: hf_generate(1), args.repeats)
                hf_whole = _median_time(lambda: hf_generate(args.new_tokens), args.repeats)
            run["transformers_prefill_tokens_s"] = batch * args.prompt_len / hf_first
            run["transformers_decode_tokens_s"] = batch * (args.new_tokens - 1) / (hf_whole - hf_first)
            run["decode_ratio_vs_transformers"] = (
                run["ours_decode_tokens_s"] / run["transformers_decode_tokens_s"]
            )
        run["decode_fraction_of_bandwidth_limit"] = (
            run["ours_decode_tokens_s"] / run["bandwidth_limit_decode_tokens_s"]
        )
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results))  # the last line: every figure
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
