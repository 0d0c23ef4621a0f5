"""Benchmarks as everyone reports them: lm-evaluation-harness on a checkpoint (lm.py's model,
`python -m tunix_train.evaluate`), during training (training.eval_tasks) or against the server
(`lm_eval --model local-completions`, serve/tokens.py). Needs the `eval` extra."""

from __future__ import annotations

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
    from lm_eval.tasks import TaskManager

    from tunix_train.evaluate.lm import TunixLM

    manager = TaskManager(include_path=include_path)
    if unknown := [t for t in tasks if not manager.match_tasks([t]) and not t.endswith((".yaml", ".yml"))]:
        where = (
            f" (nor in {include_path})" if include_path else " (--include_path adds a folder of task YAMLs)"
        )
        raise ConfigError(f"lm-eval knows no task {unknown[0]!r}{where}")
    return lm_eval.simple_evaluate(
        model=TunixLM(model, **model_args),
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
    )


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
