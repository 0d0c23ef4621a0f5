"""model.rope_scaling against transformers: each schedule's frequencies and attention factor equal
ROPE_INIT_FUNCTIONS' for the configs Llama 3.1 and Qwen publish (and yarn's other options), and the
decoder's rotary tables at positions past the original context equal transformers' cos and sin."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="these tests need torch: pip install -e '.[reference]'")
transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[reference]'")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tunix_train.config import ConfigError, RopeScaling, RopeScalingType  # noqa: E402
from tunix_train.model.layout import validate_rope_scaling  # noqa: E402
from tunix_train.model.rope import longrope_frequencies, rope_table, scaled_frequencies  # noqa: E402

# name -> (rope_theta, head_dim, transformers' rope_parameters, ours)
CASES = {
    "llama3_1": (
        500_000.0,
        128,
        dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        RopeScaling(RopeScalingType.llama3, 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0),
    ),
    "llama3_2": (
        500_000.0,
        64,
        dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        RopeScaling(RopeScalingType.llama3, 32.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0),
    ),
    "yarn_qwen": (
        1_000_000.0,
        128,
        dict(factor=4.0, original_max_position_embeddings=32768),
        RopeScaling(RopeScalingType.yarn, 4.0, 32768),
    ),
    "yarn_options": (
        10_000.0,
        64,
        dict(
            factor=8.0,
            original_max_position_embeddings=2048,
            beta_fast=16.0,
            beta_slow=2.0,
            attention_factor=1.3,
            truncate=False,
        ),
        RopeScaling(
            RopeScalingType.yarn,
            8.0,
            2048,
            beta_fast=16.0,
            beta_slow=2.0,
            attention_factor=1.3,
            truncate=False,
        ),
    ),
}


def _transformers(theta, head_dim, parameters, kind):
    config = transformers.LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=4 * parameters["original_max_position_embeddings"],
        rope_parameters={"rope_type": kind, "rope_theta": theta, **parameters},
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.numpy(), attention_factor


@pytest.mark.parametrize("name", CASES)
def test_frequencies_and_attention_factor_equal_transformers(name):
    theta, head_dim, parameters, ours = CASES[name]
    inv_freq, attention_factor = _transformers(theta, head_dim, parameters, ours.type.value)
    our_freq, our_factor = scaled_frequencies(theta, head_dim, ours)
    np.testing.assert_allclose(our_freq, inv_freq, rtol=2e-6)
    assert our_factor == pytest.approx(attention_factor, rel=1e-12)
    # the schedules leave the fastest pair as pre-trained and slow the slowest by the factor
    assert our_freq[0] == pytest.approx(1.0) and our_freq[-1] == pytest.approx(
        1 / theta ** ((head_dim - 2) / head_dim) / ours.factor, rel=1e-6
    )


@pytest.mark.parametrize("name", ["llama3_2", "yarn_options"])
def test_rope_tables_past_the_original_context_equal_transformers(name):
    theta, head_dim, parameters, ours = CASES[name]
    inv_freq, attention_factor = _transformers(theta, head_dim, parameters, ours.type.value)
    context = parameters["original_max_position_embeddings"]
    positions = np.array([[0, 1, context - 1, context, context + 1, 2 * context + 5]])
    # transformers' rotary embedding: float32 angles, cos and sin times the attention factor
    angles = torch.tensor(positions, dtype=torch.float32)[..., None] * torch.from_numpy(inv_freq)
    sin, cos = rope_table(jnp.asarray(positions), theta, 1.0, head_dim, scaling=ours)
    # a float32 angle near position p is good to p * eps; the two sides' frequencies (ours from
    # float64, transformers' in float32) may differ in their last bit
    atol = 4 * positions.max() * np.finfo(np.float32).eps
    np.testing.assert_allclose(sin[:, :, 0, 0], (angles.sin() * attention_factor).numpy(), atol=atol)
    np.testing.assert_allclose(cos[:, :, 0, 0], (angles.cos() * attention_factor).numpy(), atol=atol)
    # and the schedule matters at these positions: the unscaled table is far from it
    plain_sin, _ = rope_table(jnp.asarray(positions), theta, 1.0, head_dim)
    assert np.abs(plain_sin[0, 3:, 0, 0] - sin[0, 3:, 0, 0]).max() > 100 * atol


def test_bad_rope_scaling_is_one_line_naming_the_key():
    for scaling, words in (
        (RopeScaling(RopeScalingType.llama3, 8.0, 0), "set original_context"),
        (RopeScaling(RopeScalingType.yarn, 0.5, 4096), "factor=0.5 must be >= 1"),
        (RopeScaling(RopeScalingType.llama3, 8.0, 8192, low_freq_factor=4.0), "low_freq_factor"),
        (RopeScaling(RopeScalingType.yarn, 4.0, 4096, beta_fast=1.0, beta_slow=2.0), "beta_fast"),
        (RopeScaling(RopeScalingType.longrope, 4.0, 8, short_factor=[1.0] * 8), "need 8 positive factors"),
        (
            RopeScaling(RopeScalingType.longrope, 4.0, 8, short_factor=[1.0] * 8, long_factor=[0.0] * 8),
            "need 8 positive factors",
        ),
        (RopeScaling(RopeScalingType.yarn, 4.0, 8, short_factor=[1.0] * 8), "are longrope's"),
    ):
        with pytest.raises(ConfigError, match=f"model.rope_scaling .*{words}"):
            validate_rope_scaling(scaling, 16)


def test_longrope_frequencies_and_tables_equal_transformers_short_and_long():
    """Phi-3's LongRoPE (transformers' _compute_longrope_parameters, the factor from
    max_position_embeddings / original_max_position_embeddings): each pair's frequency divided by
    its short factor for a sequence up to the original context, by its long factor past it; a row
    of the table picks by its own length, its every position alike."""
    head_dim, theta, context = 16, 10_000.0, 8
    rng = np.random.default_rng(0)
    short, long = (list(1.0 + rng.uniform(0, f, head_dim // 2)) for f in (0.5, 8.0))
    config = transformers.Phi3Config(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=4 * context,
        original_max_position_embeddings=context,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": theta,
            "short_factor": short,
            "long_factor": long,
        },
    )
    ours = RopeScaling(RopeScalingType.longrope, 4.0, context, short_factor=short, long_factor=long)
    validate_rope_scaling(ours, head_dim)
    our_short, our_long, our_factor = longrope_frequencies(theta, head_dim, ours)
    for seq_len, our_freq in ((context, our_short), (context + 1, our_long)):
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        np.testing.assert_allclose(our_freq, inv_freq.numpy(), rtol=2e-6)
        assert our_factor == pytest.approx(attention_factor, rel=1e-12)
    positions = np.array([np.arange(context), np.arange(context) + 3])  # the second row runs past
    sin, _ = rope_table(jnp.asarray(positions), theta, 1.0, head_dim, scaling=ours)
    for row, freq in ((0, our_short), (1, our_long)):
        expected = np.sin(positions[row][:, None] * freq.astype(np.float32)) * our_factor
        np.testing.assert_allclose(sin[row, :, 0, 0], expected, atol=1e-5)
