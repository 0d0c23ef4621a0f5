"""MFU accounting (the architecture's FLOPs per token against XLA's count and by hand), the planner and
scripts/benchmark.py."""

import json
import os
import statistics
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_COMPILE, REPO, config, run_python, synthetic_batches

from tunix_train.observe.memory import advice
from tunix_train.observe.mfu import mean_keys_attended, peak_flops_per_device, train_flops_per_token
from tunix_train.sharding import to_global_batch
from tunix_train.train.setup import setup


def test_flops_per_token_agree_with_xla_cost_analysis():
    # One layer: XLA's cost analysis counts a scan body once, so one layer makes its count exact.
    # Ours counts matmuls and attention only; XLA adds elementwise work, the masked half of the
    # attention square and the optimizer, so ours is a few percent lower.
    cfg = config(
        "model.num_layers=1",
        "model.embed_dim=256",
        "model.hidden_dim=1024",
        "model.head_dim=64",
        "model.vocab_size=4096",
        "data.seq_len=64",
        "training.micro_batch_size=2",
    )
    cfg.model.mesh_shape = [[1], ["fsdp"]]
    run = setup(cfg, jax.devices()[:1])
    data = synthetic_batches(cfg, run.micro_batch)
    with jax.set_mesh(run.mesh):
        compiled = run.step_fn.lower(run.plan.abstract, to_global_batch(next(data), run.mesh)).compile()
    xla = compiled.cost_analysis()["flops"] / (run.micro_batch * 64)
    ours = train_flops_per_token(cfg.model, 64)
    assert 0.85 * xla < ours < xla, (ours, xla)


def test_flops_per_token_by_hand_for_gemma3_1b():
    cfg = config("model=gemma3_1b").model
    D, F, N, K, H, L, V, S = 1152, 6912, 4, 1, 256, 26, 262144, 4096
    matmuls = 6 * L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F) + 6 * D * V
    # 4 global layers see (S + 1) / 2 keys on average; 22 local ones min(t + 1, 512), about 480.
    local_keys = (sum(range(1, 513)) + 512 * (S - 512)) / S
    attention = 12 * N * H * (4 * (S + 1) / 2 + 22 * local_keys)
    assert train_flops_per_token(cfg, S) == pytest.approx(matmuls + attention, rel=1e-9)
    assert mean_keys_attended(4, 8) == 2.5 and mean_keys_attended(8, 2) == pytest.approx(15 / 8)


def test_peak_table_matches_jax_device_kinds():
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops_per_device("NVIDIA H200", "fp32") == 494e12
    assert peak_flops_per_device("TPU v5 lite", "bf16") == 197e12
    assert peak_flops_per_device("cpu", "fp32") is None


GEMMA3_1B_ON_FSDP8 = (
    "model=gemma3_1b",
    'model.mesh_shape=[[8],["fsdp"]]',
    "training.micro_batch_size=1",
    "data=synthetic",
    "data.seq_len=128",
)


def _plan(*args):
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE}  # the planner picks its device count
    result = run_python("-m", "tunix_train.plan", *args, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = {}
    for line in result.stdout.splitlines():
        if line.endswith(" GiB") and line.startswith("  "):
            name, value = line.strip().rsplit(maxsplit=2)[0], float(line.split()[-2])
            figures[name] = value * 2**30
    return result.stdout, figures


def test_planner_counts_an_eighth_of_gemma3_1b_per_device_on_fsdp8():
    out, figures = _plan(
        *GEMMA3_1B_ON_FSDP8,
        "--device_memory=80GB",
    )
    analytic = 999_885_952 * 4 * 3 / 8  # float32 parameters, Adam's two moments, over 8 devices
    assert figures["parameters"] + figures["optimizer state"] == pytest.approx(analytic, rel=0.05)
    assert figures["temporaries (compiler)"] > 0 and "fits in 74.5 GiB per device" in out


def test_planner_counts_an_offloaded_optimizer_state_on_the_host():
    out, figures = _plan(
        *GEMMA3_1B_ON_FSDP8,
        "training.offload_optimizer_state=true",
    )
    assert "optimizer state" not in figures  # only as (host)
    assert figures["optimizer state (host)"] == pytest.approx(999_885_952 * 4 * 2 / 8, rel=0.05)
    # the step moves all of it to the devices for the update: counted there too (XLA:CPU's
    # temporaries miss it)
    assert figures["offloaded part, on the devices in the step"] == pytest.approx(
        figures["optimizer state (host)"]
    )
    device = figures["parameters"] + figures["batch"] + figures["temporaries (compiler)"]
    assert figures["total"] == pytest.approx(device + figures["optimizer state (host)"], abs=0.002 * 2**30)


@pytest.mark.slow  # a whole CLI run or a script: the README's suite stays short
def test_planner_counts_offloaded_master_weights_on_the_host():
    out, figures = _plan(
        *GEMMA3_1B_ON_FSDP8,
        "training.mixed_precision=bf16",
        "training.offload_optimizer_state=true",
        "training.offload_master_weights=true",
    )
    assert "parameters" not in figures and "optimizer state" not in figures  # only as (host)
    assert figures["parameters (host)"] == pytest.approx(999_885_952 * 4 / 8, rel=0.05)
    assert figures["optimizer state (host)"] == pytest.approx(999_885_952 * 4 * 2 / 8, rel=0.05)
    host = figures["parameters (host)"] + figures["optimizer state (host)"]
    assert figures["offloaded part, on the devices in the step"] == pytest.approx(host, abs=0.002 * 2**30)
    device = figures["batch"] + figures["temporaries (compiler)"]
    assert figures["total"] == pytest.approx(device + host, abs=0.002 * 2**30)  # to the printed precision


def test_on_an_accelerator_with_pinned_host_memory_the_advice_ends_with_offloading():
    memories = [types.SimpleNamespace(kind=kind) for kind in ("device", "pinned_host")]
    gpu = types.SimpleNamespace(platform="gpu", addressable_memories=lambda: memories)
    mesh = types.SimpleNamespace(shape={"fsdp": 1}, devices=np.array([gpu], dtype=object))
    tips = advice(config("training.mixed_precision=bf16"), mesh)
    assert tips[-2:] == [
        "training.offload_optimizer_state=true (AdamW's moments in host memory between steps: "
        "lowers the peak where activations, not the update, set it)",
        "training.offload_master_weights=true (the float32 parameters in host memory)",
    ]
    assert not any(
        "offload" in tip
        for tip in advice(
            config(
                "training.mixed_precision=bf16",
                "training.offload_optimizer_state=true",
                "training.offload_master_weights=true",
            ),
            mesh,
        )
    )
    assert not any(
        "offload" in tip
        for tip in advice(
            config("training.mixed_precision=bf16"),
            types.SimpleNamespace(shape={"fsdp": 1}, devices=np.array(jax.devices()[:1])),
        )
    )


def test_planner_says_what_to_change_when_it_does_not_fit():
    out, figures = _plan(
        "model=gemma3_1b",
        'model.mesh_shape=[[2,4],["fsdp","tp"]]',
        "training.micro_batch_size=2",
        "data=synthetic",
        "data.seq_len=128",
        "--device_memory=1GB",
    )
    assert "does NOT fit" in out and "shard more over fsdp" in out and "training.remat=full" in out


@pytest.mark.slow  # a whole CLI run or a script: the README's suite stays short
def test_benchmark_reports_throughput_against_a_peak_sampled_between_steps(tmp_path):
    overrides = [
        "model=gemma3_tiny",
        "data=synthetic",
        "data.seq_len=32",
        'model.mesh_shape=[[2],["fsdp"]]',
        "training.micro_batch_size=2",
    ]
    result = run_python(
        str(REPO / "scripts" / "benchmark.py"),
        "--cpu-devices",
        "2",
        "--steps",
        "6",
        "--warmup",
        "1",
        "--json",
        str(tmp_path / "b.json"),
        *overrides,
        devices=2,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "of measured peak" in result.stdout
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["devices"] == 2 and b["mesh"] == {"fsdp": 2} and b["tokens_per_step"] == 2 * 2 * 32
    # samples before timed steps 1 and 6 and after the last; the peak is their median
    assert len(b["measured_peak_samples"]) == 3 and min(b["measured_peak_samples"]) > 0
    assert b["measured_peak_flops_per_sec"] == statistics.median(b["measured_peak_samples"])
    step = b["step_time_s"]
    assert 0 < step["p10"] <= step["median"] <= step["p90"]
    assert b["tokens_per_sec"] == pytest.approx(b["tokens_per_step"] / step["median"])
    cfg = config(*overrides).model
    assert b["model_flops_per_sec"] == pytest.approx(b["tokens_per_sec"] * train_flops_per_token(cfg, 32))
    assert b["fraction_of_measured_peak"] == pytest.approx(
        b["model_flops_per_sec"] / b["measured_peak_flops_per_sec"]
    )
    assert b["collective_bytes_per_step"]["all-gather"] > 0  # fsdp gathers the parameters
    assert b["compile_time_s"] > 0 and b["loss_after"] > 0


def test_a_measured_peak_the_run_beats_is_measured_again_and_the_log_says_so():
    """A peak measured low (a busy start: 0.099 TFLOP/s where the machine gives 0.3) is revised when
    the run's own FLOP/s exceed it, so MFU stays at most 1; a data sheet's is never revised."""
    from tunix_train.observe.mfu import Peak
    from tunix_train.train.hooks import Interval, StepEnd, TrainMetrics, Work

    quiet = 0.3e12
    peak = Peak(0.099e12, "measured fp32 matmul on cpu", sample=lambda seconds: quiet)
    said = []
    hook = TrainMetrics(
        Interval(),
        every=1,
        max_steps=10,
        work=Work(tokens_per_step=1000, flops_per_token=0.5e9, peak=peak, devices=2),
        say=said.append,
    )
    metrics = {name: jnp.float32(1.0) for name in ("loss", "learning_rate", "grad_norm", "nonfinite_steps")}
    hook.interval.start -= 1.0  # one step took a second: 1000 tokens/s, 0.25 TFLOP/s per device
    end = StepEnd(1, None, metrics)
    hook.after_step(end)
    assert peak.value == quiet and end.scalars["mfu"] <= 1.0
    assert (
        len(said) == 1
        and said[0].startswith("MFU peak revised: the run reached 0.2")
        and "(0.099)" in said[0]
    )
    assert end.scalars["mfu"] == pytest.approx(end.scalars["tokens_per_sec"] * 0.5e9 / 2 / quiet)
    # the run beats even the new measurement: the peak is at least what the run reached
    beaten = Peak(0.1e12, "measured", sample=lambda seconds: 0.2e12)
    beaten.revise(0.25e12)
    assert beaten.value == 0.25e12
    sheet = Peak(989e12, "data sheet, NVIDIA H100")
    assert sheet.revise(1000e12) is None and sheet.value == 989e12


def test_the_metrics_writer_leaves_torch_unloaded_and_importable():
    """tensorboardX imports torch where it is installed (1.7 s of each run's start); the trainer's
    writer does without it, and torch imports as usual afterwards."""
    pytest.importorskip("torch")
    probe = (
        "import sys; import tunix_train.observe.metrics as m; loaded = 'torch' in sys.modules; "
        "import torch; print(loaded, m.SummaryWriter.__module__, torch.ones(2).sum().item())"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "tensorboardX.writer", "2.0"]
