"""Render the Kubernetes manifest of a multi-host job (indexed_job.yaml) to stdout.

    python scripts/k8s/render.py --name=gemma-ft --workers=4 --gpus_per_pod=8
    --image=REGISTRY/tunix-train:TAG \
        model=gemma3_12b 'model.mesh_shape=[[4,8],["fsdp","tp"]]' | kubectl apply -f -

The overrides after the flags go to run_training.py; the run directory is fixed on the shared volume
(hydra.run.dir=/runs/NAME), where every restart finds the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import re
import string
import sys
from pathlib import Path

TEMPLATE = Path(__file__).with_name("indexed_job.yaml")


def render(
    name: str,
    workers: int,
    gpus_per_pod: int,
    image: str,
    overrides: list[str],
    workdir: str = "/app",
    runs_claim: str = "tunix-train-runs",
    port: int = 29500,
    max_restarts: int = 3,
    grace_s: int = 120,
) -> str:
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?", name):
        raise ValueError(
            f"--name={name!r}: lower-case letters, digits and '-', at most 52 characters (a DNS label)"
        )
    if workers < 1 or gpus_per_pod < 1 or max_restarts < 0:
        raise ValueError("need --workers >= 1, --gpus_per_pod >= 1 and --max_restarts >= 0")
    if any(o.startswith("hydra.run.dir=") for o in overrides):
        raise ValueError(
            "hydra.run.dir is set by the manifest (/runs/NAME, on the shared volume): leave it out"
        )
    args = [*overrides, f"hydra.run.dir=/runs/{name}"]
    # a JSON list is a YAML flow sequence
    return string.Template(TEMPLATE.read_text()).substitute(
        NAME=name,
        WORKERS=workers,
        GPUS_PER_POD=gpus_per_pod,
        IMAGE=image,
        WORKDIR=workdir,
        RUNS_CLAIM=runs_claim,
        PORT=port,
        MAX_RESTARTS=max_restarts,
        BACKOFF_LIMIT=max(1, workers * max_restarts),
        GRACE_S=grace_s,
        ARGS=json.dumps(args),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--name", required=True)
    parser.add_argument("--workers", type=int, required=True, help="pods, one training process each")
    parser.add_argument("--gpus_per_pod", type=int, required=True)
    parser.add_argument(
        "--image", required=True, help="an image with this repository at --workdir, installed"
    )
    parser.add_argument("--workdir", default="/app")
    parser.add_argument(
        "--runs_claim", default="tunix-train-runs", help="a ReadWriteMany PersistentVolumeClaim"
    )
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--max_restarts", type=int, default=3)
    parser.add_argument(
        "--grace_s", type=int, default=120, help="SIGTERM to SIGKILL: room for a checkpoint save"
    )
    parser.add_argument("overrides", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    try:
        sys.stdout.write(
            render(
                a.name,
                a.workers,
                a.gpus_per_pod,
                a.image,
                a.overrides,
                a.workdir,
                a.runs_claim,
                a.port,
                a.max_restarts,
                a.grace_s,
            )
        )
    except ValueError as err:
        print(f"render.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
