"""Gemma 3's image tower (model/vision.py, interop/vision.py) against transformers: a random tiny
Gemma3ForConditionalGeneration's SigLIP encoder output and projected image features, read into ours,
on one device and with the tower's parameters sharded over fsdp2 x tp2 and the images over the
data axes."""

import jax
import numpy as np
import pytest
from flax import nnx

from tunix_train.interop.vision import load_tower, vision_from_hf
from tunix_train.model.vision import VisionConfig, VisionTower
from tunix_train.sharding import make_mesh, state_shardings

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=4,
    layer_norm_eps=1e-6,
)


def _reference():
    """A random tiny Gemma 3 with an image tower (8 x 8 patches pooled to 4 x 4 tokens), its
    projector's weights drawn too (transformers starts them at zero)."""
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=dict(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=300,
        ),
        vision_config=VISION,
        mm_tokens_per_image=16,
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0.0, 0.5)
    return config, model


@pytest.mark.parametrize("mesh_shape", [[[1, 1], ["fsdp", "tp"]], [[2, 2], ["fsdp", "tp"]]])
def test_the_tower_and_projector_equal_transformers(tmp_path, mesh_shape):
    from safetensors.numpy import load_file

    config, model = _reference()
    cfg = vision_from_hf(config.vision_config.to_dict(), config.mm_tokens_per_image)
    assert cfg == VisionConfig(32, 4, 3, 32, 64, 2, 4, 1e-6, 16)
    pixels = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels))
    expected_hidden, expected = out.last_hidden_state.numpy(), out.pooler_output.numpy()
    assert expected.shape == (4, 16, 48)

    tower = VisionTower(cfg, text_dim=48, rngs=nnx.Rngs(1))
    model.save_pretrained(tmp_path)  # the names in the file, which an importer reads
    tensors = load_file(tmp_path / "model.safetensors")
    load_tower(tower, tensors, "vision_tower.", "multi_modal_projector.")
    mesh = make_mesh(mesh_shape, jax.devices()[: np.prod(mesh_shape[0])])
    graphdef, state = nnx.split(tower)
    with jax.set_mesh(mesh):
        state = jax.device_put(state, state_shardings(state, mesh))
        if mesh.size > 1:  # the attention and MLP weights are split over tp, the rest over fsdp
            up = state["layers"]["up"][...]  # [layers, embed, mlp]
            assert {s.data.shape for s in up.addressable_shards} == {(2, 16, 32)}

        @jax.jit
        def run(state, pixels):
            tower = nnx.merge(graphdef, state)
            return tower.encode(pixels), tower(pixels)

        hidden, features = run(state, pixels)
    np.testing.assert_allclose(hidden, expected_hidden, atol=1e-4, rtol=0)
    np.testing.assert_allclose(features, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 0.1  # the projector's weights are not the zeros they start at


def test_a_tower_whose_tokens_do_not_tile_its_patches_is_refused():
    with pytest.raises(ValueError, match="tokens_per_image=15 must be a square"):
        VisionConfig(image_size=32, patch_size=4, tokens_per_image=15)
    with pytest.raises(ValueError, match="tokens_per_image=9 must be a square whose side divides the 8"):
        VisionConfig(image_size=32, patch_size=4, tokens_per_image=9)
