"""Scaling report: one config on 1, 2, 4 and 8 devices; throughput and efficiency, strong and weak.

    python scripts/scaling.py [--devices 1 2 4 8] [--steps 10] [--out scaling] [hydra overrides...]

Strong scaling keeps the global batch (micro_batch_size x the largest device count) and divides it
over the devices; weak scaling keeps micro_batch_size per device. Efficiency is
tokens/s on n devices / (n x tokens/s on 1). The mesh is [[n],["fsdp"]] over the first n devices.
On CPU, fake devices are made (XLA_FLAGS) and share the host's cores, so CPU figures show overheads,
not speed-ups. Writes <out>.json, <out>.png (needs the `scripts` extra: matplotlib) and a table.
"""

import argparse
import json
import os
import sys


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="scaling")
    args, overrides = parser.parse_known_args()
    if "jax" not in sys.modules and not os.environ.get("JAX_PLATFORMS", "").startswith(
        ("cuda", "gpu", "tpu")
    ):
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(args.devices)}")
    import jax
    from data_benchmark import train_tokens_per_sec

    from tunix_train.compose import load_config
    from tunix_train.data import Data

    rows = []
    for mode in ("strong", "weak"):
        for n in args.devices:
            cfg, _ = load_config(overrides)
            micro = cfg.training.micro_batch_size
            cfg.training.micro_batch_size = micro * max(args.devices) // n if mode == "strong" else micro
            cfg.model.mesh_shape = [[n], ["fsdp"]]
            tps = train_tokens_per_sec(cfg, Data(cfg), args.steps, jax.devices()[:n])
            rows.append(
                {
                    "mode": mode,
                    "devices": n,
                    "global_batch": cfg.training.micro_batch_size * n,
                    "tokens_per_sec": tps,
                }
            )
            base = next(r["tokens_per_sec"] for r in rows if r["mode"] == mode)
            rows[-1]["efficiency"] = tps / (n * base)  # the first row of the mode is the 1-device baseline
            print(
                f"{mode:>6} {n:>3} devices  batch {rows[-1]['global_batch']:>4}  {tps:12,.0f} tokens/s  "
                f"efficiency {rows[-1]['efficiency']:.2f}",
                flush=True,
            )
    with open(f"{args.out}.json", "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "overrides": overrides, "rows": rows}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {args.out}.json; for the plot: pip install -e '.[scripts]'")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("strong", "weak"):
        data = [r for r in rows if r["mode"] == mode]
        left.plot([r["devices"] for r in data], [r["tokens_per_sec"] for r in data], "o-", label=mode)
        right.plot([r["devices"] for r in data], [r["efficiency"] for r in data], "o-", label=mode)
    left.set(xlabel="devices", ylabel="tokens/s", title="throughput", xscale="log", xticks=args.devices)
    right.set(
        xlabel="devices",
        ylabel="tokens/s / (n x 1-device)",
        title="scaling efficiency",
        xscale="log",
        xticks=args.devices,
        ylim=(0, 1.1),
    )
    for ax in (left, right):
        ax.set_xticklabels(args.devices)
        ax.minorticks_off()
        ax.legend()
    fig.suptitle(f"{jax.devices()[0].device_kind}: {' '.join(overrides) or 'default config'}")
    fig.tight_layout()
    fig.savefig(f"{args.out}.png", dpi=100)
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
