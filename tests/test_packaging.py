"""The package as `pip install .` leaves it: a wheel in a fresh virtual environment, run from a folder
that is not the checkout (its configs are package data, its commands are the [project.scripts])."""

import os
import shutil
import subprocess
import sys
import venv

import pytest
from conftest import REPO, cpu_env


@pytest.mark.slow
def test_a_wheel_installed_in_a_fresh_venv_trains_and_plans_from_another_folder(tmp_path):
    """The venv sees this environment's site-packages for the dependencies (jax, flax, ...: no
    download), and the wheel alone for tunix_train: the checkout is on no path of the commands."""
    # built from a copy of the checkout: a build/ folder left by an earlier build could add stale files
    source = tmp_path / "source"
    shutil.copytree(
        REPO, source, ignore=shutil.ignore_patterns(".git", "build", "outputs", "*.egg-info", "__pycache__")
    )
    pip_wheel = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        tmp_path / "dist",
    ]
    subprocess.run([*pip_wheel, source], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("tunix_train-*.whl")
    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=True)
    bin_dir = tmp_path / "venv" / "bin"
    subprocess.run(
        [bin_dir / "python", "-m", "pip", "install", "--no-deps", "--force-reinstall", wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in cpu_env(1).items() if k != "PYTHONPATH"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"

    def run(*args):
        return subprocess.run(args, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)

    where = run("python", "-c", "import tunix_train; print(tunix_train.__file__)")
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout + where.stderr
    trained = run("tunix-train", "training.max_steps=2", "hydra.run.dir=run")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert '"step": 2' in (elsewhere / "run" / "metrics.jsonl").read_text()
    planned = run("tunix-plan", "--help")
    assert planned.returncode == 0 and "--config-dir" in planned.stdout, planned.stderr
