"""Padding-free rollouts (data.padding_free with GRPO, its family and PPO; data/packed_rows.py):
a rollout's completions packed with their prompts into shared rows give the padded rows' tokens,
loss and training, on any mesh. (The loss of every GRPO family setting, packed and padded, equals
TRL's in test_grpo_family.)"""

import jax
import numpy as np
import pytest
from conftest import read_metrics, rl_config

from tunix_train.data.packed_rows import Packing
from tunix_train.train.loop import pad_fraction, train
from tunix_train.train.objectives import make_objective
from tunix_train.train.rollouts import Rollout

REWARD = "tests.rewards_for_tests:length"


def _cfg(tmp_path, *overrides):
    return rl_config(
        tmp_path,
        "data.seq_len=64",
        "training.rollout.num_generations=4",
        "training.rollout.max_new_tokens=8",
        "training.rollout.temperature=1.5",
        f"training.rollout.reward=[{REWARD}]",
        *overrides,
    )


def test_a_rollouts_rows_pack_into_the_front_micro_batches_and_unpack_to_the_padded_rows(tmp_path):
    """Four completions of 3, 1, 6 and 2 tokens after prompts of 3 and 5, in 2 micro-batches of 2
    rows of 16: packed, they fill the first micro-batch (segments 1, 2, ... of a row, positions
    from 0 at each) and leave the second empty; every field of every sequence unpacks to its
    padded row's."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "x", "answer": "1"}\n{"prompt": "y", "answer": "2"}\n')
    rows = {}
    for packed in (False, True):
        cfg = _cfg(
            tmp_path,
            f"data.train_files=[{tmp_path}/p.jsonl]",
            "data.seq_len=16",
            "training.rollout.num_generations=2",
            "training.micro_batch_size=2",
            "training.gradient_accumulation_steps=2",
            f"data.padding_free={packed}",
        )
        objective = make_objective(cfg)
        objective.sampler.rows = range(0, 2)
        completions = [[5, 6, 7], [5], [6, 7, 8, 9, 10, 11], [5, 6]]
        rollout = Rollout(
            0,
            0,
            2,
            [0, 1],
            completions,
            [[-0.5 - i] * len(c) for i, c in enumerate(completions)],
            [[1.0, 0.0, 0.5, 0.25]],
            0.0,
            prompt_ids=[[2, 3, 4]] * 2 + [[2, 3, 4, 5, 6]] * 2,
        )
        rows[packed] = objective._rows_of(rollout)
    padded, packed = (
        {k: x.reshape(4, *x.shape[2:]) for k, x in r.items()} for r in (rows[False], rows[True])
    )
    # lengths (prompt + completion - 1 positions): 5, 3, 10, 6 -> 10 + 6, 5 + 3 in two rows of 16
    assert (packed["segment_ids"][2:] == 0).all() and pad_fraction(rows[True]["segment_ids"]) == 8 / 32
    assert sorted(packed["segment_ids"][:2].max(axis=1).tolist()) == [2, 2]
    assert pad_fraction(rows[False]["segment_ids"]) == pytest.approx(1 - 24 / 64)
    for positions, segments in zip(packed["positions"][:2], packed["segment_ids"][:2]):
        assert np.count_nonzero((positions == 0) & (segments > 0)) == 2  # two sequences, from position 0
    packing = Packing.first_fit(padded["segment_ids"], 4)
    assert packing.used_rows == 2
    used = padded["segment_ids"] > 0  # (a padded row's advantage is on its padding too)
    for name in set(padded) - {"segment_ids"}:  # (segment ids count a row's sequences)
        np.testing.assert_array_equal(packing.unpack(packed[name])[used], padded[name][used], err_msg=name)
    assert (packing.unpack(packed["loss_mask"]) == padded["loss_mask"]).all()


@pytest.mark.parametrize(
    "overrides",
    [
        # slow: the README's leg checks the packed loss against TRL's (test_grpo_family)
        pytest.param(
            ("training.grpo.loss_aggregation=sequence_mean", "training.grpo.beta=0.04"),
            marks=pytest.mark.slow,
        ),
        pytest.param(("objective=ppo", "training.rollout.iterations=2"), marks=pytest.mark.slow),
    ],
    ids=["grpo", "ppo"],
)
def test_packed_rollouts_train_as_padded_ones_on_any_mesh(tmp_path, overrides):
    """Three steps (8 prompts x G=4 in 2 micro-batches of 16 rows of 64; prompts of several
    lengths, 8 completion tokens): padded on one device, packed on fsdp2 x tp2. The same samples,
    rewards, losses, KL and gradient norms within 1e-5, and the packed run's padding (pad_fraction,
    over the micro-batches it computes: one of two) below the padded run's. GRPO with its
    per-sequence mean and a reference; PPO with its scoring pass, GAE and two epochs a rollout."""
    runs = {}
    for name, mesh, packing in (
        ("padded", [[1], ["fsdp"]], False),
        ("packed_fsdp2_tp2", [[2, 2], ["fsdp", "tp"]], True),
    ):
        cfg = _cfg(
            tmp_path,
            f"training.micro_batch_size={16 // mesh[0][0]}",
            "training.gradient_accumulation_steps=2",
            "training.max_steps=3",
            f"data.padding_free={packing}",
            *overrides,
        )
        cfg.model.mesh_shape = mesh
        train(cfg, tmp_path / name, devices=jax.devices()[: int(np.prod(mesh[0]))])
        runs[name] = read_metrics(tmp_path / name)
    keys = [
        k
        for k in ("loss", "grad_norm", "reward", "kl", "value_loss", "completion_tokens")
        if k in runs["padded"][0]
    ]
    expected = [[m[k] for k in keys] for m in runs["padded"]]
    for name in ("packed_fsdp2_tp2",):
        got = [[m[k] for k in keys] for m in runs[name]]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=name)
        for m, p in zip(runs[name], runs["padded"]):
            assert m["pad_fraction"] < p["pad_fraction"]
    assert len({m["reward"] for m in runs["padded"]}) > 1  # the steps differ: the runs are compared
