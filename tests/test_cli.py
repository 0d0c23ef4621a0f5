"""run_training.py as users run it: the docs' command line, run output, and bad input."""

import json
import os
import struct
import subprocess
import sys

import jax
import pytest
from conftest import FAST_COMPILE, REPO, cpu_env, run_python, run_training
from tensorboardX.proto import event_pb2

from tunix_train import api

SMALL_MODEL = [
    "model.num_layers=2",
    "model.embed_dim=64",
    "model.hidden_dim=128",
    "model.num_heads=4",
    "model.head_dim=16",
    "model.vocab_size=4096",
    "data.seq_len=32",
]


def run_cli(*args, devices=4, cwd=REPO):
    return run_training(*args, devices=devices, cwd=cwd)


def read_tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Scalars from the TFRecord event files: [length u64][crc u32][event proto][crc u32]..."""
    scalars = {}
    for path in run_dir.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.mark.slow  # a whole CLI run or a script: the README's suite stays short
def test_the_docs_command_line_trains_and_writes_its_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        "model=gemma3_1b",
        'model.mesh_shape=[[4,1],["fsdp","tp"]]',
        "training.micro_batch_size=4",
        *SMALL_MODEL,
        "training.max_steps=4",
        "training.log_every=2",
        "training.eval_every=4",
        "training.eval_batches=1",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr
    log = (run_dir / "train.log").read_text()
    assert "mesh: Mesh(fsdp=4, tp=1) over 4 cpu devices" in log
    assert "global batch: 16 sequences" in log and "= 512 tokens" in log
    assert "tokenizer shakespeare_4k.model" in log
    assert "model: gemma3_1b" in log and " parameters" in log
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], sorted(m)) for m in metrics] == [
        (0, ["eval_loss", "eval_perplexity", "step"]),
        (
            2,
            [
                "grad_norm",
                "learning_rate",
                "loss",
                "mfu",
                "nonfinite_steps",
                "pad_fraction",
                "step",
                "step_time_s",
                "tokens_per_sec",
            ],
        ),
        (
            4,
            [
                "eval_loss",
                "eval_perplexity",
                "grad_norm",
                "learning_rate",
                "loss",
                "mfu",
                "nonfinite_steps",
                "pad_fraction",
                "step",
                "step_time_s",
                "tokens_per_sec",
            ],
        ),
    ]
    assert all(m["tokens_per_sec"] > 0 and m["step_time_s"] > 0 and 0 < m["mfu"] < 1 for m in metrics[1:])
    assert "MFU basis:" in log and "(measured fp32 matmul on cpu)" in log
    scalars = read_tensorboard_scalars(run_dir)
    for name in (
        "loss",
        "learning_rate",
        "grad_norm",
        "step_time_s",
        "tokens_per_sec",
        "mfu",
        "eval_loss",
        "eval_perplexity",
    ):
        assert scalars[name] == [(m["step"], pytest.approx(m[name], rel=1e-6)) for m in metrics if name in m]
    saved = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "name: gemma3_1b" in saved and "num_layers: 2" in saved


@pytest.mark.slow  # a whole CLI run or a script: the README's suite stays short
def test_default_run_directory_is_outputs_experiment_date_time(tmp_path):
    result = run_cli(
        "model=gemma3_tiny",
        "data=synthetic",
        "data.seq_len=16",
        "training.max_steps=1",
        devices=1,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    (run_dir,) = tmp_path.glob("outputs/default/*-*-*/*-*-*")
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "train.log").exists()


BAD_CONFIG = [
    (
        ['model.mesh_shape=[[4,4],["fsdp","tp"]]'],
        "model.mesh_shape: mesh {'fsdp': 4, 'tp': 4} has 16 devices but 4",
    ),
    (['model.mesh_shape=[[4],["xp"]]'], "unknown mesh axis 'xp'"),
    (
        ['model.mesh_shape=[[4],["pp"]]', "training.pipeline_microbatches=4"],
        "pp=4 is more than model.num_layers=2",
    ),
    (
        ['model.mesh_shape=[[4],["cp"]]', "data.seq_len=36", "training.loss_chunk_size=0"],
        "data.seq_len=36 must be divisible by 2 x cp = 8",
    ),
    (
        ['model.mesh_shape=[[1,4],["fsdp","tp"]]', "model.num_heads=6"],
        "model.num_heads=6 is not divisible by the tp",
    ),
    (["model.foo=1"], "unknown config key 'model.foo'"),
    (["training.max_steps=abc"], "config key 'training.max_steps'"),
    (["training.mixed_precision=fp16"], "config key 'training.mixed_precision'"),
    (["model=gemma9"], "model/gemma9"),
]
VOCAB = "model.vocab_size=4096"  # holds the bundled tokenizer
BAD_DATA = [  # {tmp} is the test's directory, holding the files written below
    (
        ["data=text", "data.train_files=[{tmp}/missing.txt]", VOCAB],
        "data.train_files: no file matches '{tmp}/missing.txt'",
    ),
    (
        ["data=text", "data.train_files=[{tmp}/empty.txt]", VOCAB],
        "data.train_files: {tmp}/empty.txt is empty",
    ),
    (
        ["data=jsonl", "data.train_files=[{tmp}/docs.jsonl]", "data.text_field=body", VOCAB],
        "{tmp}/docs.jsonl:2: no string field 'body' (data.text_field)",
    ),
    (
        [
            "data=jsonl",
            "data.train_files=[{tmp}/docs.jsonl]",
            "data.prompt_field=question",
            "data.completion_field=answer",
            VOCAB,
        ],
        "{tmp}/docs.jsonl:1: no string field 'question' (data.prompt_field)",
    ),
    (
        ["data=chat", "data.train_files=[{tmp}/docs.jsonl]", VOCAB],
        "{tmp}/docs.jsonl:1: 'messages' must be a non-empty list of {role, content} objects",
    ),
    (["data=chat", "data.train_files=[{tmp}/chat.jsonl]", VOCAB], "{tmp}/chat.jsonl:2: unknown role 'robot'"),
    (
        ["data=chat", "data.train_files=[{tmp}/long.jsonl]", "data.eval_fraction=0", VOCAB],
        "{tmp}/long.jsonl:1: a conversation of ",
    ),
    (
        [
            "data=chat",
            "data.train_files=[{tmp}/long.jsonl]",
            "data.chat_template={tmp}/raise.jinja",
            "data.eval_fraction=0",
            VOCAB,
        ],
        "{tmp}/raise.jinja fails on a conversation: no system turns here",
    ),
    (
        ["data=chat", "data.train_files=[{tmp}/long.jsonl]", "data.train_on_roles=[model]", VOCAB],
        "data.train_on_roles=['model'] must name some of system, user, assistant, tool",
    ),
    (
        ["data=parquet", "data.train_files=[{tmp}/bad.parquet]", VOCAB],
        "{tmp}/bad.parquet: cannot read it as Parquet",
    ),
    (
        ["data=jsonl", "data.hf_dataset={tmp}/missing", VOCAB],
        "data.hf_dataset: no such directory {tmp}/missing",
    ),
    (
        ["data=jsonl", "data.hf_dataset={tmp}", VOCAB],
        "data.hf_dataset: {tmp} is not a directory written by datasets",
    ),
    (
        ["data=jsonl", "data.hf_dataset={tmp}", "data.train_files=[{tmp}/docs.jsonl]", VOCAB],
        "data.hf_dataset is read instead of data.train_files",
    ),
    (["data=shakespeare", "model.vocab_size=256"], "data.tokenizer: "),  # a 4096-token tokenizer
    (
        ["data=shakespeare", VOCAB, "data.tokenizer={tmp}/missing.model"],
        "data.tokenizer: no such file {tmp}/missing.model",
    ),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIG + BAD_DATA)
def test_bad_input_exits_with_one_line_and_writes_nothing(tmp_path, overrides, message):
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "docs.jsonl").write_text('{"body": "one"}\n{"text": "two"}\n')

    def turn(role, text):
        return {"role": role, "content": text}

    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"messages": [turn("user", "Hi")]})
        + "\n"
        + json.dumps({"messages": [turn("robot", "Hi")]})
        + "\n"
    )
    (tmp_path / "long.jsonl").write_text(json.dumps({"messages": [turn("user", "Speak. " * 200)]}) + "\n")
    (tmp_path / "raise.jinja").write_text("{{ raise_exception('no system turns here') }}")
    (tmp_path / "bad.parquet").write_text("not parquet")
    run_dir = tmp_path / "run"
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    data = [] if any(o.startswith("data=") for o in overrides) else ["data=synthetic"]
    result = run_cli("model=gemma3_tiny", *data, *overrides, f"hydra.run.dir={run_dir}")
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tunix_train: error:"), result.stderr
    assert message.replace("{tmp}", str(tmp_path)) in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert not run_dir.exists()


@pytest.mark.slow  # a whole CLI run or a script: the README's suite stays short
def test_out_of_memory_is_one_line_that_says_what_to_lower_and_damages_no_checkpoint(tmp_path):
    """A 65,536-token row makes attention's scores about 150 GiB: XLA's CPU client fails the allocation
    (RESOURCE_EXHAUSTED). The run resumes another run's checkpoint, which stays byte for byte."""
    tiny = [
        "model=gemma3_tiny",
        "data=synthetic",
        "training.micro_batch_size=1",
        'model.mesh_shape=[[1],["fsdp"]]',
    ]
    source = tmp_path / "source"
    assert (
        run_cli(
            *tiny, "data.seq_len=32", "training.max_steps=2", f"hydra.run.dir={source}", devices=1
        ).returncode
        == 0
    )
    files = {path: path.read_bytes() for path in (source / "checkpoints").rglob("*") if path.is_file()}
    assert any("/2/" in str(path) for path in files)

    run_dir = tmp_path / "huge"
    result = run_cli(
        *tiny,
        "data.seq_len=65536",
        "training.max_steps=4",
        f"checkpoint.resume_from={source}",
        f"hydra.run.dir={run_dir}",
        devices=1,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr[-2000:]
    assert lines[0].startswith("tunix_train: error: out of host RAM; an allocation of ")
    assert "GiB of host RAM available; the compiled train step needs " in lines[0]
    assert lines[0].endswith(
        "to lower it, in this order: data.seq_len=32768 (shorter sequences); training.remat=full "
        "(recompute activations in the backward pass); more devices on the fsdp axis (parameters, "
        "gradients and optimizer state divide by it); a pp mesh axis (each stage holds num_layers / "
        "pp layers and their optimizer state; with training.pipeline_microbatches >= pp); a cp mesh "
        "axis (activations divide by it: the sequence is split across devices); "
        "training.mixed_precision=bf16 (activations in bfloat16)"
    )
    assert "started from checkpoint.resume_from" in (run_dir / "train.log").read_text()
    assert not any((run_dir / "checkpoints").iterdir())
    assert {
        path: path.read_bytes() for path in (source / "checkpoints").rglob("*") if path.is_file()
    } == files


def _run_on_a_terminal(*args) -> str:
    """The CLI's output when stdout is a terminal (a pseudo-terminal here)."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "run_training.py"), *args],
        env=cpu_env(1),
        stdout=follower,
        stderr=subprocess.DEVNULL,
    )
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=300) == 0
    return out.decode()


@pytest.mark.slow
def test_progress_is_plain_lines_in_logs_and_a_live_line_on_a_terminal(tmp_path):
    args = [
        "model=gemma3_tiny",
        "data=synthetic",
        "data.seq_len=16",
        "training.max_steps=6",
        "training.log_every=2",
        "training.eval_every=0",
    ]
    result = run_cli(*args, f"hydra.run.dir={tmp_path / 'plain'}", devices=1)
    assert result.returncode == 0, result.stderr
    steps = [line for line in result.stdout.splitlines() if "/6  loss" in line]
    assert len(steps) == 3 and "\r" not in result.stdout  # one readable line per logging interval
    for line in steps:
        assert all(part in line for part in ("loss ", "tokens/s", "MFU ", "ETA "))
    live = _run_on_a_terminal(*args, f"hydra.run.dir={tmp_path / 'live'}")
    assert live.count("\r\x1b[K") == 3 and "step 6/6" in live  # rewritten in place
    assert (tmp_path / "live" / "train.log").read_text().count("/6  loss") == 3  # the file keeps every line


@pytest.mark.slow
def test_generate_cli_streams_the_continuation_and_rejects_bad_requests(tmp_path):
    run_dir = tmp_path / "run"
    trained = run_cli(
        "model=gemma3_1b",
        *SMALL_MODEL,
        "training.max_steps=2",
        'model.mesh_shape=[[1],["fsdp"]]',
        f"hydra.run.dir={run_dir}",
        devices=1,
    )
    assert trained.returncode == 0, trained.stderr[-2000:]

    def generate(*args, devices=1, env=None):
        return run_python("-m", "tunix_train.generate", run_dir, *args, devices=devices, env=env)

    prompt = "To be, or not"
    # no device count in XLA_FLAGS: --mesh_shape gives the process its 4 fake devices before JAX starts
    env = {**cpu_env(1), "XLA_FLAGS": FAST_COMPILE}
    on_4 = ["--mesh_shape", '[[2,2],["fsdp","tp"]]']
    result = generate("--prompt", prompt, "--max_new_tokens", "12", *on_4, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    model = api.load(run_dir, mesh_shape=[[1], ["fsdp"]], devices=jax.devices()[:1])
    expected = model.generate_text([prompt], max_new_tokens=12)[0]
    assert len(expected) > 0 and result.stdout == prompt + expected + "\n"
    for speculation, kw in (
        (["--draft", str(run_dir)], {}),
        (["--prompt_lookup", "3", "--speculative_tokens", "6"], {}),
        (["--draft", str(run_dir), "--adaptive_speculation"], {}),
        (["--draft", str(run_dir), "--draft_mesh_shape", '[[4],["dp"]]', *on_4], {"env": env}),
    ):
        result = generate("--prompt", prompt, "--max_new_tokens", "12", *speculation, **kw)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout == prompt + expected + "\n"  # greedy: the same tokens
        assert "speculative decoding accepted" in result.stderr.strip().splitlines()[-1]

    for args, message in (
        (["--max_new_tokens", "0"], "max_new_tokens=0 must be positive"),
        (["--temperature", "1", "--top_p", "1.5"], "top_p=1.5 must be in (0, 1]"),
    ):
        result = generate("--prompt", prompt, *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"tunix_train.generate: error: {message}"), lines
