"""Mixture-of-experts benchmark: gemma4_moe_tiny at ep=1 and ep=4, against a dense model of the same
active size, and the share of the MoE layer's time that goes to dispatch.

    python scripts/benchmark_moe.py [--cpu-devices 4] [--rounds 2] [--steps 10] overrides...

1. Train steps (scripts/benchmark.py's measurement) of gemma4_moe_tiny on mesh [[N],["fsdp"]] (ep=1)
   and [[N],["ep"]] (ep=N), and of the dense twin: the same model without experts and with the
   dense MLP as wide as the dense MLP plus the k experts a token uses, so that both do the same
   matmul FLOPs per token. Configurations alternate round by round (a shared machine's drift hits
   all alike); tokens/s are medians over rounds, MFU counts active parameters (observe/mfu.py).
2. Dispatch share: the dropless experts of one layer, forward and backward, on a micro-batch's
   tokens: moe.apply_experts (each token's k copies, their places, the gathers into them, the
   experts' matmuls, the gathers back, the weighted sum) against the experts' matmuls and GeGLU
   alone on copies already in their places, in the layout apply_experts runs. The difference is
   what bringing tokens to their experts and back costs.
3. With --kernels MODEL:TOKENS,...: one layer's experts, forward and backward, on copies sorted
   by expert (ragged_dot needs them so), computed each way moe.py can (jax.lax.ragged_dot;
   moe.dropless_places: blocks alone, fixed slots, slots and a pool) against one dense GeGLU MLP
   as wide as a token's k experts, at that model's sizes, in the compute dtype.
    This tells which way is fastest on a backend.

--cpu-devices 0 runs on the machine's own devices (a GPU); with one device only ep=1 runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

MODEL = ["model=gemma4_moe_tiny", "data=synthetic", "data.seq_len=128", "training.micro_batch_size=4"]


def dense_twin(overrides: list[str]) -> list[str]:
    from tunix_train.compose import load_config

    m = load_config(overrides)[0].model
    width = m.hidden_dim + m.moe.experts_per_token * m.moe.hidden_dim
    return overrides + ["model.moe.experts=0", f"model.hidden_dim={width}"]


def dispatch_share(overrides: list[str], repeats: int = 20) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tunix_train.compose import load_config
    from tunix_train.config import MoeDispatch
    from tunix_train.model import kernels
    from tunix_train.model.moe import Dispatching, MoE, apply_experts, dropless_places, experts_in_places
    from tunix_train.sharding import LOGICAL_RULES

    cfg = load_config(overrides)[0]
    m = cfg.model
    moe = MoE(m, nnx.Rngs(0), LOGICAL_RULES)
    X = cfg.training.micro_batch_size * cfg.data.seq_len
    E, K = m.moe.experts, m.moe.experts_per_token
    x = jax.random.normal(jax.random.key(1), (X, m.embed_dim))
    weights, experts, _ = moe.route(jax.random.normal(jax.random.key(2), (X, m.embed_dim)))
    gate_up, down = moe.gate_up_EDCM[...], moe.down_EMD[...]
    # the layout dropless_experts runs for this routing, and the copies already in its places
    expert_A = experts.reshape(-1)
    slots = next(s for s in dropless_places(X * K, X * K, E) if s.fit(jnp.bincount(expert_A, length=E)))
    source, dest, group_J = kernels.slotting(expert_A, E, slots)
    x_R = kernels.take_rows(jnp.repeat(x, K, axis=0), source, dest)

    def with_dispatch(x, g, d):
        return jnp.sum(apply_experts(x, weights, experts, g, d, Dispatching(MoeDispatch.dropless, 1.0)))

    full = jax.jit(jax.grad(with_dispatch, argnums=(0, 1, 2)))
    matmuls_alone = jax.jit(
        jax.grad(lambda x, g, d: jnp.sum(experts_in_places(x, group_J, g, d, slots)), argnums=(0, 1, 2))
    )

    def timed(fn, *args):
        jax.block_until_ready(fn(*args))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    t_full, t_matmuls = timed(full, x, gate_up, down), timed(matmuls_alone, x_R, gate_up, down)
    return {
        "tokens": X,
        "apply_experts_ms": t_full * 1e3,
        "grouped_matmuls_ms": t_matmuls * 1e3,
        "dispatch_share": 1 - t_matmuls / t_full,
    }


def expert_kernels(overrides: list[str], tokens: int, repeats: int = 10) -> dict:
    """Milliseconds for one layer's experts, forward and backward, on `tokens` tokens' copies sorted
    by expert (routed by a random router: roughly even), each way moe.py can compute them, and for
    the dense GeGLU MLP of the same FLOPs (width k x the expert width)."""
    import jax
    import jax.numpy as jnp

    from tunix_train.compose import load_config
    from tunix_train.model.moe import dropless_places, ragged_experts, slotted_experts

    cfg = load_config(overrides)[0]
    m = cfg.model
    dtype = jnp.bfloat16 if cfg.training.mixed_precision.value == "bf16" else jnp.float32
    E, K, D, M = m.moe.experts, m.moe.experts_per_token, m.embed_dim, m.moe.hidden_dim
    router = jax.random.normal(jax.random.key(0), (D, E)) * D**-0.5
    _, experts_XK = jax.lax.top_k(jax.random.normal(jax.random.key(1), (tokens, D)) @ router, K)
    ids_A = jnp.sort(experts_XK.reshape(-1))
    sizes_E = jnp.bincount(ids_A, length=E)
    x_AD = jax.random.normal(jax.random.key(2), (tokens * K, D), dtype)
    gate_up = (jax.random.normal(jax.random.key(3), (E, D, 2, M)) * D**-0.5).astype(dtype)
    down = (jax.random.normal(jax.random.key(4), (E, M, D)) * M**-0.5).astype(dtype)
    slots, slots_and_pool, blocks = dropless_places(tokens * K, tokens * K, E)
    ways = {
        "ragged_dot": lambda x, g, d: ragged_experts(x, sizes_E, g, d),
        "row blocks": lambda x, g, d: slotted_experts(x, ids_A, g, d, blocks),
        "fixed slots (1.25x even share)": lambda x, g, d: slotted_experts(x, ids_A, g, d, slots),
        "slots and a pool of E/2 blocks": lambda x, g, d: slotted_experts(x, ids_A, g, d, slots_and_pool),
    }
    x_XD = x_AD[:tokens]
    dense_gate_up = (jax.random.normal(jax.random.key(5), (D, 2, K * M)) * D**-0.5).astype(dtype)
    dense_down = (jax.random.normal(jax.random.key(6), (K * M, D)) * M**-0.5).astype(dtype)

    def dense(x, g, d):
        h = jnp.einsum("xd,dcm->xcm", x, g)
        return jax.nn.gelu(h[:, 0], approximate=True) * h[:, 1] @ d

    def timed(fn, *args):
        step = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=(0, 1, 2)))
        try:
            jax.block_until_ready(step(*args))
        except Exception as err:  # out of memory: say so and go on with the other ways
            return f"failed: {str(err).splitlines()[0][:120]}"
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3

    results = {name: timed(fn, x_AD, gate_up, down) for name, fn in ways.items()}
    results["dense MLP of the same FLOPs"] = timed(dense, x_XD, dense_gate_up, dense_down)
    return {
        "model": m.name,
        "tokens": tokens,
        "experts": E,
        "top_k": K,
        "embed": D,
        "expert_width": M,
        "dtype": jnp.dtype(dtype).name,
        "largest_group_over_even_share": float(jnp.max(sizes_E)) * E / (tokens * K),
        "ms": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu-devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--kernels", default="", help="MODEL:TOKENS,... for section 3 (e.g. gemma4_26b_a4b:4096)"
    )
    parser.add_argument("--json", help="also write every figure here")
    args, overrides = parser.parse_known_args()
    if args.cpu_devices:
        from tunix_train.cpu_devices import use_cpu_devices

        use_cpu_devices(args.cpu_devices)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    from benchmark import benchmark

    n = jax.device_count()
    base = MODEL + overrides
    runs = {
        f"moe ep=1 (fsdp={n})": base + [f"model.mesh_shape=[[{n}],[fsdp]]"],
        f"moe ep={n}": base + [f"model.mesh_shape=[[{n}],[ep]]"],
        f"dense, same active size (fsdp={n})": dense_twin(base) + [f"model.mesh_shape=[[{n}],[fsdp]]"],
    }
    if n == 1:  # one device: ep=1 is the only expert split
        del runs[f"moe ep={n}"]
    results = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            results[name].append(benchmark(run, args.steps, 3))
    dense = statistics.median(r["tokens_per_sec"] for r in results[list(runs)[-1]])
    print(f"{'':<36}{'tokens/s':>10}{'MFU (of measured peak)':>24}{'dense / this':>14}")
    for name, rs in results.items():
        tps = statistics.median(r["tokens_per_sec"] for r in rs)
        mfu = statistics.median(r["fraction_of_measured_peak"] for r in rs)
        print(f"{name:<36}{tps:>10,.0f}{mfu:>24.1%}{dense / tps:>14.2f}")
    share = dispatch_share(base)
    print(
        f"dispatch: one layer's experts, forward and backward, {share['tokens']} tokens: apply_experts "
        f"{share['apply_experts_ms']:.2f} ms, its matmuls alone {share['grouped_matmuls_ms']:.2f} ms: "
        f"dispatch {share['dispatch_share']:.0%} of it"
    )
    kernels = []
    for spec in filter(None, args.kernels.split(",")):
        model, tokens = spec.split(":")
        k = expert_kernels(
            [arg for arg in base if not arg.startswith("model=")] + [f"model={model}"], int(tokens)
        )
        kernels.append(k)
        print(
            f"experts of one {k['model']} layer ({k['experts']} experts, top {k['top_k']}, D={k['embed']}, "
            f"width {k['expert_width']}, {k['dtype']}), {k['tokens']} tokens, forward and backward "
            f"(largest group / even share: {k['largest_group_over_even_share']:.2f}):"
        )
        for name, ms in k["ms"].items():
            print(f"  {name:<36}" + (f"{ms:>10.2f} ms" if isinstance(ms, float) else f"  {ms}"))
    report = {"train": results, "dispatch": share, "kernels": kernels}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))  # the last line: scripts/figures.py records it
    return 0


if __name__ == "__main__":
    sys.exit(main())
