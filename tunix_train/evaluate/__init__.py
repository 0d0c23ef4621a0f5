"""Benchmarks as everyone reports them: lm-evaluation-harness on a checkpoint (lm.py's model,
`python -m tunix_train.evaluate`), during training (training.eval_tasks) or against the server
(`lm_eval --model local-completions`, serve/tokens.py). Needs the `eval` extra."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

from tunix_train.config import ConfigError


def lm_eval_module():
    try:
        import lm_eval
    except ImportError:
        raise ConfigError("lm-eval is not installed: pip install -e '.[eval]'") from None
    return lm_eval


def run_tasks(
    model: Any,
    tasks: Sequence[str],
    include_path: Optional[str] = None,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    **model_args: Any,
) -> dict:
    """lm-eval's results of `tasks` (names, or YAML files) on `model` (a path api.load reads, or
    a LoadedModel), as simple_evaluate returns them; include_path: a folder of task YAMLs.
    model_args: lm.TunixLM's (mesh_shape, batch_size, max_length, add_bos_token, seed)."""
    lm_eval = lm_eval_module()
    from tunix_train.evaluate.lm import TunixLM

    manager = task_manager(tuple(tasks), include_path)
    return lm_eval.simple_evaluate(
        model=TunixLM(model, **model_args),
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
    )


@functools.lru_cache(maxsize=8)
def task_manager(tasks: tuple[str, ...], include_path: Optional[str]):
    """lm-eval's index of the tasks it can build, made once per process for these `tasks` (lm-eval
    reads its thousands of task YAMLs in about 15 s; training evaluates many times). The folder
    `include_path` alone where it holds every one of `tasks`, else with lm-eval's own tasks. A name
    neither knows is a ConfigError."""
    from lm_eval.tasks import TaskManager

    def knows(manager, task):
        return task.endswith((".yaml", ".yml")) or bool(manager.match_tasks([task]))

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(knows(own, t) for t in tasks):
            return own
    manager = TaskManager(include_path=include_path)
    if unknown := [t for t in tasks if not knows(manager, t)]:
        where = (
            f" (nor in {include_path})" if include_path else " (--include_path adds a folder of task YAMLs)"
        )
        raise ConfigError(f"lm-eval knows no task {unknown[0]!r}{where}")
    return manager


def logged_metrics(results: dict) -> dict[str, float]:
    """lm-eval's numbers as training logs them: eval_<task>_<metric> (its filter appended where it
    is not "none"), the standard errors left out."""
    out = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, kept = key.partition(",")
            if not kept or "_stderr" in metric or isinstance(value, (str, bool)) or value is None:
                continue
            out[f"eval_{task}_{metric}" + ("" if kept == "none" else f"_{kept}")] = float(value)
    return out


def headline(results: dict) -> dict:
    """lm-eval's results reduced to what JSON holds: {"results": {task: {metric: value}}, ...}."""

    def plain(value):
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, (str, int, bool)) or value is None:
            return value
        try:
            return float(value)
        except (TypeError, ValueError):
            return str(value)

    return plain({k: results[k] for k in ("results", "versions", "n-shot", "n-samples") if k in results})
