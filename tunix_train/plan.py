"""Ahead-of-time memory plan: will this model, mesh and batch fit? No accelerator needed.

    python -m tunix_train.plan model=gemma3_4b 'model.mesh_shape=[[8,2],["fsdp","tp"]]' \\
        training.micro_batch_size=8 --device-memory=80GB

Compiles the real train step for the mesh on fake CPU devices and prints, per device: parameters,
optimizer state and the gradient accumulator (from the arrays' shard shapes), the compiler's
temporaries, and whether the total fits; when it does not, which knobs would help. XLA's CPU
compiler stands in for the accelerator's, so temporaries are an estimate (fusion differs by backend).
"""

from __future__ import annotations

import math
import os
import re
import sys

from tunix_train.config import ConfigError


_UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def _parse_bytes(text: str) -> float:
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]I?)?B?\s*", text, re.I)
    if not match:
        raise ValueError(f"--device-memory={text!r}: use a size such as 80GB or 24GiB")
    return float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]


def _device_count(overrides: list[str]) -> int:
    from tunix_train.config import load_config

    cfg, _ = load_config(overrides)
    sizes = cfg.model.mesh_shape[0] if isinstance(cfg.model.mesh_shape, (list, tuple)) else []
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ConfigError("model.mesh_shape: the planner needs explicit positive sizes (no -1)")
    return math.prod(sizes)


def _shard_bytes(tree, shardings) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs) under `shardings` (a prefix tree)."""
    import jax

    per_sharding = jax.tree.map(
        lambda sharding, sub: sum(math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
                                  for x in jax.tree.leaves(sub)), shardings, tree)
    return sum(jax.tree.leaves(per_sharding))


def plan(overrides: list[str]):
    import jax

    from tunix_train.config import load_config
    from tunix_train.sharding import batch_sharding
    from tunix_train.train.setup import setup
    from tunix_train.train.step import abstract_batch

    cfg, _ = load_config(overrides)
    run = setup(cfg)
    t = cfg.training
    batch = abstract_batch(run.mesh, t.gradient_accumulation_steps, run.micro_batch, cfg.data.seq_len,
                           run.objective.batch_dtypes)
    with jax.set_mesh(run.mesh):
        compiled = run.step_fn.lower(run.plan.abstract, batch).compile()
    memory = compiled.memory_analysis()
    # An offloaded part of the state is in pinned host memory between steps: counted on the host,
    # outside the devices' total. Its copy for the step is among the temporaries where the
    # compiler keeps it on the device.
    on_host = lambda part: (jax.tree.leaves(getattr(run.plan.shardings, part))
                            != jax.tree.leaves(getattr(run.plan.on_device, part)))
    state = {}
    parts = (("params", "parameters"), ("opt_state", "optimizer state"), ("frozen", "frozen weights"))
    for part, name in parts if run.plan.abstract.frozen is not None else parts[:2]:
        state[name + (" (host)" if on_host(part) else "")] = _shard_bytes(
            getattr(run.plan.abstract, part), getattr(run.plan.shardings, part))
    figures = {
        **state,
        "gradient accumulator (in temporaries)": _shard_bytes(run.plan.abstract.params, run.plan.grad_shardings),
        "temporaries (compiler)": memory.temp_size_in_bytes,
        "batch": sum(math.prod(batch_sharding(run.mesh).shard_shape(b.shape)) * b.dtype.itemsize
                     for b in batch.values()),
    }
    if cfg.model.num_experts:
        experts = _expert_leaves(run.plan.abstract.params)
        figures["experts (of the parameters)"] = _shard_bytes(experts, _expert_leaves(run.plan.shardings.params))
    # The accumulator lives inside the step's temporaries; the total counts it once.
    on_device = sum(v for k, v in state.items() if not k.endswith("(host)"))
    figures["total"] = on_device + figures["batch"] + memory.temp_size_in_bytes
    return figures, cfg, run


def _expert_leaves(params):
    """The experts' weights of a parameter tree (or of its shardings), by path."""
    import jax

    named = {jax.tree_util.keystr(path).removesuffix(".value"): leaf
             for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    return {name: leaf for name, leaf in named.items() if "'gate_up_EDCM'" in name or "'down_EMD'" in name}


def parameter_counts(cfg, params) -> tuple[int, int]:
    """(all parameters, those a token goes through): of each layer's experts only k of E count."""
    import jax

    total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    experts = sum(math.prod(x.shape) for x in _expert_leaves(params).values())
    m = cfg.model
    active = total - experts + (experts * m.num_experts_per_token // m.num_experts if m.num_experts else 0)
    return total, active


def advice(cfg, mesh, training: bool = True) -> list[str]:
    """What lowers per-device memory, the most effective first; `training=False` for loading or
    sampling a model (only the mesh then matters, and cfg may be None)."""
    from tunix_train.model.layout import layer_groups
    from tunix_train.parallel import pipelines

    t, tips = cfg.training if training else None, []
    if training and t.micro_batch_size > 1:
        tips.append(f"training.micro_batch_size={max(t.micro_batch_size // 2, 1)} with "
                    f"training.gradient_accumulation_steps={t.gradient_accumulation_steps * 2} (same global batch)")
    if training and cfg.data.seq_len > 1:
        tips.append(f"data.seq_len={cfg.data.seq_len // 2} (shorter sequences)")
    if training and t.remat.value != "full":
        tips.append("training.remat=full (recompute activations in the backward pass)")
    divided = "parameters, gradients and optimizer state divide" if training else "parameters divide"
    if mesh.shape.get("fsdp", 1) < mesh.devices.size:
        tips.append(f"shard more over fsdp ({divided} by it)")
    else:
        tips.append(f"more devices on the fsdp axis ({divided} by it)")
    if (training and pipelines(cfg.model) and mesh.shape.get("pp", 1) == 1
            and layer_groups(cfg.model)[0].repeats % 2 == 0):  # the stages split the repeats
        tips.append(f"a pp mesh axis (each stage holds num_layers / pp layers and their optimizer state; with "
                    f"training.pipeline_microbatches >= pp)")
    if cfg is not None and cfg.model.num_experts and cfg.model.num_experts % (2 * mesh.shape.get("ep", 1)) == 0:
        tips.append("a larger ep mesh axis (the experts divide by it)")
    if training and mesh.shape.get("cp", 1) == 1 and cfg.data.seq_len % 4 == 0:
        tips.append("a cp mesh axis (activations divide by it: the sequence is split across devices)")
    device = mesh.devices.flat[0]
    if (training and device.platform != "cpu"  # a CPU's "device" memory is the host's
            and "pinned_host" in {m.kind for m in device.addressable_memories()}):
        if not t.offload_optimizer_state:
            tips.append("training.offload_optimizer_state=true (AdamW's moments in host memory)")
        if t.mixed_precision.value == "bf16" and not t.offload_master_weights:
            tips.append("training.offload_master_weights=true (the float32 parameters in host memory)")
    if training and t.mixed_precision.value != "bf16":
        tips.append("training.mixed_precision=bf16 (activations in bfloat16)")
    return tips


class OutOfMemory(ConfigError):
    """A run or a model that does not fit its devices' or its host's memory; the message is one line
    saying what ran out, by how much, and what to lower."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _host_memory_available() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _explain(err: BaseException, cfg, mesh, compiled, training: bool, first_tips: list[str]) -> str:
    device = mesh.devices.flat[0]
    text = str(err)
    on_host = isinstance(err, MemoryError) or device.platform == "cpu" or "host" in text.split("\n")[0].lower()
    parts = [f"out of {'host RAM' if on_host else f'device memory ({device.device_kind})'}"]
    if asked := re.search(r"(\d+) bytes", text):
        parts.append(f"an allocation of {_gib(int(asked.group(1)))} failed")
    stats = {} if on_host else (device.memory_stats() or {})
    available = (stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats
                 else _host_memory_available() if on_host else None)
    if available is not None:
        parts.append(f"{_gib(available)} {'of host RAM' if on_host else 'per device'} available")
    if compiled is not None:
        memory = compiled.memory_analysis()
        parts.append(f"the compiled train step needs {_gib(memory.argument_size_in_bytes + memory.temp_size_in_bytes)} "
                     f"per device ({_gib(memory.argument_size_in_bytes)} of arguments, "
                     f"{_gib(memory.temp_size_in_bytes)} of temporaries)")
    tips = first_tips + advice(cfg, mesh, training)
    return "; ".join(parts) + "; to lower it, in this order: " + "; ".join(tips)


class MemoryErrors:
    """A context in which an allocation failure (XLA's RESOURCE_EXHAUSTED at compile or run time,
    or a host MemoryError) becomes OutOfMemory with _explain's one line. Set `compiled` to the
    compiled train step once there is one: its memory analysis joins the message. `first_tips`:
    what to lower before advice()'s (a sampler's batch and lengths)."""

    def __init__(self, cfg, mesh, training: bool = True, first_tips: list[str] | None = None):
        self.cfg, self.mesh, self.training, self.compiled = cfg, mesh, training, None
        self.first_tips = first_tips or []

    def __enter__(self) -> MemoryErrors:
        return self

    def __exit__(self, kind, err, traceback) -> bool:
        if isinstance(err, MemoryError) or (err is not None and "RESOURCE_EXHAUSTED" in str(err)):
            raise OutOfMemory(_explain(err, self.cfg, self.mesh, self.compiled, self.training,
                                       self.first_tips)) from None
        return False


def main(argv: list[str]) -> int:
    device_memory = None
    overrides = []
    for arg in argv:
        if arg.startswith("--device-memory="):
            device_memory = _parse_bytes(arg.split("=", 1)[1])
        else:
            overrides.append(arg)
    try:
        devices = _device_count(overrides)
        if "jax" not in sys.modules:
            os.environ["JAX_PLATFORMS"] = "cpu"
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       f" --xla_force_host_platform_device_count={devices}").strip()
        figures, cfg, run = plan(overrides)
    except (ConfigError, ValueError) as err:
        print(f"tunix_train.plan: error: {err}", file=sys.stderr)
        return 2
    print(f"{cfg.model.name} on {dict(run.mesh.shape)}, {run.micro_batch} rows x {cfg.data.seq_len} tokens "
          f"per micro-step, {cfg.training.gradient_accumulation_steps} accumulation steps, "
          f"{cfg.training.mixed_precision.value}, remat={cfg.training.remat.value}")
    for line in run.parallel.describe() if run.parallel else ():
        print(line)
    total, active = parameter_counts(cfg, run.plan.abstract.params)
    if cfg.model.num_experts:
        print(f"parameters: {total:,}, of which {active:,} active per token ({cfg.model.num_experts_per_token} of "
              f"{cfg.model.num_experts} experts); experts split over ep={run.mesh.shape.get('ep', 1)}")
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
