"""Every test sees 8 fake CPU devices: XLA_FLAGS must be set before jax is first imported."""

import os

# The suite compiles far more than it runs. With LLVM at -O0 it takes 6.7 minutes instead of 9.1
# on a 2-core machine; XLA's HLO passes are the same, and losses agree with -O3's to float32
# rounding (the last bit or so). Runs that a test compares are all compiled at one level. A
# user's own level in XLA_FLAGS comes later, and wins.
FAST_COMPILE = "--xla_backend_optimization_level=0"
_USERS_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = f"{FAST_COMPILE} {_USERS_XLA_FLAGS} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

# The CLI subprocesses that tests start compile the same small programs again and again: a
# compilation cache shared by the session (inherited through the environment) saves that time
# for single-device runs. The trainer turns the cache off for collectives between CPU devices
# (tunix_train/platform.py: jaxlib 0.10.2 loses their order in a cached executable, and the
# devices deadlock), and so does this process, whose tests compile multi-device programs directly.
jax.config.update("jax_enable_compilation_cache", False)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # made by this session (xdist's workers inherit it)
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tunix_train_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def _reuse_identical_compilations(capacity: int = 64) -> None:
    """Tests train the same configuration again and again in one process (straight, stopped and
    resumed runs; every mesh against one device), and each run compiles its programs anew. This
    keeps the last `capacity` executables XLA built, keyed as JAX's compilation cache keys them
    (the module's text, the devices, the compile options), and hands an identical compilation the
    executable already built: in memory, never serialized (the on-disk cache is off above). The
    programs a test runs are the ones it compiles; only XLA's second build of one is skipped."""
    import collections
    import inspect
    import threading

    from jax._src import compiler

    build = getattr(compiler, "backend_compile_and_load", None)
    expected = ["backend", "module", "executable_devices", "options", "host_callbacks"]
    if build is None or list(inspect.signature(build).parameters) != expected:
        return  # another jax: compile everything
    built: collections.OrderedDict = collections.OrderedDict()
    lock = threading.Lock()

    def backend_compile_and_load(backend, module, executable_devices, options, host_callbacks):
        try:
            key = (
                backend.platform,
                str(module),
                tuple(d.id for d in executable_devices),
                options.SerializeAsString(),
            )
        except (AttributeError, TypeError):  # another jaxlib's objects: compile
            key = None
        if host_callbacks or key is None:
            return build(backend, module, executable_devices, options, host_callbacks)
        with lock:
            if key in built:
                built.move_to_end(key)
                return built[key]
        executable = build(backend, module, executable_devices, options, host_callbacks)
        with lock:
            built[key] = executable
            while len(built) > capacity:
                built.popitem(last=False)
        return executable

    compiler.backend_compile_and_load = backend_compile_and_load


if os.environ.get("TUNIX_TRAIN_TEST_REUSE_COMPILATIONS", "1") != "0":  # 0: compile every program anew
    _reuse_identical_compilations()


def _measure_the_cpu_peak_once() -> None:
    """On CPU every train() measures MFU's peak anew (a matmul compiled and sampled five times,
    0.3 s here), and the suite trains hundreds of times. A test process measures it once per
    dtype and hands each later run that figure, with the sampler that revises it."""
    from tunix_train.observe.mfu import Peak

    measure, measured = Peak.for_run.__func__, {}

    def for_run(cls, configured, dtype):
        if configured:
            return measure(cls, configured, dtype)
        if dtype not in measured:
            measured[dtype] = measure(cls, configured, dtype)
        first = measured[dtype]
        return cls(first.value, first.source, first._sample)

    Peak.for_run = classmethod(for_run)


_measure_the_cpu_peak_once()

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tunix_train.compose import load_config  # noqa: E402
from tunix_train.cpu_devices import cpu_devices_env  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


# The slow suite's longest tests (50 to 130 s each on 2 cores, --durations), handed out first: the
# workers take tests in collection order, and one of these last would keep one worker busy alone
# for a minute after the other has finished.
LONGEST = (
    "test_launch.py::test_a_killed_worker_restarts",
    "test_train.py::test_the_default_job_learns",
    "test_launch.py::test_ray_two_workers_give",
    "test_grpo.py::test_two_processes_sample_and_train",
    "test_checkpoint.py::test_kill_9_then_rerun",
    "test_grpo.py::test_groups_are_the_same_on_every_mesh",
    "test_checkpoint.py::test_sigterm_saves",
    "test_distill.py::test_a_student_learns_its_teacher_on_any_mesh",
    "test_cispo.py::test_twenty_steps_on_fsdp2_tp2",
    "test_gkd.py::test_on_policy_distillation_under_lora_resumes",
    "test_gkd.py::test_with_seq_kd_the_rollouts",
    "test_objective_seam.py::test_a_teacher_kl_through_chunks",
    "test_cli.py::test_generate_cli_streams",
    "test_families.py::test_the_toy_family_trains_on_fsdp2_tp2",
    "test_openenv.py::test_an_openenv_server_drives",
    "test_reasoning_gym.py::test_grpo_with_the_verifier_raises",
)


def _ids(name: str) -> frozenset:
    """The test ids listed in tests/NAME (one a line; # comments), without xdist's group; an id
    without parameters covers them all."""
    lines = (Path(__file__).parent / name).read_text().splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


# The tiers beyond the decorators: tests/slow_tests.txt (CI's second leg) and tests/long_tests.txt
# (run by hand, `python -m pytest -m long`), each saying why and what covers its tests elsewhere.
TIERS = {"long": _ids("long_tests.txt"), "slow": _ids("slow_tests.txt")}


def _test_id(item) -> str:
    """`file.py::name[params]`, without the folder and without xdist's `@group`."""
    return item.nodeid.removeprefix("tests/").split("@", 1)[0]


UNMATCHED = pytest.StashKey[dict]()  # tier -> the ids of whole files collected that name no test


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Marks the tests TIERS lists (tests/test_tiers.py checks that each id names a test); under
    pytest-xdist, LONGEST first (in a single process the order stays the files' own, so that each
    module's fixtures are made once)."""
    matched, collected = set(), set()
    for item in items:
        test_id = _test_id(item)
        collected.add(test_id.split("::", 1)[0])
        for tier, ids in TIERS.items():
            for listed in {test_id, test_id.split("[", 1)[0]} & ids:
                item.add_marker(getattr(pytest.mark, tier))
                matched.add(listed)
    if not any("::" in arg for arg in config.args):  # whole files were collected

        def checked(test_id):  # its file was collected whole, or is gone
            file = test_id.split("::", 1)[0]
            return file in collected or not (REPO / "tests" / file).exists()

        config.stash[UNMATCHED] = {
            tier: sorted(filter(checked, ids - matched)) for tier, ids in TIERS.items()
        }
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: not any(name in item.nodeid for name in LONGEST))


# The fast tier (the README's `python -m pytest`) stays under 8 minutes on 2 cores only if each of its
# tests stays cheap: one that takes longer than this (its call and its own set-up, in seconds; not
# fixtures shared with other tests) fails, saying so.
# TUNIX_TRAIN_FAST_TEST_BUDGET_S changes it (0: no budget, for a machine much slower than CI's).
FAST_TEST_BUDGET_S = float(os.environ.get("TUNIX_TRAIN_FAST_TEST_BUDGET_S", "30"))


def _tier(keywords) -> str:
    return "long" if "long" in keywords else "slow" if "slow" in keywords else "fast"


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Times the set-up of fixtures that several tests share (module or session scope): the first
    test to ask pays it, and the budget below leaves it out (the tier's total still counts it)."""
    import time

    start = time.perf_counter()
    yield
    if fixturedef.scope != "function":
        node = request.node
        item = node if isinstance(node, pytest.Item) else getattr(request, "_pyfuncitem", None)
        if item is not None:
            item.stash[_SHARED_S] = item.stash.get(_SHARED_S, 0.0) + time.perf_counter() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when == "setup":
        item.stash[_SETUP_S] = report.duration - item.stash.get(_SHARED_S, 0.0)
    elif report.when == "call" and report.passed and FAST_TEST_BUDGET_S and _tier(item.keywords) == "fast":
        took = item.stash.get(_SETUP_S, 0.0) + report.duration
        if took > FAST_TEST_BUDGET_S:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} took {took:.1f} s, over the fast tier's {FAST_TEST_BUDGET_S:.0f} s a test: "
                "make it cheaper or mark it @pytest.mark.slow"
            )


_SETUP_S, _SHARED_S = pytest.StashKey[float](), pytest.StashKey[float]()


def pytest_terminal_summary(terminalreporter):
    """The 15 slowest tests of each tier run (setup, call and teardown together)."""
    took: dict[str, dict[str, float]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                tier = took.setdefault(_tier(report.keywords), {})
                tier[report.nodeid] = tier.get(report.nodeid, 0.0) + report.duration
    for tier, tests in sorted(took.items()):
        slowest = sorted(tests.items(), key=lambda test: -test[1])[:15]
        terminalreporter.write_sep("=", f"the {len(slowest)} slowest of the {len(tests)} {tier} tests run")
        for nodeid, seconds in slowest:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"


def cpu_env(devices: int) -> dict:
    """The environment for a CLI subprocess on `devices` fake CPU devices."""
    return cpu_devices_env(devices, {**os.environ, "XLA_FLAGS": f"{FAST_COMPILE} {_USERS_XLA_FLAGS}"})


def _python(args, devices: int, env: dict | None) -> tuple[list[str], dict]:
    """The command `python ARGS...` and its environment: `env`, else `devices` fake CPU devices."""
    import sys

    return [sys.executable, *map(str, args)], cpu_env(devices) if env is None else env


def run_python(*args, devices: int = 1, env: dict | None = None, timeout: float = 300, **kwargs):
    """`python ARGS...` run from the repository on `devices` fake CPU devices (or in `env`), its
    output captured as text; kwargs go to subprocess.run (cwd, input, check)."""
    import subprocess

    kwargs.setdefault("cwd", REPO)
    command, env = _python(args, devices, env)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, **kwargs)


def start_python(*args, devices: int = 1, env: dict | None = None):
    """`python ARGS...` started from the repository as run_python runs it, its stdout and stderr
    read together from the returned Popen's stdout."""
    import subprocess

    command, env = _python(args, devices, env)
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def run_training(*overrides, **kwargs):
    """run_training.py with hydra `overrides`, as run_python runs it."""
    return run_python(REPO / "run_training.py", *overrides, **kwargs)


def users_env() -> dict:
    """The environment a user runs a script in: one CPU device, the compiler at its own level (the
    user's XLA_FLAGS, not the suite's)."""
    return {**os.environ, "XLA_FLAGS": _USERS_XLA_FLAGS}


def config(*overrides: str):
    """The composed, validated Config for the test-sized model plus `overrides`."""
    cfg, _ = load_config(["model=gemma3_tiny", "data=synthetic", "data.seq_len=32", *overrides])
    return cfg


def rl_config(tmp_path: Path, *overrides: str, objective: str = "grpo"):
    """config() for an RL `objective` over 64 prompts of the bundled arithmetic task (written under
    `tmp_path`): 16 tokens, 4 new ones, learning rate 1e-3, logged every step; `overrides` last."""
    from tunix_train.rewards.arithmetic import write_task

    prompts, _ = write_task(tmp_path / "task", count=64, seed=0)
    return config(*rl_overrides(prompts, objective), *overrides)


def rl_overrides(prompts: Path, objective: str = "grpo") -> list[str]:
    """rl_config's overrides beside the test-sized model, for the prompts file `prompts`."""
    return [
        "model.vocab_size=4096",
        f"objective={objective}",
        "data=jsonl",
        f"data.train_files=[{prompts}]",
        "data.seq_len=16",
        "training.log_every=1",
        "training.rollout.max_new_tokens=4",
        "training.learning_rate=1e-3",
    ]


def wait_until_gone(pids, timeout: float = 60.0) -> list[int]:
    """Waits (polling, up to a generous `timeout`) until none of the processes `pids` exists; returns
    those still alive at the deadline."""
    import subprocess
    import time

    deadline = time.monotonic() + timeout
    while True:
        alive = [
            int(p)
            for p in pids
            if subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode == 0
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if "loss" in m]


def synthetic_batches(cfg, micro_batch: int):
    """The synthetic data of a run of `cfg` with `micro_batch` rows a micro-batch, seed 0."""
    from tunix_train.data.synthetic import SyntheticBatches

    sizes = dict(seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size)
    return SyntheticBatches(**sizes, accumulation_steps=1, global_micro_batch=micro_batch, seed=0)


def checkpoint_arrays(step_dir: Path) -> dict:
    """A saved TrainState as host arrays by path, whatever topology wrote it."""
    import numpy as np
    import orbax.checkpoint as ocp

    path = (step_dir / "state").resolve()
    checkpointer = ocp.StandardCheckpointer()
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    metadata = checkpointer.metadata(path).item_metadata
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
    restored = checkpointer.restore(path, target)
    return {
        jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(restored)[0]
    }


def assert_same_parameters(run_a: Path, run_b: Path, step: int) -> None:
    """The parameters two run directories saved at `step` are equal, bit for bit."""
    import numpy as np

    a, b = (checkpoint_arrays(run / "checkpoints" / str(step)) for run in (run_a, run_b))
    params = [key for key in a if "params" in key]
    assert params and params == [key for key in b if "params" in key], (list(a), list(b))
    for key in params:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# LoRA on fsdp2 x tp2, saved every 2 steps, with a schedule that does not depend on max_steps (which
# changes between a stopped run and its resumption): for assert_resumes_bit_identically.
LORA_RESUMED = (
    'model.mesh_shape=[[2,2],["fsdp","tp"]]',
    "training.lora.rank=4",
    "training.learning_rate=3e-2",
    "training.lr_schedule=constant",
    "checkpoint.every_steps=2",
)


def assert_resumes_bit_identically(cfg, tmp_path: Path, keys: tuple[str, ...], devices) -> Path:
    """`cfg` trained 4 steps in one run, and stopped after 2 then resumed: the 4th step's parameters
    and the last 2 steps' logged `keys` are the same bit for bit (checkpoint.every_steps=2, and a
    schedule that does not depend on max_steps). The uninterrupted run's directory."""
    straight, resumed = straight_and_resumed(cfg, tmp_path, 4, 2, devices)
    assert_same_parameters(straight, resumed, 4)

    def logged(run_dir):
        return [tuple(m[key] for key in keys) for m in read_metrics(run_dir) if "loss" in m]

    assert len(logged(straight)) == 4 and logged(resumed)[-2:] == logged(straight)[-2:]
    return straight


def checkpoint_records(step_dir: Path) -> tuple[str, dict]:
    """A saved step's state metadata (orbax's _METADATA, as text) and its data record."""
    metadata = (step_dir / "state" / "_METADATA").read_text()
    return metadata, json.loads((step_dir / "data" / "metadata").read_text())


def assert_adapters_moved(step_dir: Path) -> None:
    """Every LoRA adapter's b half (zero at the start) saved at `step_dir` has moved from zero."""
    import numpy as np

    saved = checkpoint_arrays(step_dir)
    b_halves = [key for key in saved if "params" in key and "lora" in key and key.endswith("['b']['value']")]
    assert b_halves and all(np.abs(saved[key]).max() > 0 for key in b_halves), b_halves


def made_once(tmp_path_factory, name: str, make) -> Path:
    """A directory that make(directory) fills once per test session: the first worker process to
    ask makes it while the others wait, then all read it (a module-scoped fixture is made by every
    worker that runs one of its tests)."""
    import fcntl
    import shutil

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the workers' common folder
    directory, made = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            made.touch()
    return directory


def step_metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl that log a training step."""
    return [m for m in read_metrics(run_dir) if "loss" in m]


def assert_resumes_alike(cfg, tmp_path: Path, steps: int, stop_at: int, devices, keys=("loss",)) -> Path:
    """`cfg` trained `steps` steps in one run and in two (stopped after `stop_at`) logs the same
    `keys` at every step, bit for bit. The uninterrupted run's directory."""
    straight, resumed = straight_and_resumed(cfg, tmp_path, steps, stop_at, devices)
    for key in keys:
        assert [m[key] for m in step_metrics(resumed)] == [m[key] for m in step_metrics(straight)], key
    return straight


def straight_and_resumed(cfg, tmp_path: Path, steps: int, stop_at: int, devices) -> tuple[Path, Path]:
    """Run directories of `cfg` trained for `steps` steps in one run, and in two (stopped after
    `stop_at`, then resumed from the run directory's checkpoint)."""
    from tunix_train.train.loop import train

    for run_dir, stops in ((tmp_path / "straight", [steps]), (tmp_path / "resumed", [stop_at, steps])):
        for max_steps in stops:
            cfg.training.max_steps = max_steps
            train(cfg, run_dir, devices=devices)
    return tmp_path / "straight", tmp_path / "resumed"


def sharded_tower(tower, arrays: dict, mesh_shape):
    """`tower` (an image tower) with `arrays` (by dotted attribute path) set, split and placed on a
    mesh of `mesh_shape` over the first devices: (mesh, graphdef, state)."""
    import numpy as np
    from flax import nnx

    from tunix_train.sharding import make_mesh, state_shardings

    for path, array in arrays.items():
        variable = tower
        for name in path.split("."):
            variable = getattr(variable, name)
        variable[...] = array
    mesh = make_mesh(mesh_shape, jax.devices()[: np.prod(mesh_shape[0])])
    graphdef, state = nnx.split(tower)
    with jax.set_mesh(mesh):
        return mesh, graphdef, jax.device_put(state, state_shardings(state, mesh))


def image_loss_and_grads(cfg, batch, mesh_shape) -> tuple[float, dict]:
    """The summed cross-entropy of `batch`'s first micro-batch (images included) under cfg.model,
    initialized with seed 0, and its gradient as host arrays, on a mesh of `mesh_shape` (the rows
    reordered as the mesh's pp or cp layout wants them)."""
    import numpy as np
    from flax import nnx

    from tunix_train import parallel
    from tunix_train.model.common import output_logits
    from tunix_train.model.factory import build_model
    from tunix_train.sharding import make_mesh, state_shardings
    from tunix_train.train.forward import cross_entropy

    mesh = make_mesh(mesh_shape, jax.devices()[: np.prod(mesh_shape[0])])
    layout = parallel.for_run(mesh, cfg.model, cfg.training, cfg.data.seq_len)
    graphdef = parallel.model_graphdef(cfg.model, cfg.training.remat, parallel=layout)
    params = nnx.state(build_model(cfg.model, nnx.Rngs(0)))
    micro = jax.tree.map(lambda x: x[0], layout.reorder(batch) if layout else batch)

    def loss(params):
        m = nnx.merge(graphdef, params)
        x = m.hidden(micro["inputs"], micro["positions"], None, micro.get("token_index"), micro["images"])
        return cross_entropy(output_logits(x, m.output_table(), None), micro["targets"]).sum()

    with jax.set_mesh(mesh):
        params = jax.device_put(params, state_shardings(params, mesh))
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), jax.tree.map(np.asarray, grads)


def vision_tokenizer(directory, images=("<start_of_image>", "<end_of_image>", "<image_soft_token>")):
    """The bundled SentencePiece model with Gemma's turn tokens and the image tokens (boi, eoi,
    image: Gemma 3's by default) as pieces of their own (4096 to 4100, the image token last), and a
    tokenizer_config.json naming the image tokens as transformers' processors read them."""
    import json

    from tunix_train.data.tokenizer import bundled_with_pieces

    bundled_with_pieces(directory / "tokenizer.model", ("<start_of_turn>", "<end_of_turn>", *images))
    special = dict(zip(("boi_token", "eoi_token", "image_token"), images))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GemmaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": True,
                "extra_special_tokens": special,
            }
        )
    )
    return directory


def random_logits_and_labels(rows: int, positions: int, vocabulary: int, seed: int = 0):
    """Random logits of a policy and a reference [rows, positions, vocabulary] and labels (-100
    off each row's answer): a prompt of 2-3 positions, an answer of 2..7 tokens, padding."""
    import numpy as np

    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (rows, positions, vocabulary)).astype(np.float32)
    ref_logits = rng.normal(0, 2, (rows, positions, vocabulary)).astype(np.float32)
    labels = np.full((rows, positions), -100, np.int64)
    for row in range(rows):
        start, length = int(rng.integers(2, 4)), int(rng.integers(2, 8))
        labels[row, start : start + length] = rng.integers(0, vocabulary, length)
    return logits, ref_logits, labels


def losses_on_one_device_and_fsdp2_tp2(tmp_path: Path, *overrides: str, steps: int = 3) -> dict:
    """The logged losses of config(*overrides) trained `steps` steps on one device ("one") and on
    fsdp2 x tp2 ("fsdp2_tp2"), the same 8 rows a step (micro_batch_size counts the rows of one
    data-parallel shard)."""
    import numpy as np

    from tunix_train.train.loop import train

    runs = {}
    for name, mesh, n, rows in (
        ("one", '[[1],["fsdp"]]', 1, 8),
        ("fsdp2_tp2", '[[2,2],["fsdp","tp"]]', 4, 4),
    ):
        cfg = config(
            *overrides,
            f"model.mesh_shape={mesh}",
            f"training.micro_batch_size={rows}",
            f"training.max_steps={steps}",
            "training.log_every=1",
        )
        train(cfg, tmp_path / name, devices=jax.devices()[:n])
        runs[name] = np.array(train_losses(tmp_path / name))
    return runs


def token_nlls(labels, *logits):
    """The answer mask [rows, T - 1] of labels (-100 off it), and each logits' per-token negative
    log-likelihood of the labels shifted by one (logits at t predict the label at t + 1)."""
    import jax.numpy as jnp
    import numpy as np

    targets, mask = np.maximum(labels[:, 1:], 0), (labels[:, 1:] != -100).astype(np.float32)
    return mask, *(
        -np.take_along_axis(jax.nn.log_softmax(jnp.asarray(x[:, :-1]), axis=-1), targets[..., None], axis=-1)[
            ..., 0
        ]
        for x in logits
    )


def accumulated_loss(objective, nll_BT, ref_nll_BT, micro: dict, weight, accumulation: int):
    """objective.loss over `accumulation` equal micro-batches of the rows (micro: its fields by
    row), summed as the step sums them: (the loss, each metric)."""
    rows_in_all = len(nll_BT)
    total, metrics = 0.0, []
    for a in range(accumulation):
        rows = slice(a * rows_in_all // accumulation, (a + 1) * rows_in_all // accumulation)
        loss, m = objective.loss(
            lambda: nll_BT[rows], lambda: ref_nll_BT[rows], {k: v[rows] for k, v in micro.items()}, weight
        )
        total, metrics = total + float(loss), metrics + [m]
    return total, {k: sum(float(m[k]) for m in metrics) for k in metrics[0]}
