"""Times Tunix's PeftTrainer train step on a Gemma 3 model; run by scripts/compare_tunix.py with the
Python of Tunix's own virtual environment (it imports nothing from tunix_train).

    python tunix_worker.py '{"num_layers": 4, ..., "fsdp": 2, "tp": 2, "steps": 10}'

Prints one JSON line: tokens/s (median step), step times, compile time.
"""

import json
import os
import statistics
import sys
import time

spec = json.loads(sys.argv[1])
devices = spec["fsdp"] * spec["tp"]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = spec.get("xla_flags", "")  # compare_tunix.py --same-xla-flags
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tunix.models.gemma3 import model as gemma3  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def main():
    mesh = jax.make_mesh(
        (spec["fsdp"], spec["tp"]),
        ("fsdp", "tp"),
        axis_types=(AxisType.Auto,) * 2,
        devices=jax.devices()[:devices],
    )
    config = gemma3.ModelConfig(
        num_layers=spec["num_layers"],
        num_embed=spec["vocab_size"],
        embed_dim=spec["embed_dim"],
        hidden_dim=spec["hidden_dim"],
        num_heads=spec["num_heads"],
        head_dim=spec["head_dim"],
        num_kv_heads=spec["num_kv_heads"],
        sliding_window_size=spec["sliding_window"],
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
        param_dtype=DTYPES[spec["dtype"]],
    )
    B, T = spec["global_batch"], spec["seq_len"]
    with jax.set_mesh(mesh):

        @nnx.jit
        def create():  # Tunix's documented way: init, then constrain to the modules' partition specs
            model = gemma3.Gemma3(config, rngs=nnx.Rngs(0))
            state = nnx.state(model)
            nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
            return model

        model = create()
        trainer = peft_trainer.PeftTrainer(
            model,
            optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1),
            peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9),
        )
        train_step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)

        rng = np.random.default_rng(0)
        data = NamedSharding(mesh, P("fsdp"))
        mask = NamedSharding(mesh, P("fsdp", None, None))
        batches = []
        for _ in range(4):
            tokens = rng.integers(0, spec["vocab_size"], (B, T), dtype=np.int32)
            batches.append(
                {
                    "input_tokens": jax.device_put(tokens, data),
                    "input_mask": jax.device_put(np.ones((B, T), bool), data),
                    "positions": jax.device_put(np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)), data),
                    "attention_mask": jax.device_put(
                        np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)), mask
                    ),
                }
            )
        start = time.perf_counter()
        jax.block_until_ready(train_step(batches[0]))
        compile_s = time.perf_counter() - start
        times = []
        for i in range(spec["warmup"] + spec["steps"]):
            start = time.perf_counter()
            loss, _, grad_norm = train_step(batches[i % len(batches)])
            jax.block_until_ready((loss, grad_norm))
            times.append(time.perf_counter() - start)
    times = times[spec["warmup"] :]
    median = statistics.median(times)
    print(
        json.dumps(
            {
                "trainer": "tunix",
                "tokens_per_sec": B * T / median,
                "step_time_s": median,
                "step_times_s": times,
                "compile_time_s": compile_s,
                "loss": float(loss),
                "devices": devices,
            }
        )
    )


if __name__ == "__main__":
    main()
