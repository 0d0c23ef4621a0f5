"""The one owner of the Mesh and of every PartitionSpec.

Modules name the logical axes of their parameters and activations; `LOGICAL_RULES` maps those names
to mesh axes. Changing a parallelism strategy is an edit to that table, never to the model. The
table is a value (`Rules`, immutable): code that needs a variant derives a new one
(`per_shard_rules`) and passes it to where it is used.

Mesh axes:
  dp    data parallel: parameters replicated, batch sharded
  fsdp  fully sharded data parallel: parameters, gradients, optimizer state and batch sharded
  tp    tensor parallel: attention heads and MLP width split Megatron-style
  pp    pipeline parallel: the layer stack split into stages (tunix_train/parallel/pipeline.py)
  cp    context parallel: every activation split along the sequence (tunix_train/parallel/context.py)
  ep    expert parallel: the experts of mixture-of-experts layers split (tunix_train/model/moe.py);
        for everything else a data axis like fsdp (the batch and the parameters' embed axis split)
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tunix_train.config import ConfigError, ModelConfig

MESH_AXES = ("dp", "fsdp", "tp", "pp", "cp", "ep")
BATCH_AXES = ("dp", "fsdp", "ep")  # the data-parallel axes: the batch is split over them


class Rules(Mapping[str, tuple[str, ...]]):
    """Logical axis -> mesh axes, in order: an immutable, hashable table (models hold it as static
    structure). `replace` returns a new table."""

    def __init__(self, table: Mapping[str, tuple[str, ...]]):
        self._table = {name: tuple(axes) for name, axes in table.items()}

    def __getitem__(self, logical: str) -> tuple[str, ...]:
        return self._table[logical]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __hash__(self) -> int:
        return hash(frozenset(self._table.items()))  # equal tables (any order) hash alike

    def __repr__(self) -> str:
        return f"Rules({self._table})"

    def replace(self, **changes: tuple[str, ...]) -> Rules:
        unknown = set(changes) - set(self._table)
        if unknown:
            raise KeyError(f"no rule for {sorted(unknown)}")
        return Rules({**self._table, **changes})


# Logical axis -> mesh axes, in order. Mesh axes absent from the mesh are dropped.
LOGICAL_RULES = Rules(
    {
        # parameters
        "vocab": ("tp", "fsdp"),  # the embedding's rows: gathering fsdp joins whole rows, no transposes
        "embed": ("fsdp", "ep"),
        "mlp": ("tp",),
        "experts": ("ep",),  # an expert's weights whole on the ep shard that holds it
        "moe_mlp": ("tp",),
        "heads": ("tp",),
        "kv_heads": ("tp",),
        "head_dim": (),
        "layers": ("pp",),  # the stacked layers: each pipeline stage holds its own
        "vision_layers": (),  # the image tower's stacked layers: it runs whole, before the stages
        "gguf_rows": (
            "tp",
            "fsdp",
        ),  # a GGUF base's tensor rows (model/quant.py): all of a weight's split, whole blocks
        "norm": (),  # norm scales: sharding a vector costs a collective per use and saves next to nothing
        # LoRA's rank. A factor shards over tp along the dimensions it shares with its weight; fsdp splits
        # its first dimension that takes it: A's input (embed), else the rank (B, which fsdp would
        # otherwise leave whole on every device: q's heads, the MLP width are not on fsdp).
        "lora_rank": ("fsdp",),
        # activations
        "batch": BATCH_AXES,
        "seq": ("cp",),
        "act_embed": (),
        "act_heads": ("tp",),
        "act_mlp": ("tp",),
        "act_vocab": ("tp",),
    }
)

# Mesh axes for logical axes whose size their rule's mesh axes do not divide, instead of an error:
# key/value heads fewer than tp (multi-query attention) are replicated; a vocabulary that tp
# divides but tp x fsdp does not is split over tp, and the embedding's embed axis then takes fsdp.
IF_INDIVISIBLE = Rules({"kv_heads": (), "vocab": ("tp",), "lora_rank": ()})


def per_shard_rules(rules: Rules) -> Rules:
    """`rules` for code traced under jax.vmap(..., spmd_axis_name=data axes), where the vmapped
    dimension carries the data split: activations leave their `batch` dimension unsplit."""
    return rules.replace(batch=())


def _parse_mesh_shape(
    mesh_shape: Any, num_devices: int | None, key: str = "model.mesh_shape"
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Sizes and names; a -1 size filled from num_devices (None: not allowed, nor checked)."""
    if not (
        isinstance(mesh_shape, Sequence)
        and len(mesh_shape) == 2
        and all(isinstance(part, Sequence) and not isinstance(part, str) for part in mesh_shape)
    ):
        raise ConfigError(
            f'{key}={mesh_shape} must be [[sizes...], [axis names...]], e.g. [[4,2],["fsdp","tp"]]'
        )
    sizes, names = list(mesh_shape[0]), [str(n) for n in mesh_shape[1]]
    if len(sizes) != len(names) or not names:
        raise ConfigError(f"{key}: {len(sizes)} sizes for {len(names)} axis names")
    unknown = [n for n in names if n not in MESH_AXES]
    if unknown:
        raise ConfigError(f"{key}: unknown mesh axis {unknown[0]!r}; choose from {list(MESH_AXES)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}: duplicate mesh axis names in {names}")
    if not all(isinstance(s, int) and (s > 0 or s == -1) for s in sizes) or sizes.count(-1) > 1:
        raise ConfigError(f"{key}: sizes {sizes} must be positive integers, with at most one -1")
    if num_devices is None:
        if -1 in sizes:
            raise ConfigError(f"{key}: sizes {sizes} must be given, not -1")
        return tuple(sizes), tuple(names)
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if num_devices % known:
            raise ConfigError(f"{key}: cannot fill -1, {num_devices} devices are not divisible by {known}")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"{key}: mesh {dict(zip(names, sizes))} has {math.prod(sizes)} devices "
            f"but {num_devices} are available; make the sizes multiply to {num_devices}"
        )
    return tuple(sizes), tuple(names)


def make_mesh(
    mesh_shape: Any, devices: Sequence[jax.Device] | None = None, key: str = "model.mesh_shape"
) -> Mesh:
    """mesh_shape [[sizes], [names]] -> Mesh over `devices` (default: all), `tp` innermost, `pp`
    outermost. `key`: the config key errors name."""
    devices = list(jax.devices() if devices is None else devices)
    sizes, names = _parse_mesh_shape(mesh_shape, len(devices), key)
    # Lay devices out with tp as the fastest-varying axis so it stays on the closest links and pp
    # as the slowest (stages exchange the least), then transpose back to the user's axis order.
    order = sorted(range(len(names)), key=lambda i: {"pp": -1, "tp": 1}.get(names[i], 0))
    ordered_sizes = [sizes[i] for i in order]
    hosts = sorted({d.process_index for d in devices})
    if len(hosts) == 1:
        ordered = mesh_utils.create_device_mesh(ordered_sizes, devices, allow_split_physical_axes=True)
    else:
        # Hosts outermost, each host's devices innermost: tp stays within a host, while dp and
        # fsdp span hosts (a hybrid host x local-device mesh).
        local = len(devices) // len(hosts)
        tp = sizes[names.index("tp")] if "tp" in names else 1
        if local % tp:
            raise ConfigError(
                f"model.mesh_shape: tp={tp} must divide the {local} devices of each host; "
                f"tensor parallelism stays within a host"
            )
        by_host = sorted(devices, key=lambda d: (d.process_index, d.id))
        ordered = np.array(by_host, dtype=object).reshape(ordered_sizes)
    device_array = np.transpose(ordered, np.argsort(order))
    return Mesh(device_array, names, axis_types=(AxisType.Auto,) * len(names))


def mesh_over(mesh_shape: Any, mesh: Mesh, key: str) -> Mesh:
    """A mesh of mesh_shape over `mesh`'s devices in their order (its own split of the same
    devices): one compiled program takes arrays on both, as jit needs every argument's devices in
    one order. `key`: the setting errors name."""
    sizes, names = _parse_mesh_shape(mesh_shape, mesh.devices.size, key)
    devices = np.array(list(mesh.devices.flat), dtype=object).reshape(sizes)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def split_devices(
    devices: Sequence[jax.Device], mesh_shape: Any, apart_shape: Any, key: str, copies: int = 1
) -> tuple[list[jax.Device], list[jax.Device]]:
    """The run's devices -> (those of model.mesh_shape, those set apart for `copies` meshes of
    `apart_shape`, named under `key`): each process gives its last devices (by id) to the second,
    as many each, so both meshes span every process."""
    sizes, _ = _parse_mesh_shape(apart_shape, None, key)
    apart, processes = copies * math.prod(sizes), sorted({d.process_index for d in devices})
    if apart % len(processes) or apart // len(processes) >= len(devices) // len(processes):
        times = f" x {copies} replicas" if copies > 1 else ""
        raise ConfigError(
            f"{key}{times}: its {apart} devices must leave devices for training on each of the "
            f"{len(processes)} processes (with {len(devices)} devices in all), as many on each"
        )
    per_process = apart // len(processes)
    chosen = [
        d
        for p in processes
        for d in sorted((d for d in devices if d.process_index == p), key=lambda d: d.id)[-per_process:]
    ]
    rest = [d for d in devices if d not in chosen]
    try:
        training = math.prod(_parse_mesh_shape(mesh_shape, None)[0])
    except ConfigError:  # a -1, filled from the rest (or a malformed shape, which make_mesh reports)
        training = len(rest)
    if training != len(rest):
        raise ConfigError(
            f"model.mesh_shape takes {training} devices and {key} {apart} more; the "
            f"two meshes must not share devices and together use the run's {len(devices)}"
        )
    return rest, chosen


def cross_mesh_copier(source: Mesh, target: Mesh) -> Callable[[Any, Any], Any]:
    """(tree of global arrays on `source`, shardings on `target`) -> the tree laid out on `target`,
    another part of the run's devices. In one process, jax.device_put. Multi-controller JAX moves
    arrays only within one device set, so with several processes each array is first laid out on
    the source devices as it will be on the target (a mesh of source devices shaped like the
    target, each process's devices standing for its own target devices), then every process copies
    its own shards across. That needs as many source as target devices on each process."""
    if jax.process_count() == 1:
        return jax.device_put

    def local(mesh):
        return {
            p: sorted((d for d in mesh.devices.flat if d.process_index == p), key=lambda d: d.id)
            for p in range(jax.process_count())
        }

    sources, targets = local(source), local(target)
    if any(len(sources[p]) != len(targets[p]) for p in sources):
        raise ConfigError(
            "training.rollout.mesh_shape: in a multi-process run the rollout mesh needs as many "
            "devices on each process as the training mesh (each process copies its own shards)"
        )
    stand_in = {t: s for p in sources for s, t in zip(sources[p], targets[p])}
    counterpart = Mesh(
        np.vectorize(stand_in.get, otypes=[object])(target.devices),
        target.axis_names,
        axis_types=target.axis_types,
    )
    back = {s: t for t, s in stand_in.items()}

    def copy(x: jax.Array, sharding: NamedSharding) -> jax.Array:
        laid_out = jax.device_put(x, NamedSharding(counterpart, sharding.spec))
        shards = [jax.device_put(shard.data, back[shard.device]) for shard in laid_out.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

    # shardings may be a prefix tree (one per nnx.Variable, as state_shardings gives them)
    return lambda tree, shardings: jax.tree.map(
        lambda sharding, subtree: jax.tree.map(lambda x: copy(x, sharding), subtree), shardings, tree
    )


def axis_size(mesh: Mesh, names: Sequence[str]) -> int:
    return math.prod(mesh.shape.get(n, 1) for n in names)


def data_parallel_size(mesh: Mesh) -> int:
    return axis_size(mesh, BATCH_AXES)


def validate_model_for_mesh(model: ModelConfig, mesh: Mesh) -> None:
    """Divisibility that the Megatron split needs, as config errors (tunix_train.parallel checks pp
    and cp)."""
    tp, ep = mesh.shape.get("tp", 1), mesh.shape.get("ep", 1)
    for key, value in (
        ("model.num_heads", model.num_heads),
        ("model.hidden_dim", model.hidden_dim),
        ("model.vocab_size", model.vocab_size),
    ):
        if value % tp:
            raise ConfigError(
                f"{key}={value} is not divisible by the tp mesh axis ({tp}); choose a tp size that divides it"
            )
    if model.moe.experts and model.moe.experts % ep:
        raise ConfigError(
            f"model.moe.experts={model.moe.experts} is not divisible by the ep mesh axis ({ep}); "
            f"choose an ep size that divides it"
        )
    if model.moe.experts and model.moe.hidden_dim % tp:
        raise ConfigError(
            f"model.moe.hidden_dim={model.moe.hidden_dim} is not divisible by the tp mesh axis ({tp})"
        )


def _mesh_axes_for(logical: str, mesh: Mesh, rules: Rules) -> tuple[str, ...]:
    return tuple(a for a in rules[logical] if a in mesh.shape)


def logical_to_spec(
    axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, what: str, rules: Rules = LOGICAL_RULES
) -> P:
    """PartitionSpec for an array of `shape` whose dimensions carry logical `axes`. A mesh axis
    splits at most one dimension: the first whose rule names it (the embedding's vocab takes fsdp
    before its embed axis can)."""
    if len(axes) != len(shape):
        raise ValueError(f"{what}: {len(axes)} logical axes {tuple(axes)} for shape {tuple(shape)}")
    spec, used = [], set()
    for logical, size in zip(axes, shape):
        if logical is None:
            spec.append(None)
            continue
        try:
            mesh_axes = tuple(a for a in _mesh_axes_for(logical, mesh, rules) if a not in used)
        except KeyError:
            raise ValueError(f"{what}: logical axis {logical!r} has no rule in the rules table") from None
        if size % axis_size(mesh, mesh_axes):
            if logical not in IF_INDIVISIBLE:
                raise ConfigError(
                    f"{what}: dimension {logical!r} of size {size} is not divisible by "
                    f"mesh axes {mesh_axes} of size {axis_size(mesh, mesh_axes)}"
                )
            mesh_axes = tuple(a for a in IF_INDIVISIBLE[logical] if a in mesh_axes)
        used |= set(mesh_axes)
        spec.append(_spec_entry(mesh_axes))
    return P(*spec)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(
    abstract_state: Any, mesh: Mesh, replicated_over: Sequence[str] = (), rules: Rules = LOGICAL_RULES
) -> Any:
    """Shardings for a pytree whose nnx.Variable leaves carry `axes` metadata (parameters and the
    optimizer moments that mirror them), replicated over the mesh axes `replicated_over`; every
    other leaf (counters, scalars) is replicated."""

    def leaf_sharding(path, leaf):
        if not _is_variable(leaf):
            return NamedSharding(mesh, P())
        axes, value = leaf.get_metadata()["axes"], leaf.get_value()

        def sharding(shape, axes=axes):
            spec = logical_to_spec(
                axes, shape, mesh, jax.tree_util.keystr(path, simple=True, separator="."), rules
            )
            return NamedSharding(mesh, P(*(_without(entry, replicated_over) for entry in spec)))

        if not jax.tree.leaves(value):  # nothing held (optax's MaskedNode: a frozen part's moments)
            return leaf
        if all(x is value for x in jax.tree.leaves(value)):  # an array
            return sharding(value.shape)
        # a quantized weight (model/quant.py): each of its arrays along the logical axes it names
        return leaf.replace(
            jax.tree.map(lambda x, x_axes: sharding(x.shape, x_axes), value, value.array_axes(axes))
        )

    return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_state, is_leaf=_is_variable)


def manual_axes() -> frozenset[str]:
    """The mesh axes of the shard_map the code is being traced inside (empty outside any): the one
    test of "inside a shard_map"."""
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset() if mesh.empty else frozenset(mesh.manual_axes)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that split the batch."""
    return tuple(a for a in BATCH_AXES if a in mesh.shape)


def per_shard_shardings(shardings: Any, mesh: Mesh) -> Any:
    """For [S, ...] stacks holding one copy per data shard of arrays sharded like `shardings`:
    the leading dimension split over the data axes, the others as before minus those axes."""
    data = data_axes(mesh)

    def stacked(sharding: NamedSharding) -> NamedSharding:
        return NamedSharding(mesh, P(_spec_entry(data), *(_without(entry, data) for entry in sharding.spec)))

    return jax.tree.map(stacked, shardings)


def layer_sharding(stacked: NamedSharding) -> NamedSharding:
    """The sharding of one layer of a stacked [layers, ...] array: the stack's, less its first axis."""
    return NamedSharding(stacked.mesh, P(*tuple(stacked.spec)[1:]))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are [accumulation step, example, position]: examples split over dp and fsdp."""
    return NamedSharding(mesh, P(None, _spec_entry(data_axes(mesh)), None))


def _spec_entry(mesh_axes: tuple[str, ...]):
    return None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


def _without(entry, mesh_axes: Sequence[str]):
    """A PartitionSpec entry with `mesh_axes` removed."""
    axes = entry if isinstance(entry, tuple) else (entry,)
    return _spec_entry(tuple(a for a in axes if a is not None and a not in mesh_axes))


def process_rows(mesh: Mesh, global_rows: int) -> range:
    """The rows of a [.., global_rows, ..] batch held by this process's devices: the rows its data
    loader must produce, in order. A contiguous block whenever hosts are outermost in the mesh."""
    sharding = NamedSharding(mesh, P(_spec_entry(data_axes(mesh))))
    blocks = sorted(
        {
            (sl.indices(global_rows)[:2])
            for (sl,) in sharding.addressable_devices_indices_map((global_rows,)).values()
        }
    )
    lo, hi = blocks[0][0], blocks[-1][1]
    if sum(stop - start for start, stop in blocks) != hi - lo:
        raise ConfigError(
            f"model.mesh_shape: this process's devices hold rows {blocks} of the batch, not one "
            f"block; put dp and fsdp outside tp"
        )
    return range(lo, hi)


def to_global_batch(host_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """The one place host-local rows become global jax.Arrays: each process passes only the rows
    its devices hold (axis 1), and together they form the global batch."""
    sharding = batch_sharding(mesh)
    return {name: jax.make_array_from_process_local_data(sharding, rows) for name, rows in host_batch.items()}


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules: Rules) -> jax.Array:
    """Sharding constraint on an activation under `rules`, against the mesh set with `jax.set_mesh`;
    mesh axes a shard_map has made manual are left out (inside it, arrays are already split over them).

    A no-op outside a mesh context, so modules also run unsharded (unit tests, notebooks)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x

    def auto(logical):
        return tuple(a for a in _mesh_axes_for(logical, mesh, rules) if a not in mesh.manual_axes)

    spec = P(*(None if a is None else _spec_entry(auto(a)) for a in logical_axes))
    return jax.lax.with_sharding_constraint(x, spec)


def describe_mesh(mesh: Mesh) -> str:
    axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return f"Mesh({axes}) over {mesh.devices.size} {mesh.devices.flat[0].platform} devices"
