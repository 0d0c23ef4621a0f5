"""Padding-free preference pairs (data.padding_free, data/pipeline.PackedPairs): the same pairs of
mixed lengths, packed whole into rows or padded two rows a pair, give the same loss, metrics and
gradient (DPO's sigmoid and orpo losses and the reward model's); runs train packed on fsdp2 x tp2;
pad_fraction is logged; bad input is one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config, read_metrics
from flax import nnx

from tunix_train.config import ConfigError
from tunix_train.data import Data
from tunix_train.data.pipeline import PackedPairs
from tunix_train.model.decoder import Decoder
from tunix_train.parallel import model_graphdef
from tunix_train.train.objectives import make_objective
from tunix_train.train.program import Program
from tunix_train.train.step import eval_step

WORDS = ["king", "queen", "night", "day", "love", "sword", "crown", "fool"]


def _pairs(path, n=40):
    """Pairs whose prompts and answers run from 1 to 12 words: rows of very different lengths."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            words = [" ".join(rng.choice(WORDS, rng.integers(1, 13))) for _ in range(3)]
            record = dict(zip(("prompt", "chosen", "rejected"), words))
            f.write(json.dumps({**record, "margin": float(rng.normal())}) + "\n")
    return path


def _layouts(tmp_path, *overrides):
    """The first packed micro-batch (4 row slots of 64 positions, the pairs in order) and the same
    pairs padded two rows each; the objective of each, and how many pairs they hold."""
    common = [
        "model.vocab_size=4096",
        "data=jsonl",
        f"data.train_files=[{_pairs(tmp_path / 'pairs.jsonl')}]",
        "data.seq_len=64",
        *overrides,
    ]
    packed_cfg = config(*common, "data.padding_free=true")
    padded_cfg = config(*common)
    out = {}
    for name, cfg in (("packed", packed_cfg), ("padded", padded_cfg)):
        objective = make_objective(cfg)
        objective.read(Data(cfg, objective.record_fields))
        out[name] = objective
    pairs = out["packed"]._pairs["train"]
    packed = PackedPairs(pairs, seq_len=64, accumulation_steps=1, global_micro_batch=4, seed=None, bins=1)
    packed_batch = next(packed)
    packed.close()
    # row r packs pairs r, r + 4, ... in order, as many as fit
    starts = (packed_batch["segment_ids"][0] % 2 == 1) & (packed_batch["positions"][0] == 0)
    held = [r + 4 * i for r, count in enumerate(starts.sum(axis=1)) for i in range(count)]
    padded = [out["padded"]._pairs["train"][i] for i in held]
    padded_batch = {name: np.concatenate([p[name] for p in padded])[None] for name in padded[0]}
    return out, packed_batch, padded_batch, len(held), padded_cfg


def _sums_and_grads(cfg, objective, batch):
    graphdef = model_graphdef(cfg.model, cfg.training.remat)
    params = nnx.state(Decoder(cfg.model, nnx.Rngs(0)), nnx.Param)
    # a reference of other weights: the implicit rewards are not all 0 (their comparisons well posed)
    frozen = nnx.state(Decoder(cfg.model, nnx.Rngs(1)), nnx.Param) if objective.needs_reference else None

    def sums(params):
        out = eval_step(
            Program(graphdef, objective=objective), params, jax.tree.map(jnp.asarray, batch), frozen=frozen
        )
        return out["loss_sum"] / out["weight"], out

    (loss, out), grads = jax.value_and_grad(sums, has_aux=True)(params)
    return out, grads


@pytest.mark.parametrize(
    "overrides",
    [
        ("objective=dpo",),
        # ipo and simpo read the same per-pair sums as sigmoid; orpo has a normalizer of its own
        pytest.param(("objective=orpo",), marks=pytest.mark.slow),
        ("objective=reward", "training.reward.center_rewards_coefficient=0.01"),
    ],
)
def test_packed_pairs_give_the_padded_loss_metrics_and_gradient(tmp_path, overrides):
    """The first packed micro-batch of pairs of 1 to 12 words a part holds n pairs in 4 rows; the
    same n pairs padded are 2n rows. The loss agrees within 1e-6 (relative); weight and metrics
    within 1e-5, and every parameter's gradient within 1e-5 of its largest entry (float32 sums in
    other orders)."""
    objectives, packed_batch, padded_batch, count, cfg = _layouts(tmp_path, *overrides)
    assert padded_batch["inputs"].shape[1] == 2 * count and count > 4  # more pairs than rows
    pad_packed = float((packed_batch["segment_ids"] == 0).mean())
    pad_padded = float((padded_batch["segment_ids"] == 0).mean())
    assert pad_packed < 0.5 * pad_padded  # what packing is for
    packed, packed_grads = _sums_and_grads(cfg, objectives["packed"], packed_batch)
    padded, padded_grads = _sums_and_grads(cfg, objectives["padded"], padded_batch)
    assert set(packed) == set(padded)
    if "objective=orpo" not in overrides:
        assert float(packed["weight"]) == float(padded["weight"]) == count
    loss = {
        name: float(out["loss_sum"] / out["weight"]) for name, out in (("packed", packed), ("padded", padded))
    }
    assert loss["packed"] == pytest.approx(loss["padded"], rel=1e-6)
    for name in packed:  # float32 sums in other orders (rows of other lengths, per-segment sums)
        np.testing.assert_allclose(
            float(packed[name]), float(padded[name]), rtol=1e-5, atol=1e-6, err_msg=name
        )
    for a, b in zip(jax.tree.leaves(packed_grads), jax.tree.leaves(padded_grads)):
        scale = max(float(jnp.max(jnp.abs(b))), 1e-12)
        np.testing.assert_allclose(np.asarray(a) / scale, np.asarray(b) / scale, atol=1e-5)


def test_padding_free_dpo_trains_alike_on_fsdp2_tp2_and_logs_its_padding(tmp_path):
    """Two steps of packed DPO log the same losses on one device and on fsdp2 x tp2 (1e-5), and a
    pad_fraction below the padded run's."""
    from tunix_train.train.loop import train

    train_files = _pairs(tmp_path / "pairs.jsonl", 64)
    runs = {}
    for name, mesh, devices, rows, packing in (
        ("one", '[[1],["fsdp"]]', 1, 4, "true"),
        ("sharded", '[[2,2],["fsdp","tp"]]', 4, 2, "true"),
        ("padded", '[[1],["fsdp"]]', 1, 4, "false"),
    ):
        cfg = config(
            "objective=dpo",
            "model.vocab_size=4096",
            "data=jsonl",
            f"data.train_files=[{train_files}]",
            "data.seq_len=64",
            f"data.padding_free={packing}",
            f"model.mesh_shape={mesh}",
            f"training.micro_batch_size={rows}",
            "training.max_steps=2",
            "training.log_every=1",
            "training.eval_every=0",
        )
        train(cfg, tmp_path / name, devices=jax.devices()[:devices])
        runs[name] = read_metrics(tmp_path / name)
    np.testing.assert_allclose(
        [m["loss"] for m in runs["sharded"]], [m["loss"] for m in runs["one"]], rtol=1e-5
    )
    assert runs["one"][0]["pad_fraction"] < runs["padded"][0]["pad_fraction"]


def test_bad_padding_free_settings_are_one_line(tmp_path):
    for overrides, message in [
        (("objective=lm",), "objective=lm always packs its documents"),
        (("data=synthetic",), "data.padding_free packs preference pairs and rollouts"),
        (("objective=grpo", "training.rollout.reward=[m:f]", "model=gemma3_vision_tiny"), "rows with images"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config(*overrides, "data=jsonl", "data.train_files=[x.jsonl]", "data.padding_free=true")
    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps({"prompt": "king " * 20, "chosen": "queen " * 10, "rejected": "night " * 10}) + "\n"
    )
    files = [f"data.train_files=[{long}]", f"data.eval_files=[{long}]"]
    cfg = config(
        "objective=dpo",
        "model.vocab_size=4096",
        "data=jsonl",
        *files,
        "data.seq_len=48",
        "data.padding_free=true",
    )
    objective = make_objective(cfg)
    with pytest.raises(ConfigError, match=r"pair 1 \(rejected\) is .* with its chosen answer"):
        objective.read(Data(cfg, objective.record_fields))
