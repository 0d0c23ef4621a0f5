"""Training objectives: what the train step minimizes, and the batches it needs.

An objective is a small object the step and the loop call through one interface, so neither
knows which one runs:

- `batch_dtypes`: the fields of its batches, each [A, B, T] (A accumulation steps of B rows of T
  positions): a dtype, or (dtype, shape) for a field with more axes after T (GRPO's routes);
- `weight(batch)`: the whole batch's normalizer (tokens, pairs, ...), or a dict of them for a loss
  with terms of different means (ORPO). Each micro-batch's loss is divided by it, so accumulated
  micro-batches give exactly the full batch's loss and gradient;
- `loss(policy, reference, micro, weight)`: the micro-batch's loss and metrics, both already
  divided by `weight` (so they add up over micro-batches; a metric named `..._max` is a maximum
  instead). `policy` and `reference` are Forwards (train/forward.py) of the trained model and of
  the frozen reference (no gradient) on the micro-batch: `policy()` is the per-token negative
  log-likelihood of `micro["targets"]` [B, T], `policy.hidden()` the final hidden states,
  `policy.per_token(fn, *others)` any per-token function of the logits of several models,
  computed in chunks; their logits are divided by `temperature`. Only what is asked is computed;
- `extra_models()`: the frozen models the loss reads beside them (objectives/base.ExtraModel: a
  teacher of another size from its checkpoint, ...), each sharded on the run's mesh in its own
  dtype; loss() then also gets `models`, a Forward of each by name;
- `updates(batch)`: whether the batch may update the weights (GRPO's dynamic sampling: not one
  without signal);
- `needs_reference`: whether it reads the reference model (model/weights.py keeps one);
- `metric_names`: what its loss reports beside the loss; `perplexity`: whether exp(eval loss) is one;
- `record_fields`: the JSON-lines fields every record must hold (None: the data config's);
- `read(data)`: reads what it needs of the data (tokenizes, checks) before any device work;
- `train_batches(data, global_rows, rows)` / `eval_batches(...)`: host batches, checkpointable;
- `connect(link)`: what it needs of the run once set up, from a train/setup.Connection (the
  meshes, the program, the scoring pass, where samples go; GRPO: its engine);
- `prepare(batches, state)`: the next step's batch from the host batches (GRPO samples and scores
  here, and may reuse a batch or draw ahead);
- `hooks()`: hooks it adds to the loop (GRPO: the rollout's rewards in the log);
- `score(policy, reference, micro)`: with `scores` true, per-token figures the run's scoring pass
  (`Setup.score_fn`, without gradient) computes of a batch before the steps that train on it
  (PPO's critic values);
- `skips_empty_micro_batches`: whether its batches may end in micro-batches without a sequence
  (GRPO's packed rollouts), which the step and the scoring pass then skip by a cond.
"""

from __future__ import annotations

import functools
from typing import Callable

from tunix_train.config import Config
from tunix_train.config import Objective as Kind
from tunix_train.train.objectives import distill, dpo, gkd, grpo, kto, lm, ppo, reward
from tunix_train.train.objectives.base import Objective

__all__ = ["ALGORITHMS", "Objective", "make_objective"]

# The on-policy objectives' parts beside the defaults (grpo.OnPolicy: the rollout's Sampler, the
# advantage FromRewards by the name's registered estimator, the ClippedSurrogate by the name's
# policy loss)
ON_POLICY_PARTS = {
    Kind.ppo: dict(advantage=ppo.Critic, loss=ppo.WithValueLoss),
    Kind.gkd: dict(sampler=gkd.GkdSampler, loss=gkd.TeacherDivergence),
}
# training.objective -> what builds its objective from the config
ALGORITHMS: dict[Kind, Callable[[Config], Objective]] = {
    Kind.lm: lm.LanguageModeling,
    **dict.fromkeys((Kind.dpo, Kind.ipo, Kind.orpo, Kind.simpo), dpo.DirectPreference),
    Kind.kto: kto.KahnemanTversky,
    Kind.reward: reward.RewardModeling,
    Kind.distill: distill.Distillation,
    **{
        kind: functools.partial(grpo.OnPolicy, **ON_POLICY_PARTS.get(kind, {}))
        for kind in Kind
        if kind.on_policy
    },
}


def make_objective(cfg: Config, tokenizer=None):
    """The objective training.objective names."""
    return ALGORITHMS[cfg.training.objective](cfg)
