"""The Kubernetes manifest (scripts/k8s/): rendered for 4 pods of 8 GPUs and checked field by field
against what Kubernetes and tunix_train need (there is no cluster here)."""

import importlib.util

import pytest
import yaml
from conftest import REPO, run_python

from tunix_train import exit_codes
from tunix_train.compose import load_config

spec = importlib.util.spec_from_file_location("render", REPO / "scripts" / "k8s" / "render.py")
render = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render)

OVERRIDES = ["model=gemma3_4b", 'model.mesh_shape=[[4,8],["fsdp","tp"]]', "training.micro_batch_size=1"]


@pytest.fixture(scope="module")
def manifest():
    out = run_python(
        str(REPO / "scripts" / "k8s" / "render.py"),
        "--name=gemma-ft",
        "--workers=4",
        "--gpus_per_pod=8",
        "--image=registry.example/tunix-train:1",
        *OVERRIDES,
        check=True,
    ).stdout
    return list(yaml.safe_load_all(out))


def test_the_manifest_renders_for_4_pods_of_8_gpus(manifest):
    service, job = manifest
    assert (service["apiVersion"], service["kind"], job["apiVersion"], job["kind"]) == (
        "v1",
        "Service",
        "batch/v1",
        "Job",
    )
    name = job["metadata"]["name"]
    pod = job["spec"]["template"]
    [container] = pod["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    # a headless service selecting the job's pods, which live in its DNS subdomain
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    # one pod per rank, all at once; pod 0 (hostname NAME-0) is the coordinator
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    assert env["MASTER_ADDR"]["value"] == f"{name}-0.{service['metadata']['name']}"
    assert env["WORLD_SIZE"]["value"] == "4"
    assert (
        env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    port = service["spec"]["ports"][0]["port"]
    assert env["MASTER_PORT"]["value"] == str(port) and container["ports"][0]["containerPort"] == port
    assert "LOCAL_RANK" not in env  # it would pin the process to one of its 8 GPUs
    # Kubernetes wants strings
    assert all(isinstance(e["value"], str) for e in container["env"] if "value" in e)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    # restarts: the run directory on the shared volume; the launchers' exit codes decide
    assert container["command"] == ["python", "run_training.py"]
    assert container["args"][-1] == "hydra.run.dir=/runs/gemma-ft"
    mount = next(
        m for m in container["volumeMounts"] if container["args"][-1].split("=")[1].startswith(m["mountPath"])
    )
    assert next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])["persistentVolumeClaim"][
        "claimName"
    ]
    assert pod["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    rules = job["spec"]["podFailurePolicy"]["rules"]
    by_code = {code: r["action"] for r in rules if "onExitCodes" in r for code in r["onExitCodes"]["values"]}
    assert all(
        r["onExitCodes"]["containerName"] == container["name"] and r["onExitCodes"]["operator"] == "In"
        for r in rules
        if "onExitCodes" in r
    )
    assert by_code == {
        exit_codes.CONFIG_ERROR: "FailJob",
        exit_codes.NON_FINITE: "FailJob",
        exit_codes.PREEMPTED: "Ignore",
    }
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules
    assert job["spec"]["backoffLimit"] == 4 * 3  # every pod fails once per restart; 3 restarts
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 30
    # the pods' arguments are a valid config
    load_config(container["args"][:-1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "Gemma_FT"}, "a DNS label"),
        ({"workers": 0}, "--workers >= 1"),
        ({"overrides": ["hydra.run.dir=/elsewhere"]}, "hydra.run.dir is set by the manifest"),
    ],
)
def test_bad_input_to_the_renderer(kwargs, message):
    args = {"name": "gemma-ft", "workers": 4, "gpus_per_pod": 8, "image": "i", "overrides": []} | kwargs
    with pytest.raises(ValueError, match=message):
        render.render(**args)
