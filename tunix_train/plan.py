"""Ahead-of-time memory plan: will this model, mesh and batch fit? No accelerator needed.

    python -m tunix_train.plan model=gemma3_4b 'model.mesh_shape=[[8,2],["fsdp","tp"]]' \\
        training.micro_batch_size=8 --device_memory=80GB

Compiles the real train step for the mesh on fake CPU devices and prints, per device: parameters,
optimizer state and the gradient accumulator (from the arrays' shard shapes), the compiler's
temporaries, and whether the total fits; when it does not, which knobs would help. XLA's CPU
compiler stands in for the accelerator's, so temporaries are an estimate (fusion differs by backend).
"""

from __future__ import annotations

import argparse
import math
import re
import sys

from tunix_train import exit_codes
from tunix_train.config import ConfigError
from tunix_train.cpu_devices import use_cpu_devices

_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def _parse_bytes(text: str) -> float:
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]I?)?B?\s*", text, re.I)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: use a size such as 80GB or 24GiB")
    return float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]


def _device_count(overrides: list[str]) -> int:
    from tunix_train.compose import load_config

    cfg, _ = load_config(overrides)
    sizes = cfg.model.mesh_shape[0] if isinstance(cfg.model.mesh_shape, (list, tuple)) else []
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError("model.mesh_shape: the planner needs explicit positive sizes (no -1)")
    return math.prod(sizes)


def _shard_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs) under `shardings` (a prefix tree)."""
    import jax

    per_sharding = jax.tree.map(
        lambda sharding, sub: sum(
            math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(sub)
        ),
        shardings,
        tree,
    )
    return sum(jax.tree.leaves(per_sharding))


def plan(overrides: list[str]):
    import jax
    import jax.numpy as jnp

    from tunix_train.compose import load_config
    from tunix_train.sharding import batch_sharding
    from tunix_train.train.setup import setup
    from tunix_train.train.step import abstract_batch

    cfg, _ = load_config(overrides)
    run = setup(cfg)
    t = cfg.training
    batch = abstract_batch(
        run.mesh, t.gradient_accumulation_steps, run.micro_batch, cfg.data.seq_len, run.objective.batch_dtypes
    )
    vision = cfg.model.vision
    if vision is not None and cfg.data.messages_field:  # conversations with images: each row's
        shape = (cfg.data.images_per_row, *vision.image_shape)
        batch["images"] = jax.ShapeDtypeStruct(
            (t.gradient_accumulation_steps, run.micro_batch, *shape),
            jnp.float32,
            sharding=batch_sharding(run.mesh),
        )
    with jax.set_mesh(run.mesh):
        compiled = run.step_fn.lower(run.plan.abstract, batch).compile()
    memory = compiled.memory_analysis()

    # An offloaded part of the state is in pinned host memory between steps: counted on the host.
    def on_host(part):
        return jax.tree.leaves(getattr(run.plan.shardings, part)) != jax.tree.leaves(
            getattr(run.plan.on_device, part)
        )

    state = {}
    parts = (("params", "parameters"), ("opt_state", "optimizer state"), ("frozen", "frozen weights"))
    for part, name in parts if run.plan.abstract.frozen is not None else parts[:2]:
        state[name + (" (host)" if on_host(part) else "")] = _shard_bytes(
            getattr(run.plan.abstract, part), getattr(run.plan.shardings, part)
        )
    figures = {
        **state,
        "gradient accumulator (in temporaries)": _shard_bytes(
            run.plan.abstract.params, run.plan.grad_shardings
        ),
        "temporaries (compiler)": memory.temp_size_in_bytes,
        "batch": sum(
            math.prod(batch_sharding(run.mesh).shard_shape(b.shape)) * b.dtype.itemsize
            for b in batch.values()
        ),
    }
    if cfg.model.moe.experts:
        experts = _expert_leaves(run.plan.abstract.params)
        figures["experts (of the parameters)"] = _shard_bytes(
            experts, _expert_leaves(run.plan.shardings.params)
        )
    # The step moves the whole offloaded part to the devices (for the update; the parameters for
    # the forward pass too). XLA:CPU, standing in here, lowers those moves to nothing, so its
    # temporaries miss that copy: the total counts it. Measured on an H200 the peak stayed where
    # it was without offloading (docs/performance.md): offloading lowers the peak only where the
    # backward pass's activations, not the update, set it, which this plan cannot tell apart.
    offloaded = sum(v for k, v in state.items() if k.endswith("(host)"))
    if offloaded:
        figures["offloaded part, on the devices in the step"] = offloaded
    # The accumulator lives inside the step's temporaries; the total counts it once.
    on_device = sum(state.values())
    figures["total"] = on_device + figures["batch"] + memory.temp_size_in_bytes
    return figures, cfg, run


def _expert_leaves(params):
    """The experts' weights of a parameter tree (or of its shardings), by path."""
    import jax

    named = {
        jax.tree_util.keystr(path).removesuffix(".value"): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    return {name: leaf for name, leaf in named.items() if "'gate_up_EDCM'" in name or "'down_EMD'" in name}


def parameter_counts(cfg, params) -> tuple[int, int]:
    """(all parameters, those a token goes through): of each layer's experts only k of E count."""
    import jax

    total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    experts = sum(math.prod(x.shape) for x in _expert_leaves(params).values())
    m = cfg.model
    active = total - experts + (experts * m.moe.experts_per_token // m.moe.experts if m.moe.experts else 0)
    return total, active


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tunix_train.plan",
        description="Per-device memory of a training run, planned on fake CPU "
        "devices: no accelerator needed.",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="hydra overrides of tunix_train/configs/config.yaml, as for run_training.py",
    )
    parser.add_argument("--config-dir", metavar="DIR", help="a folder of your own configs, searched first")
    parser.add_argument(
        "--device_memory",
        "--device-memory",
        type=_parse_bytes,
        default=None,
        metavar="SIZE",
        help="memory per device, e.g. 80GB or 24GiB: say whether the run fits and what would help",
    )
    args = parser.parse_args(argv)
    if args.config_dir:
        args.overrides = ["--config-dir", args.config_dir, *args.overrides]
    try:
        devices = _device_count(args.overrides)
        if "jax" not in sys.modules:
            use_cpu_devices(devices)
        figures, cfg, run = plan(args.overrides)
    except (ConfigError, ValueError) as err:
        print(f"tunix_train.plan: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    from tunix_train.observe.memory import advice

    device_memory = args.device_memory
    print(
        f"{cfg.model.name} on {dict(run.mesh.shape)}, {run.micro_batch} rows x {cfg.data.seq_len} tokens "
        f"per micro-step, {cfg.training.gradient_accumulation_steps} accumulation steps, "
        f"{cfg.training.mixed_precision.value}, remat={cfg.training.remat.value}"
    )
    for line in run.parallel.describe() if run.parallel else ():
        print(line)
    total, active = parameter_counts(cfg, run.plan.abstract.params)
    if cfg.model.moe.experts:
        print(
            f"parameters: {total:,}, of which {active:,} active per token "
            f"({cfg.model.moe.experts_per_token} of "
            f"{cfg.model.moe.experts} experts); experts split over ep={run.mesh.shape.get('ep', 1)}"
        )
    else:
        print(f"parameters: {total:,}")
    print("per device:")
    for name, value in figures.items():
        print(f"  {name:<38} {value / 2**30:10.3f} GiB")
    if device_memory:
        fits = figures["total"] <= device_memory
        print(f"{'fits' if fits else 'does NOT fit'} in {device_memory / 2**30:.1f} GiB per device")
        if not fits:
            print("to make it fit, try:")
            for tip in advice(cfg, run.mesh):
                print(f"  - {tip}")
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
