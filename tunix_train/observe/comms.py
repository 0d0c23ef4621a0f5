"""Communication profile: bytes each collective kind moves per step (from the compiled HLO) and the
time spent in it (from a jax.profiler trace).

Bytes are the logical size of the array a collective produces or consumes on one device: the
gathered output of an all-gather, the unreduced input of a reduce-scatter, the operand of an
all-reduce, all-to-all or collective-permute. Collectives inside loops (the scan over layers, over
micro-batches) count once per iteration, using the trip count XLA records on each while loop.
Each collective is also attributed to the mesh axes its device groups span, which names the
traffic of each parallelism: fsdp's gathers and reductions, tp's all-reduces, the pipeline's
collective-permutes over pp, context parallelism's gathers and permutes over cp.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
import time
from pathlib import Path

import jax
import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_ITEM_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b(pred|bf16|[fsuc]\d+|f8\w*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|called_computations)="
    r"(\{[^}]*\}|%[\w.\-]+)"
)
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _bytes_of(type_text: str) -> int:
    """Bytes of an HLO type: an array such as f32[64,128]{1,0}, or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += size * _ITEM_BYTES.get(dtype, 1)
    return total


def _operands(rest: str) -> list[str]:
    """Operand names of an instruction, from the text after its opening parenthesis."""
    depth, end = 1, len(rest)
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """HLO's iota device list [dims]T(perm): 0..n-1 laid out as dims, transposed by perm."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _groups(rest: str, devices: int) -> list[list[int]] | None:
    """The device groups of a collective (for a collective-permute, its source-target pairs), from
    any of HLO's spellings of replica_groups; None where the text has none that this reads."""
    if match := re.search(r"(source_target_pairs|replica_groups)=\{((?:\{[\d,]*\},?)*)\}", rest):
        groups = [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", match.group(2))]
        return groups or [list(range(devices))]  # {}: every device
    if match := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest):
        return (
            _iota(match.group(2), match.group(3))
            .reshape([int(d) for d in match.group(1).split(",")])
            .tolist()
        )
    if match := re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
        r"\s*\{([^}]*)\}",
        rest,
    ):
        axes = re.findall(r"'(\w+)'=(\d+)", match.group(1))
        sizes = [int(size) for _, size in axes]
        ids = (
            _iota(match.group(2), match.group(3)) if match.group(2) else np.arange(math.prod(sizes))
        ).reshape(sizes)
        grouped = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in match.group(4)]
        rest_axes = [i for i in range(len(sizes)) if i not in grouped]
        return ids.transpose(rest_axes + grouped).reshape(-1, math.prod(sizes[i] for i in grouped)).tolist()
    return None


def mesh_axes_of(rest: str, mesh_shape: dict[str, int]) -> str:
    """The mesh axes a collective's groups span ("pp", "fsdp,tp"; "?" where unreadable): those along
    which the devices of a group differ. Device i of the HLO is the i-th device of the mesh."""
    sizes = list(mesh_shape.values())
    groups = _groups(rest, math.prod(sizes))
    if groups is None:
        return "?"
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(group, sizes))  # [axes, devices of the group]
        varying |= {name for name, row in zip(mesh_shape, coords) if len(set(row.tolist())) > 1}
    return ",".join(name for name in mesh_shape if name in varying) or "none"


def collective_kind(op_name: str) -> str | None:
    """'all-gather-start.3' -> 'all-gather'; None for anything that is not a collective."""
    for kind in COLLECTIVES:
        if op_name.startswith(kind) and not op_name.startswith(kind + "-done"):
            return kind
    return None


@dataclasses.dataclass
class CollectiveVolume:
    bytes: dict[str, float]  # per kind, per step, per device
    count: dict[str, int]  # collective ops executed per step, per kind
    unknown_trip_counts: int  # loops whose trip count XLA did not record (counted once)
    # per "kind over mesh axes" (e.g. "collective-permute over pp"), when the mesh was given
    bytes_by_axes: dict[str, float] = dataclasses.field(default_factory=dict)


def collective_volume(hlo_text: str, mesh_shape: dict[str, int] | None = None) -> CollectiveVolume:
    """Per-step bytes and op counts by collective kind, for one device of a compiled HLO module;
    with the mesh's {axis: size}, also by the mesh axes each collective spans."""
    computations: dict[str, list[tuple]] = {}
    entry, current, types = None, None, {}  # types by (computation, instruction)
    for line in hlo_text.splitlines():
        if current is None:
            if match := _COMPUTATION.match(line):
                current = match.group(2)
                computations[current] = []
                entry = current if match.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        if match := _INSTRUCTION.match(line):
            name, type_text, opcode, rest = match.groups()
            types[current, name] = type_text
            computations[current].append((name, type_text, opcode, rest))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    multiplicity: dict[str, int] = collections.Counter()
    unknown = 0

    def visit(computation: str, times: int) -> None:
        nonlocal unknown
        multiplicity[computation] += times
        for _, _, opcode, rest in computations.get(computation, ()):
            trips = 1
            if opcode == "while":
                found = _TRIP_COUNT.search(rest)
                unknown += found is None
                trips = int(found.group(1)) if found else 1
            for role, callees in _CALLEE.findall(rest):
                if role == "to_apply" and opcode not in ("call", "map"):
                    continue  # reductions' scalar computations
                for callee in re.findall(r"%([\w.\-]+)", callees):
                    visit(callee, times * (trips if role == "body" else 1))

    visit(entry, 1)
    volume, count, by_axes = collections.Counter(), collections.Counter(), collections.Counter()
    for computation, times in multiplicity.items():
        for _name, type_text, opcode, rest in computations.get(computation, ()):
            kind = collective_kind(opcode)
            if kind is None:
                continue
            operand_bytes = sum(_bytes_of(types.get((computation, o), "")) for o in _operands(rest))
            if kind == "all-gather":
                size = _bytes_of(type_text) - (operand_bytes if opcode.endswith("-start") else 0)
            else:
                size = operand_bytes
            volume[kind] += size * times
            count[kind] += times
            if mesh_shape:
                by_axes[f"{kind} over {mesh_axes_of(rest, mesh_shape)}"] += size * times
    return CollectiveVolume(
        {k: float(volume[k]) for k in COLLECTIVES},
        {k: count[k] for k in COLLECTIVES},
        unknown,
        {k: float(v) for k, v in sorted(by_axes.items())},
    )


def _merged_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


_CONTROL_FLOW = ("while", "conditional", "call")


def collective_time(trace_file: Path, module: str) -> tuple[dict[str, float], int]:
    """Seconds spent per collective kind and in computation, summed over the traced steps and
    averaged over devices, for the HLO module `module`; also the number of devices seen.

    Reads XLA's op events: on CPU each carries `hlo_op`, `hlo_module` and `device_ordinal` stats;
    on GPU they sit on each device plane's "XLA Ops" line."""
    profile = jax.profiler.ProfileData.from_file(str(trace_file))
    per_device: dict[str, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for plane in profile.planes:
        on_device = plane.name.startswith("/device:")
        for line in plane.lines:
            if on_device and line.name != "XLA Ops":
                continue
            for event in line.events:
                stats = dict(event.stats)
                if not on_device and "hlo_op" not in stats:
                    continue
                if module not in str(stats.get("hlo_module", module)):
                    continue
                op = str(stats.get("hlo_op", event.name))
                if op.split(".")[0] in _CONTROL_FLOW:
                    continue
                device = plane.name if on_device else f"device {stats.get('device_ordinal', '?')}"
                kind = collective_kind(op) or "computation"
                per_device[device][kind].append((event.start_ns * 1e-9, event.end_ns * 1e-9))
    devices = len(per_device) or 1
    seconds = collections.Counter()
    for kinds in per_device.values():
        for kind, intervals in kinds.items():
            seconds[kind] += (
                _merged_length(intervals)
                if kind == "computation"
                else sum(stop - start for start, stop in intervals)
            )
    return {k: seconds[k] / devices for k in ("computation", *COLLECTIVES)}, len(per_device)


def summary_table(volume: CollectiveVolume, seconds: dict[str, float], steps: int, step_time_s: float) -> str:
    lines = [
        f"{'':<20}{'ms/step':>10}{'MB/step':>12}{'ops/step':>10}",
        f"{'step (wall)':<20}{step_time_s * 1e3:>10.1f}",
        f"{'computation':<20}{seconds['computation'] / steps * 1e3:>10.1f}",
    ]
    for kind in COLLECTIVES:
        lines.append(
            f"{kind:<20}{seconds[kind] / steps * 1e3:>10.1f}{volume.bytes[kind] / 1e6:>12.3f}"
            f"{volume.count[kind]:>10}"
        )
    if volume.bytes_by_axes:
        lines.append("by mesh axes (MB/step):")
        lines += [f"  {name:<36}{size / 1e6:>12.3f}" for name, size in volume.bytes_by_axes.items()]
    return "\n".join(lines)


class CommunicationProfile:
    """training.profile_communication: traces `steps` steps starting at `first` into run_dir
    (TensorBoard's profile plugin reads run_dir/plugins/profile; Perfetto opens the .trace.json.gz)
    and summarizes them against the compiled step's collectives."""

    def __init__(self, run_dir: Path, first: int, steps: int, compiled_step, mesh_shape: dict[str, int]):
        self.run_dir, self.first, self.last, self.mesh_shape = run_dir, first, first + steps - 1, mesh_shape
        self.hlo = compiled_step.as_text()
        self.module = re.match(r"HloModule\s+([\w.\-]+)", self.hlo).group(1)
        self.started = None

    def before_step(self, step: int) -> None:
        """`step` is about to run (0-based)."""
        if step == self.first:
            jax.profiler.start_trace(str(self.run_dir), create_perfetto_trace=True)
            self.started = time.perf_counter()

    def after_step(self, step: int, state, final: bool) -> str | None:
        """`step` has been dispatched; returns the summary once the traced steps are done."""
        if self.started is None or not (step == self.last or final):
            return None
        jax.block_until_ready(state)
        wall = time.perf_counter() - self.started
        jax.profiler.stop_trace()
        self.started = None
        steps = step - self.first + 1
        trace = max(self.run_dir.glob("plugins/profile/*/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        volume = collective_volume(self.hlo, self.mesh_shape)
        seconds, devices = collective_time(trace, self.module)
        report = {
            "steps": [self.first + 1, step + 1],
            "devices_traced": devices,
            "step_time_s": wall / steps,
            "seconds_per_step": {k: v / steps for k, v in seconds.items()},
            "bytes_per_step": volume.bytes,
            "collectives_per_step": volume.count,
            "bytes_per_step_by_mesh_axes": volume.bytes_by_axes,
            "loops_without_trip_count": volume.unknown_trip_counts,
            "trace": str(trace),
        }
        (self.run_dir / "communication.json").write_text(json.dumps(report, indent=1))
        return (
            f"communication profile of steps {self.first + 1}-{step + 1}, per device ({devices} traced); "
            f"trace in {trace.parent}, summary in {self.run_dir / 'communication.json'}\n"
            + summary_table(volume, seconds, steps, wall / steps)
        )
