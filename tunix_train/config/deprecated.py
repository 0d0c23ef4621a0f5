"""Keys that moved or went, in one place: command-line overrides that still use them are rewritten
to their new keys with a one-line notice each (`rewritten`), and a config saved by an earlier
version (a run directory's .hydra/config.yaml) is read as this version's (`upgraded`), so that the
run resumes.

Since the objectives were named (2026-12): an algorithm is training.objective's value, not
training.grpo.advantage, training.grpo.policy_loss or training.dpo.loss; what the on-policy
objectives sample moved from training.grpo to training.rollout; RLOO's normalize_advantages to
training.rloo. The experts' model keys (model.num_experts, ...) moved to model.moe, and what only
Gemma 4 has (model.global_head_dim, ...) to model.gemma4. The old keys work for one release.
"""

from __future__ import annotations

import copy
import sys

from tunix_train.config.fields import ConfigError
from tunix_train.config.objectives import AdvantageEstimator, Objective, PolicyLoss, PreferenceLoss

_TO_ROLLOUT = (
    "num_generations max_new_tokens temperature max_staleness iterations routing_replay reward "
    "reward_timeout_s reward_models reward_weights missing_eos_penalty overlong overlong_buffer "
    "dynamic_sampling dynamic_sampling_rounds tools environment max_turns tool_timeout_s max_tool_calls "
    "max_tool_result_tokens tool_processes eval_samples eval_k eval_pass_reward"
).split()
_TO_MOE = {  # the experts' flat model keys -> their names in model.moe
    "num_experts": "experts",
    "num_experts_per_token": "experts_per_token",
    "moe_hidden_dim": "hidden_dim",
    "moe_router": "router",
    "moe_norm_topk_prob": "norm_topk_prob",
    "dense_mlp": "dense_mlp",
    "moe_dispatch": "dispatch",
    "moe_capacity_factor": "capacity_factor",
}
_TO_GEMMA4 = (  # Gemma 4's flat model keys, the same names in model.gemma4
    "global_head_dim num_global_kv_heads attention_k_eq_v rope_partial_factor_global use_v_norm "
    "num_kv_shared_layers double_wide_mlp per_layer_input_dim per_layer_input_vocab_size use_layer_scalar"
).split()
MOVED = {
    **{f"training.grpo.{name}": f"training.rollout.{name}" for name in _TO_ROLLOUT},
    "training.grpo.rollout_mesh_shape": "training.rollout.mesh_shape",
    "training.grpo.rollout_slots": "training.rollout.slots",
    "training.grpo.rollout_dtype": "training.rollout.dtype",
    "training.grpo.normalize_advantages": "training.rloo.normalize_advantages",
    **{f"model.{old}": f"model.moe.{new}" for old, new in _TO_MOE.items()},
    **{f"model.{name}": f"model.gemma4.{name}" for name in _TO_GEMMA4},
}

# the keys that chose an algorithm: each value -> the objective it names now
_NAMED_BY = {
    "training.grpo.advantage": {
        "grpo": "grpo",
        "rloo": "rloo",
        "reinforce_pp": "reinforce_pp",  # with training.reinforce_pp.baseline=false
        "reinforce_pp_baseline": "reinforce_pp",
        "distill": "distill_on_policy",
        "gkd": "gkd",
        "gae": "ppo",
    },
    "training.grpo.policy_loss": {"clip": "grpo", "cispo": "cispo"},
    "training.dpo.loss": {"sigmoid": "dpo", "ipo": "ipo", "orpo": "orpo", "simpo": "simpo"},
}
_DEFAULT_OF = {
    "training.grpo.advantage": "grpo",
    "training.grpo.policy_loss": "grpo",
    "training.dpo.loss": "dpo",
}


def _sets_otherwise(key: str, objective: Objective) -> bool:
    """Whether `objective`'s name fixes `key` to another value than its default (its preset set it)."""
    return {
        "training.grpo.advantage": objective.advantage not in (None, AdvantageEstimator.grpo),
        "training.grpo.policy_loss": objective.policy_loss is not PolicyLoss.clip,
        "training.dpo.loss": objective.preference_loss not in (None, PreferenceLoss.sigmoid),
    }[key]


def _notice(old: str, new: str) -> None:
    print(f"tunix_train: {old} is deprecated and will be removed: use {new}", file=sys.stderr)


def _parts(override: str) -> tuple[str, str, str]:
    """A hydra override -> (its prefix +, ++ or ~; its key; '=' and its value, or '')."""
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    key, eq, value = override[len(prefix) :].partition("=")
    return prefix, key, eq + value


def rewritten(overrides: list[str]) -> list[str]:
    """The overrides with every deprecated key replaced by its new one (a notice on stderr each); a
    key that chose the algorithm becomes training.objective's value. Conflicting choices are a
    ConfigError."""
    out, named = [], []
    for override in overrides:
        prefix, key, value = _parts(override)
        if key in MOVED:
            _notice(key, MOVED[key])
            out.append(f"{prefix}{MOVED[key]}{value}")
        elif key in _NAMED_BY:
            named.append((key, value[1:].strip("'\"")))
        else:
            out.append(override)
    return out + _objective_named(out, named)


def _objective_named(overrides: list[str], named: list[tuple[str, str]]) -> list[str]:
    """training.objective (and training.reinforce_pp.baseline) for the old keys that chose the
    algorithm, given the objective the other overrides choose (objective=X or training.objective=X)."""
    chosen = "lm"
    for override in overrides:
        _, key, value = _parts(override)
        if key in ("objective", "training.objective"):
            chosen = value[1:].strip("'\"")
    if chosen not in {o.value for o in Objective}:
        return []  # hydra names the bad objective
    current, wanted, extra = Objective(chosen), set(), []
    for key, value in named:
        if value not in _NAMED_BY[key]:
            raise ConfigError(f"{key}={value}: not one of {', '.join(_NAMED_BY[key])} (and deprecated)")
        name = _NAMED_BY[key][value]
        if current is not Objective.lm and (current.preference_loss is None) == (key == "training.dpo.loss"):
            _notice(f"{key}={value}", f"nothing: it has no effect under objective={chosen}")
            continue
        if name == _DEFAULT_OF[key] and not _sets_otherwise(key, current):
            name = chosen  # the default: the chosen objective's (objective=dapo training.grpo.advantage=grpo)
        kept = "policy_loss" if key == "training.grpo.advantage" else "advantage"
        if current.on_policy and getattr(Objective(name), kept) is not getattr(current, kept):
            raise ConfigError(
                f"{key}={value} under objective={chosen}: no objective has both that and objective="
                f"{chosen}'s {kept.replace('_', ' ')}; choose one objective="
            )
        _notice(f"{key}={value}", f"objective={name}")
        wanted.add(name)
        if (key, value) == ("training.grpo.advantage", "reinforce_pp"):
            extra.append("training.reinforce_pp.baseline=false")
    if len(wanted) > 1:
        raise ConfigError(
            f"{' and '.join(f'{k}={v}' for k, v in named)} name different objectives "
            f"({', '.join(sorted(wanted))}): set objective= alone"
        )
    if not wanted or wanted == {chosen}:
        return extra
    return [f"training.objective={wanted.pop()}", *extra]


# Keys that no longer exist, each with the one value a run could have had: a saved run's config
# holding them (.hydra/config.yaml) loads as before.
RETIRED_KEYS = {"training.lora.dropout": 0.0}  # was refused unless 0; adapters take no dropout


def _family_before_it_was_declared(model: dict) -> str:
    """The family of a model saved before model.family existed (every one a Gemma), from its flags."""
    if (
        model.get("use_v_norm")
        or model.get("use_layer_scalar")
        or model.get("norm_weight_offset", 1.0) != 1.0
    ):
        return "gemma4"
    if model.get("use_qk_norm"):
        return "gemma3"
    return "gemma2" if model.get("use_post_attn_norm") or model.get("use_post_ffw_norm") else "gemma"


def _objective_before_it_was_named(training: dict) -> None:
    """A saved training section from before the objectives were named, made this version's: the
    moved keys moved, the algorithm (objective=grpo or dpo with the key that chose it) named."""
    grpo, dpo = training.get("grpo"), training.get("dpo")
    if isinstance(grpo, dict):
        advantage, policy_loss = grpo.pop("advantage", "grpo"), grpo.pop("policy_loss", "clip")
        if training.get("objective") == "grpo":
            named = _NAMED_BY["training.grpo.advantage"][advantage]
            training["objective"] = "cispo" if policy_loss == "cispo" else named
            if advantage == "reinforce_pp":
                training.setdefault("reinforce_pp", {})["baseline"] = False
    if isinstance(dpo, dict):
        loss = dpo.pop("loss", "sigmoid")
        if training.get("objective") == "dpo":
            training["objective"] = _NAMED_BY["training.dpo.loss"][loss]


def _moved(saved: dict) -> None:
    """Each MOVED key that `saved` holds, moved to its new place."""
    for old, new in MOVED.items():
        *path, last = old.split(".")
        node = saved
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            value = node.pop(last)
            *path, last = new.split(".")
            node = saved
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value


def upgraded(saved: dict) -> dict:
    """A saved config (nested dicts) as this version reads it: RETIRED_KEYS taken out, the MOVED
    keys moved, model.family where it was saved before the key existed, and the objective named
    (_objective_before_it_was_named)."""
    saved = copy.deepcopy(saved)
    model, training = saved.get("model"), saved.get("training")
    if isinstance(model, dict) and "family" not in model:  # read from keys that had not moved then
        model["family"] = _family_before_it_was_declared(model)
    _moved(saved)
    if isinstance(training, dict):
        _objective_before_it_was_named(training)
    for key, only_value in RETIRED_KEYS.items():
        *path, last = key.split(".")
        node = saved
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            if node[last] != only_value:
                raise ConfigError(
                    f"the saved config sets {key}={node[last]!r}, a key this version no longer has"
                )
            del node[last]
    return saved
