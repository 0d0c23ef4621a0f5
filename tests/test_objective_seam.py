"""An objective defined here, in the test alone, that reads a second model: the KL from a frozen,
smaller teacher to the trained model, over the whole vocabulary, through Forward.per_token's
chunks. Its loss on fsdp2 x tp2 equals a dense numpy computation, and no array of the compiled
step is as large as one [tokens, vocab] (the same step without chunks has one: the check can fail)."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from conftest import config
from flax import nnx

from tunix_train.model.factory import model_structure
from tunix_train.sharding import to_global_batch
from tunix_train.train.objectives.base import ExtraModel
from tunix_train.train.objectives.lm import LanguageModeling
from tunix_train.train.setup import setup
from tunix_train.train.step import abstract_batch

V, T, ROWS = 8192, 256, 8  # rows per step over fsdp=2: 4 per device
TEACHER = dict(num_layers=1, embed_dim=32, hidden_dim=64, num_heads=2, num_kv_heads=1, head_dim=16)


def kl_per_token(student_logits, teacher_logits):
    """KL(teacher || student) of each position's next-token distribution, over the whole vocabulary."""
    teacher_logp = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    student_logp = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1)


class Distill(LanguageModeling):
    """Token-mean KL from the teacher, over the masked tokens."""

    def extra_models(self):
        teacher = dataclasses.replace(self.cfg.model, name="teacher", **TEACHER)
        return {"teacher": ExtraModel(teacher, seed=7)}

    def loss(self, policy, reference, micro, weight, models):
        kl = policy.per_token(kl_per_token, models["teacher"])
        return jnp.sum(kl * micro["loss_mask"]) / weight, {}


def _run(chunk: int):
    cfg = config(
        f"model.vocab_size={V}",
        f"data.seq_len={T}",
        f"training.micro_batch_size={ROWS // 2}",
        f"training.loss_chunk_size={chunk}",
        'model.mesh_shape=[[2,2],["fsdp","tp"]]',
    )
    return cfg, setup(cfg, jax.devices()[:4], objective=Distill(cfg))


def _numpy_logits(model_cfg, params, micro):
    model = nnx.merge(model_structure(model_cfg), jax.tree.map(np.asarray, params))
    return np.asarray(model(micro["inputs"][0], micro["positions"][0], micro["segment_ids"][0]), np.float64)


def test_a_teacher_kl_through_chunks_equals_numpy_and_holds_no_tokens_by_vocab_array():
    cfg, run = _run(chunk=16)
    from tunix_train.data.synthetic import SyntheticBatches

    data = SyntheticBatches(seq_len=T, vocab_size=V, accumulation_steps=1, global_micro_batch=ROWS, seed=0)
    host = next(data)
    with jax.set_mesh(run.mesh):
        state = run.plan.create()
        params = jax.tree.map(np.asarray, state.params)
        teacher = run.step_fn.extras.params()["teacher"]
        _, metrics = run.step_fn(state, to_global_batch(host, run.mesh))
    student_logits = _numpy_logits(cfg.model, params, host)
    teacher_cfg = run.step_fn.extras.specs["teacher"].model
    teacher_logits = _numpy_logits(teacher_cfg, teacher, host)
    assert teacher_cfg.num_layers == 1 and teacher_logits.shape == student_logits.shape

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    t, s = log_softmax(teacher_logits), log_softmax(student_logits)
    kl = (np.exp(t) * (t - s)).sum(-1)
    mask = host["loss_mask"][0]
    expected = (kl * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)

    # a [tokens, vocab] array of one device: its rows' tokens by the vocabulary's tp shard
    one_array = (ROWS // 2) * T * (V // 2)

    def largest_array(run):
        """The most elements of any array the compiled step (per device) computes."""
        with jax.set_mesh(run.mesh):
            batch = abstract_batch(run.mesh, 1, ROWS, T, run.objective.batch_dtypes)
            hlo = run.step_fn.lower(run.plan.abstract, batch).compile().as_text()
        shapes = re.findall(r"\b(?:f32|bf16|f16)\[([\d,]+)\]", hlo)
        return max(math.prod(int(n) for n in shape.split(",")) for shape in shapes)

    chunked, whole = largest_array(run), largest_array(_run(chunk=0)[1])
    print(f"largest array per device: chunked {chunked:,}, whole {whole:,}; [tokens, vocab] {one_array:,}")
    assert chunked < one_array <= whole, (chunked, one_array, whole)
