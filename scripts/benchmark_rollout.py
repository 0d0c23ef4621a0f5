"""Rollout benchmark: useful tokens/s of static batching and of the engine's continuous batching on
mixed lengths, and the prefill time of a GRPO rollout with and without shared prompt prefixes.

    python scripts/benchmark_rollout.py [--model gemma3_270m] [--devices 4] [--axis tp] [--requests 64]
        [--slots 16] [--prompt-len 16 128] [--new-tokens 8 256] [--prompts 16 --group 8 --group-new 32]
        [--fifo] [--dtype fp32|bf16]

Random weights of the named model config, float32 or (--dtype bf16) the bf16 engine of
`training.rollout.dtype=bf16`, on --devices fake CPU devices (or accelerators) along one mesh
axis: tp by default, the layout to decode with (each step reads every weight once, where fsdp
gathers all of them onto every device; the rollout mesh's choice, docs/generation.md). Requests
have prompt lengths and max_new_tokens drawn uniformly from the given ranges, and no stop token, so
every request produces exactly its max_new_tokens: the useful tokens.
- static: the requests in arrival order, in batches of --slots, each batch running until its
  longest request ends before the next starts: the same rows per decode step as the engine, so
  the ratio is what refilling a slot as soon as its request ends buys (the scheduling's);
- static, one batch: every request in one batch of --requests rows (how the sampler before the
  engine ran them). Its ratio to the engine mixes the scheduling with the step's width: on this
  CPU a decode step's cost grows with its rows, so fewer rows per step win on their own; on a GPU,
  where a 64-row decode step costs about what a 16-row one does, it could go the other way;
- engine: --slots slots, each refilled from the queue when its request ends (Engine.generate: the
  requests with the most max_new_tokens first); --fifo adds the same in the order the requests
  came (as a server admits them).
All are the same engine (same kernels, same prefills).
Each timed run follows a warm-up that compiles every shape it meets: the same requests, shortened
to one chunk for static (whose one admission meets the same shapes), whole for the engine (whose
admissions depend on when slots free); `compiles` counts XLA compilations inside the timed runs.
The GRPO rollout: --prompts prompts x --group completions each, prefilled once per prompt
(shared) or once per completion (separate). The last line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3_270m")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--axis", default="tp", choices=["tp", "fsdp", "dp"])
    parser.add_argument("--requests", type=int, default=64, help="at least 4 x --slots is the point")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128])
    parser.add_argument("--new-tokens", type=int, nargs=2, default=[8, 256])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--group-new", type=int, default=32, help="max_new_tokens of the GRPO rollout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fifo", action="store_true", help="also time the engine admitting in arrival order")
    parser.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16"], help="the engine's weights and cache"
    )
    args = parser.parse_args(argv)
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        ).strip()

    import jax
    import numpy as np

    from tunix_train.compose import load_config
    from tunix_train.generate import Engine, Request, Sampling, Tuning
    from tunix_train.model import quant
    from tunix_train.sharding import make_mesh
    from tunix_train.train.init import plan_train_state
    from tunix_train.train.optimizer import make_optimizer

    cfg, _ = load_config([f"model={args.model}", "data=synthetic", "model.context_length=null"])
    mesh = make_mesh([[args.devices], [args.axis]], jax.devices()[: args.devices])
    params = plan_train_state(cfg.model, make_optimizer(cfg.training)[0], mesh, seed=0).create().params
    if args.dtype == "bf16":
        params = quant.cast(params, jax.numpy.bfloat16)
    rng = np.random.default_rng(args.seed)
    requests = [
        Request(
            tuple(
                rng.integers(
                    3, cfg.model.vocab_size, rng.integers(args.prompt_len[0], args.prompt_len[1] + 1)
                ).tolist()
            ),
            int(rng.integers(args.new_tokens[0], args.new_tokens[1] + 1)),
            Sampling(1.0),
            seed=1,
            stream=i,
        )
        for i in range(args.requests)
    ]
    useful = sum(r.max_new_tokens for r in requests)

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: (
            compiles.append(1) if event == "/jax/core/compile/backend_compile_duration" else None
        )
    )

    def timed(
        engine: Engine, requests: list[Request], warm_whole: bool = True, fifo: bool = False, batch: int = 0
    ) -> float:
        """Seconds of the requests through the engine, after a warm-up of the same shapes; batch > 0:
        static batches of that many requests, one after another (the engine then has no more
        slots than a batch's requests, all admitted at once)."""
        max_len = engine.max_len_for(requests)
        run = functools.partial(engine.generate, params, longest_first=not fifo)
        batches = [requests[i : i + batch] for i in range(0, len(requests), batch)] if batch else [requests]
        for part in batches:
            run(
                part
                if warm_whole
                else [dataclasses.replace(r, max_new_tokens=engine.chunk + 1) for r in part],
                max_len=max_len,
            )
        engine.stats.clear()
        before = len(compiles)
        start = time.perf_counter()
        done = [c for part in batches for c in run(part, max_len=max_len)]
        seconds = time.perf_counter() - start
        assert [len(c.tokens) for c in done] == [r.max_new_tokens for r in requests]
        figures["compiles"] += len(compiles) - before
        return seconds

    figures = {
        "model": args.model,
        "devices": args.devices,
        "axis": args.axis,
        "dtype": args.dtype,
        "device": jax.devices()[0].device_kind,
        "requests": args.requests,
        "slots": args.slots,
        "useful_tokens": useful,
        "compiles": 0,
    }
    static = Engine(cfg.model, mesh, slots=None)
    figures["static_s"] = timed(static, requests, warm_whole=False, batch=args.slots)
    figures["static_decode_steps"] = static.stats["steps"]
    figures["static_one_batch_s"] = timed(static, requests, warm_whole=False)
    figures["static_one_batch_decode_steps"] = static.stats["steps"]
    engine = Engine(cfg.model, mesh, slots=args.slots)
    figures["engine_s"] = timed(engine, requests)
    figures["engine_decode_steps"] = engine.stats["steps"]
    figures["engine_prefill_s"] = engine.stats["prefill_s"]
    if args.fifo:
        figures["engine_fifo_s"] = timed(engine, requests, fifo=True)
        figures["engine_fifo_decode_steps"] = engine.stats["steps"]
        figures["engine_fifo_tokens_per_s"] = useful / figures["engine_fifo_s"]
    figures["static_tokens_per_s"] = useful / figures["static_s"]
    figures["static_one_batch_tokens_per_s"] = useful / figures["static_one_batch_s"]
    figures["engine_tokens_per_s"] = useful / figures["engine_s"]
    figures["engine_vs_static"] = figures["engine_tokens_per_s"] / figures["static_tokens_per_s"]
    figures["engine_vs_static_one_batch"] = (
        figures["engine_tokens_per_s"] / figures["static_one_batch_tokens_per_s"]
    )
    shown = (
        "static_tokens_per_s",
        "static_one_batch_tokens_per_s",
        "engine_tokens_per_s",
        "engine_vs_static",
    )
    print(json.dumps({k: figures[k] for k in (*shown, "engine_vs_static_one_batch")}), flush=True)

    prompts = [
        tuple(
            rng.integers(
                3, cfg.model.vocab_size, rng.integers(args.prompt_len[0], args.prompt_len[1] + 1)
            ).tolist()
        )
        for _ in range(args.prompts)
    ]
    group = [
        Request(p, args.group_new, Sampling(1.0), seed=2, stream=i)
        for i, p in enumerate(p for p in prompts for _ in range(args.group))
    ]
    for name, prefix_cache in (("shared", 4), ("separate", 0)):
        rollout = Engine(cfg.model, mesh, slots=None, tuning=Tuning(prefix_cache=prefix_cache))
        timed(rollout, group, warm_whole=False)
        figures[f"prefill_s_{name}"] = rollout.stats["prefill_s"]
        figures[f"rollout_s_{name}"] = rollout.stats["prefill_s"] + rollout.stats["decode_s"]
    figures["prefill_speedup_shared"] = figures["prefill_s_separate"] / figures["prefill_s_shared"]
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
