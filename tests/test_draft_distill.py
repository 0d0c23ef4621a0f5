"""The draft's distillation toward the policy (train/draft_distill.py): its loss and one Adam step
equal a direct transcription over the whole batch and steps lower the divergence; GRPO distills
its draft and a resumed run continues with the saved one; bad settings are one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import config, rl_config
from flax import nnx

from tunix_train.generate import Engine, Tuning
from tunix_train.generate.speculative import Speculation
from tunix_train.sharding import make_mesh
from tunix_train.train.draft_distill import DraftDistiller, completion_rows
from tunix_train.train.init import plan_train_state
from tunix_train.train.optimizer import make_optimizer

POLICY = config("model.vocab_size=64").model
DRAFT = config("model.vocab_size=64", "model.num_layers=1").model


def _params(cfg, mesh, seed):
    return plan_train_state(cfg, make_optimizer(config().training)[0], mesh, seed=seed).create().params


def test_a_distillation_step_equals_the_direct_transcription_and_steps_lower_the_divergence():
    mesh = make_mesh([[1, 1], ["fsdp", "tp"]], jax.devices()[:1])
    policy, draft = _params(POLICY, mesh, 1), _params(DRAFT, mesh, 2)
    engine = Engine(POLICY, mesh, slots=4, tuning=Tuning(speculation=Speculation(tokens=3, draft=DRAFT)))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 64, n)) for n in (3, 5, 2, 6)]
    completions = [list(rng.integers(1, 64, n)) for n in (4, 2, 6, 1)]
    tokens, mask = completion_rows(prompts, completions, 10)
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0]  # from the last prompt token on
    assert mask[3].tolist() == [0] * 5 + [1] + [0] * 4

    def direct(params):
        s = jax.nn.log_softmax(nnx.merge(engine.draft.graphdef, params)(tokens), -1)
        t = jax.nn.log_softmax(nnx.merge(engine.graphdef, policy)(tokens), -1)
        return jnp.sum(jnp.sum(jnp.exp(t) * (t - s), -1) * mask) / mask.sum()

    value, grads = jax.value_and_grad(direct)(draft)
    optimizer = optax.adam(1e-2)
    updates, _ = optimizer.update(grads, optimizer.init(draft), draft)
    expected = optax.apply_updates(draft, updates)
    distiller = DraftDistiller(engine.draft.graphdef, engine.graphdef, draft, 1e-2)
    with jax.set_mesh(mesh):
        first = distiller.step(policy, tokens, mask)
        np.testing.assert_allclose(first, float(value), rtol=1e-5)
        for got, want in zip(jax.tree.leaves(distiller.params), jax.tree.leaves(expected)):
            np.testing.assert_allclose(got, want, atol=1e-5)
        later = [distiller.step(policy, tokens, mask) for _ in range(20)]
    assert later[-1] < 0.5 * first, (first, later)


@pytest.mark.slow  # four GRPO runs
def test_grpo_distills_its_draft_and_a_resumed_run_continues_with_the_saved_draft(tmp_path):
    """GRPO with draft_distill_every=1 logs each step's draft_divergence; stopped after step 2 and
    resumed, it logs the uninterrupted run's losses, acceptance and divergences bit for bit (the
    draft and its Adam state come back from the checkpoint), and the checkpoint holds the draft.
    The draft lives on a mesh of its own (draft_mesh_shape), where it is distilled and restored."""
    from conftest import assert_resumes_alike

    from tunix_train.train.loop import train

    reward = "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]"
    start = rl_config(
        tmp_path, reward, "training.micro_batch_size=8", "training.max_steps=1", "training.learning_rate=0"
    )
    start.model.mesh_shape = [[2], ["fsdp"]]
    train(start, tmp_path / "start", devices=jax.devices()[:2])
    cfg = rl_config(
        tmp_path,
        reward,
        "training.micro_batch_size=8",
        "training.rollout.num_generations=4",
        f"training.rollout.draft={tmp_path / 'start'}",
        "training.rollout.num_speculative_tokens=3",
        "training.rollout.draft_distill_every=1",
        "training.rollout.draft_learning_rate=3e-3",
        "training.rollout.draft_mesh_shape=[[2],[dp]]",  # the draft whole on each device
        "training.learning_rate=2e-2",
        "checkpoint.every_steps=2",
        "training.lr_schedule=constant",  # as in one run: the cosine's length is max_steps
    )
    cfg.model.mesh_shape = [[2], ["fsdp"]]
    keys = ("loss", "acceptance_rate", "draft_divergence")
    straight = assert_resumes_alike(cfg, tmp_path, 4, 2, jax.devices()[:2], keys=keys)
    assert (straight / "checkpoints" / "4" / "draft").is_dir()


def test_draft_distillation_without_a_draft_model_is_a_one_line_error(tmp_path):
    from tunix_train.config import ConfigError

    reward = "training.rollout.reward=[tunix_train.rewards.arithmetic:exact_match]"
    with pytest.raises(ConfigError, match="draft_distill_every needs training.rollout.draft"):
        rl_config(tmp_path, reward, "training.rollout.draft_distill_every=2")
    with pytest.raises(ConfigError, match="draft_distill_every needs training.rollout.draft"):
        rl_config(
            tmp_path, reward, "training.rollout.prompt_lookup=3", "training.rollout.draft_distill_every=2"
        )
    with pytest.raises(ConfigError, match="draft_learning_rate=0.0 positive"):
        rl_config(tmp_path, reward, "training.rollout.draft=x", "training.rollout.draft_learning_rate=0")
