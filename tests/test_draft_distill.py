"""The draft's distillation toward the policy on a rollout (train/draft_distill.py, a spike not
yet wired into the rollout): its loss and one Adam step equal a direct transcription over the
whole batch, and repeated steps lower the divergence."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import config
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
