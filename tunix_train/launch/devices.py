"""Print what JAX sees and the mesh a mesh_shape would build.

    python -m tunix_train.launch.devices [model.mesh_shape=[[2,4],["fsdp","tp"]]] [other overrides]

Run it under the launcher or SLURM as the training run would be, to see every process's view.
"""

import sys
from collections import Counter

from tunix_train import exit_codes
from tunix_train.compose import load_config
from tunix_train.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, _ = load_config(sys.argv[1:] if argv is None else argv)
        from tunix_train.launch import distributed

        how = distributed.initialize(cfg.distributed)
        import jax

        from tunix_train.sharding import data_parallel_size, describe_mesh, make_mesh, process_rows

        print(how if jax.process_count() > 1 else "process 0 of 1 (single process)")
        kinds = Counter(d.device_kind for d in jax.devices())
        print(
            f"local devices: {jax.local_device_count()}; global devices: {jax.device_count()} "
            f"({', '.join(f'{n} x {kind}' for kind, n in kinds.items())}, platform "
            f"{jax.devices()[0].platform})"
        )
        for d in jax.local_devices():
            print(f"  local {d.id}: {d.device_kind} (process {d.process_index})")
        distributed.check_devices()
        mesh = make_mesh(cfg.model.mesh_shape)
        print(f"mesh for model.mesh_shape={cfg.model.mesh_shape}: {describe_mesh(mesh)}")
        for name in mesh.axis_names:
            groups = mesh.devices.swapaxes(mesh.axis_names.index(name), -1).reshape(-1, mesh.shape[name])
            print(
                f"  {name}: {len(groups)} groups of {mesh.shape[name]}, e.g. devices "
                f"{[d.id for d in groups[0]]} (processes {sorted({d.process_index for d in groups[0]})})"
            )
        micro = cfg.training.micro_batch_size * data_parallel_size(mesh)
        rows = process_rows(mesh, micro)
        print(f"this process loads rows {rows.start}..{rows.stop - 1} of each {micro}-row micro-batch")
    except ConfigError as err:
        print(f"tunix_train.launch.devices: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
