"""Gemma 3's image tower (model/vision.py, interop/vision.py) against transformers: a random tiny
Gemma3ForConditionalGeneration's SigLIP encoder output and projected image features, read into ours,
on one device and with the tower's parameters sharded over fsdp2 x tp2 and the images over the
data axes."""

import io

import jax
import numpy as np
import pytest
from flax import nnx
from hf_reference import SIZES

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
        text_config=SIZES,  # the parity tests' tiny text model: 4 layers, every one sliding-window
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
    assert expected.shape == (4, 16, SIZES["hidden_size"])

    tower = VisionTower(cfg, text_dim=SIZES["hidden_size"], rngs=nnx.Rngs(1))
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


@pytest.mark.parametrize(
    "width, height, mode",
    [(32, 32, "RGB"), (45, 17, "RGB"), (30, 100, "RGBA"), (7, 5, "L"), (1200, 700, "RGB")],
)
def test_pixel_values_equal_transformers_gemma3_image_processor(width, height, mode):
    """Five sizes and aspect ratios (one grey, one with alpha), up- and down-scaled to 64 and 896
    pixels a side, against transformers' Gemma3ImageProcessor (its Pillow backend), pan-and-scan off."""
    Image = pytest.importorskip("PIL.Image")
    from tunix_train.data.images import pixel_values

    rng = np.random.default_rng(width * height)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(array[..., 0] if mode == "L" else array, mode)
    for size in (64, 896):
        processor = transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size})
        expected = processor(images=[image], return_tensors="np")["pixel_values"][0]
        ours = pixel_values(image, size)
        assert ours.shape == expected.shape == (3, size, size) and ours.dtype == np.float32
        np.testing.assert_allclose(ours, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("width, height", [(1200, 700), (300, 1000), (500, 480), (1300, 200), (700, 120)])
def test_pan_and_scan_crops_equal_transformers(width, height):
    """Landscape and portrait images cut into 2 to 4 crops (the last one short where the side does
    not divide), one too square to cut, one whose crops would be too small; each crop's pixel values
    after the image's own, as Gemma3ImageProcessorPil(do_pan_and_scan=True) gives them."""
    Image = pytest.importorskip("PIL.Image")
    from tunix_train.data.images import pan_and_scan, pixel_values

    image = Image.fromarray(np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8))
    settings = dict(min_crop_size=128, max_crops=4, min_ratio=1.2)
    processor = transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    expected = processor(
        images=[image],
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=settings["min_crop_size"],
        pan_and_scan_max_num_crops=settings["max_crops"],
        pan_and_scan_min_ratio_to_activate=settings["min_ratio"],
        return_tensors="np",
    )
    crops = pan_and_scan(image, **settings)
    assert len(crops) == expected["num_crops"][0] == {1200: 2, 300: 3, 1300: 4}.get(width, 0)
    ours = np.stack([pixel_values(im, 64) for im in [image, *crops]])
    np.testing.assert_allclose(ours, expected["pixel_values"], atol=1e-6, rtol=0)


def test_a_bad_image_file_is_one_line_naming_it(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    from tunix_train.config import ConfigError
    from tunix_train.data.images import MAX_PIXELS, open_image

    good = tmp_path / "good.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(good)
    assert open_image(good).size == (8, 8)
    (tmp_path / "truncated.png").write_bytes(good.read_bytes()[:40])
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("not an image")
    for name in ("truncated.png", "empty.png", "text.png", "missing.png"):
        with pytest.raises(ConfigError, match=f"image {tmp_path / name}: ") as err:
            open_image(tmp_path / name)
        assert "\n" not in str(err.value)
    side = int(MAX_PIXELS**0.5) + 1  # a bomb is refused from its header, before decoding
    big = io.BytesIO()
    Image.new("L", (side, side)).save(big, "PNG")
    with pytest.raises(ConfigError, match="an image's bytes: more than"):
        open_image(big.getvalue())


def test_the_text_model_of_a_saved_multimodal_gemma3_loads_with_transformers_logits(tmp_path):
    """The file layout of Gemma 3's published multimodal checkpoints, which transformers 5's
    save_pretrained writes too (language_model.model.*, vision_tower.*): the text decoder loads on
    its own, its logits on text equal transformers'; the tower is left out (not joined yet)."""
    from tunix_train import api

    _, model = _reference()
    model.save_pretrained(tmp_path)
    tokens = np.random.default_rng(0).integers(0, SIZES["vocab_size"], (2, 12))
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    loaded = api.load(tmp_path, mesh_shape=[[1], ["fsdp"]], devices=jax.devices()[:1])
    np.testing.assert_allclose(loaded.logits(tokens), expected, atol=1e-4, rtol=0)
