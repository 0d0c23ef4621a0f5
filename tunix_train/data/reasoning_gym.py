"""data.source=reasoning_gym: reasoning-gym's procedural tasks as records, generated from a seed
(the same prompts on every run and every host), each {prompt, completion, answer, entry}: the
question, its answer (completion: for supervised fine-tuning on it), and the task's own record
as JSON, which its verifier reads (rewards/verified.reasoning_gym)."""

from __future__ import annotations

import json
from typing import Any

from tunix_train.config import ConfigError, ReasoningGymConfig

EVAL_SEED_OFFSET = 1_000_003  # held-out prompts come from seed + this (a prime: no nearby run's seed)


def documents(cfg: ReasoningGymConfig, held_out: bool) -> list[dict[str, Any]]:
    """Each task's size (or eval_size) records, the tasks interleaved in their order."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            "data.source=reasoning_gym needs reasoning-gym: pip install -e '.[tasks]'"
        ) from None
    size, seed = (cfg.eval_size, cfg.seed + EVAL_SEED_OFFSET) if held_out else (cfg.size, cfg.seed)
    per_task = []
    for name in cfg.tasks:
        settings = dict(cfg.settings.get(name) or {})
        try:
            dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **settings)
        except (KeyError, ValueError, TypeError, AssertionError) as err:
            detail = " ".join(str(err).split())[:200]
            raise ConfigError(
                f"data.reasoning_gym: reasoning-gym cannot make the task {name!r} with settings {settings} "
                f"({type(err).__name__}: {detail})"
            ) from None
        per_task.append([_record(entry) for entry in dataset])
    return [records[i] for i in range(size) for records in per_task]


def _record(entry: dict) -> dict[str, Any]:
    answer = str(entry["answer"])
    return {
        "prompt": entry["question"],
        "completion": answer,
        "answer": answer,
        "entry": json.dumps(entry, default=str),
    }
