"""Accelerator paths checked without an accelerator: the train step (fsdp x tp, bf16; cuDNN's
flash attention for CUDA), the eval step and the engine's prefill, insert and decode are lowered for the
`cuda` and `tpu` platforms (jax.jit(...).trace(...).lower(lowering_platforms=...), what jax.export
does, without its serialization), here on the CPU. A lowering that only fails on a GPU
or TPU (a primitive with no rule there, a sharding the partitioner refuses, an attention kernel's
shape check) fails here first."""

import jax
import jax.numpy as jnp
import pytest
from conftest import config

from tunix_train import platform
from tunix_train.generate import Engine
from tunix_train.generate.batching import bucket
from tunix_train.generate.sampling import Draws, Kinds, Rules
from tunix_train.train.setup import setup
from tunix_train.train.step import abstract_batch

MESH = 'model.mesh_shape=[[4,2],["fsdp","tp"]]'


@pytest.fixture
def on_a_gpu(monkeypatch):
    """What jax asks of the machine before it lowers cuDNN attention, answered as an H100 with
    cuDNN 9.10 would (jax's private checks: there is no GPU here)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(platform, "validate_training_for_mesh", lambda training, mesh: None)


def _lowered(target: str, *overrides: str) -> dict[str, str]:
    """The StableHLO of the train and eval steps and the engine's prefill, insert and decode for `target`."""
    cfg = config(MESH, "training.mixed_precision=bf16", "training.micro_batch_size=2", *overrides)
    run = setup(cfg)
    t, seq = cfg.training, cfg.data.seq_len

    def lower(fn, *args, **kwargs):
        return fn.trace(*args, **kwargs).lower(lowering_platforms=(target,)).as_text()

    engine = Engine(cfg.model, run.mesh)
    params = run.plan.abstract.params
    prompt, rows, max_len = bucket(8), 8, 64

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    with jax.set_mesh(run.mesh):
        per_layer = jax.eval_shape(engine.unstack, params)
        entries, logits, _ = jax.eval_shape(
            lambda *a: engine._prefill_fn(*a, max_len=max_len),
            params,
            per_layer,
            i32(rows, prompt),
            i32(rows),
        )
        caches = entries  # a prefill of `rows` prompts has the layout of `rows` slots

        def two(dtype):
            return jax.ShapeDtypeStruct((2,), dtype)  # two requests inserted

        rules = Rules(
            jax.ShapeDtypeStruct((rows,), jnp.float32), i32(rows), jax.ShapeDtypeStruct((rows,), jnp.float32)
        )
        return {
            "train": lower(
                run.step_fn,
                run.plan.abstract,
                abstract_batch(run.mesh, t.gradient_accumulation_steps, run.micro_batch, seq),
            ),
            "eval": lower(
                run.eval_fn,
                params,
                run.plan.abstract.frozen,
                abstract_batch(run.mesh, 1, run.micro_batch, seq),
            ),
            "prefill": lower(
                engine.prefill_step, params, per_layer, i32(rows, prompt), i32(rows), max_len=max_len
            ),
            "insert": lower(
                engine.insert_step,
                caches,
                entries,
                logits,
                two(jnp.int32),
                two(jnp.int32),
                Draws(
                    Rules(two(jnp.float32), two(jnp.int32), two(jnp.float32)),
                    jax.ShapeDtypeStruct((2, 2), jnp.uint32),
                    two(jnp.uint32),
                ),
                kinds=Kinds(True, True, True),
            ),
            "decode": lower(
                engine.decode_step,
                params,
                per_layer,
                caches,
                i32(rows),
                i32(rows),
                i32(rows),
                Draws(
                    rules,
                    jax.ShapeDtypeStruct((rows, 2), jnp.uint32),
                    jax.ShapeDtypeStruct((rows,), jnp.uint32),
                ),
                kinds=Kinds(True, True, True),
            ),
        }


def test_the_steps_and_the_engine_lower_for_cuda_with_cudnn_attention(on_a_gpu):
    programs = _lowered("cuda", "training.attention=cudnn", "model.attn_logit_softcap=null")
    # jax's cuDNN attention is a custom_partitioning op: its kernel's custom call appears once the
    # GPU compiler partitions it; lowered, the op stands in the train step
    assert "CustomSPMDPartitioning" in programs["train"]
    assert all("sharding" in text for text in programs.values())


def test_the_steps_and_the_engine_lower_for_tpu():
    programs = _lowered("tpu")
    assert all("sharding" in text for text in programs.values())
    assert "stablehlo.scatter" in programs["decode"]  # the cache write (a select on CPU: cache._write)
    assert "CustomSPMDPartitioning" not in programs["train"]  # training.attention=xla
