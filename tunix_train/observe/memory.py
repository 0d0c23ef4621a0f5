"""Running out of memory, told in one line: what ran out, by how much, and what to lower.

`MemoryErrors` turns an allocation failure (XLA's RESOURCE_EXHAUSTED at compile or run time, or a
host MemoryError) into `OutOfMemory`; `advice` lists what lowers per-device memory, and the
planner (python -m tunix_train.plan) prints it too.
"""

from __future__ import annotations

import re

from tunix_train.config import ConfigError
from tunix_train.model.layout import layer_groups
from tunix_train.parallel import pipelines


def advice(cfg, mesh, training: bool = True) -> list[str]:
    """What lowers per-device memory, the most effective first; `training=False` for loading or
    sampling a model (only the mesh then matters, and cfg may be None)."""
    t, tips = cfg.training if training else None, []
    if training and t.micro_batch_size > 1:
        tips.append(
            f"training.micro_batch_size={max(t.micro_batch_size // 2, 1)} with "
            f"training.gradient_accumulation_steps={t.gradient_accumulation_steps * 2} (same global batch)"
        )
    if training and cfg.data.seq_len > 1:
        tips.append(f"data.seq_len={cfg.data.seq_len // 2} (shorter sequences)")
    if training and t.remat.value != "full":
        tips.append("training.remat=full (recompute activations in the backward pass)")
    divided = "parameters, gradients and optimizer state divide" if training else "parameters divide"
    if mesh.shape.get("fsdp", 1) < mesh.devices.size:
        tips.append(f"shard more over fsdp ({divided} by it)")
    else:
        tips.append(f"more devices on the fsdp axis ({divided} by it)")
    if (
        training
        and pipelines(cfg.model)
        and mesh.shape.get("pp", 1) == 1
        and layer_groups(cfg.model)[0].repeats % 2 == 0
    ):  # the stages split the repeats
        tips.append(
            "a pp mesh axis (each stage holds num_layers / pp layers and their optimizer state; with "
            "training.pipeline_microbatches >= pp)"
        )
    if (
        cfg is not None
        and cfg.model.moe.experts
        and cfg.model.moe.experts % (2 * mesh.shape.get("ep", 1)) == 0
    ):
        tips.append("a larger ep mesh axis (the experts divide by it)")
    if training and mesh.shape.get("cp", 1) == 1 and cfg.data.seq_len % 4 == 0:
        tips.append("a cp mesh axis (activations divide by it: the sequence is split across devices)")
    device = mesh.devices.flat[0]
    if (
        training
        and device.platform != "cpu"  # a CPU's "device" memory is the host's
        and "pinned_host" in {m.kind for m in device.addressable_memories()}
    ):
        if not t.offload_optimizer_state:
            tips.append(
                "training.offload_optimizer_state=true (AdamW's moments in host memory between steps: "
                "lowers the peak where activations, not the update, set it)"
            )
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
    on_host = (
        isinstance(err, MemoryError) or device.platform == "cpu" or "host" in text.split("\n")[0].lower()
    )
    parts = [f"out of {'host RAM' if on_host else f'device memory ({device.device_kind})'}"]
    if asked := re.search(r"(\d+) bytes", text):
        parts.append(f"an allocation of {_gib(int(asked.group(1)))} failed")
    stats = {} if on_host else (device.memory_stats() or {})
    available = (
        stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if "bytes_limit" in stats
        else _host_memory_available()
        if on_host
        else None
    )
    if available is not None:
        parts.append(f"{_gib(available)} {'of host RAM' if on_host else 'per device'} available")
    if compiled is not None:
        memory = compiled.memory_analysis()
        parts.append(
            f"the compiled train step needs "
            f"{_gib(memory.argument_size_in_bytes + memory.temp_size_in_bytes)} "
            f"per device ({_gib(memory.argument_size_in_bytes)} of arguments, "
            f"{_gib(memory.temp_size_in_bytes)} of temporaries)"
        )
    tips = first_tips + advice(cfg, mesh, training)
    return "; ".join(parts) + "; to lower it, in this order: " + "; ".join(tips)


class MemoryErrors:
    """A context in which an allocation failure (XLA's RESOURCE_EXHAUSTED at compile or run time,
    its "Out of memory allocating" when an asynchronous computation's result is read, or a host
    MemoryError) becomes OutOfMemory with _explain's one line. Set `compiled` to the
    compiled train step once there is one: its memory analysis joins the message. `first_tips`:
    what to lower before advice()'s (a generation's requests and lengths)."""

    def __init__(self, cfg, mesh, training: bool = True, first_tips: list[str] | None = None):
        self.cfg, self.mesh, self.training, self.compiled = cfg, mesh, training, None
        self.first_tips = first_tips or []

    def __enter__(self) -> MemoryErrors:
        return self

    def __exit__(self, kind, err, traceback) -> bool:
        said = str(err)
        if isinstance(err, MemoryError) or (
            err is not None
            and any(sign in said for sign in ("RESOURCE_EXHAUSTED", "Out of memory allocating"))
            and not any(sign in said for sign in ("No space left", "ENOSPC"))  # a disk's, not memory's
        ):
            raise OutOfMemory(
                _explain(err, self.cfg, self.mesh, self.compiled, self.training, self.first_tips)
            ) from None
        return False
