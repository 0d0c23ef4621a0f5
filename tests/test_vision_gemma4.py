"""Gemma 4's image tower and its merge into the text model (model/gemma4_vision.py,
interop/gemma4_vision.py) against transformers: a random tiny Gemma4ForConditionalGeneration's
image features and whole-model logits on rows with images of two aspect ratios (padded patches),
read into ours, on one device and sharded (fsdp2 x tp2, dp2 x fsdp2); its export read back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import image_loss_and_grads, sharded_tower
from flax import nnx
from hf_reference import SIZES, TOWER

from tunix_train.config import ConfigError, ImageAttention, VisionConfig, VisionEncoder
from tunix_train.interop.gemma4_vision import tower_arrays, vision_from_hf
from tunix_train.model.gemma4_vision import Gemma4VisionTower
from tunix_train.sharding import make_mesh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IMAGE, BOI, EOI = 127, 125, 126  # in the vocabulary of the tiny text model
PATCH, KERNEL, MAX_TOKENS = 4, 2, 16  # 4-pixel patches pooled 2 x 2: an image of at most 64 patches
VISION = dict(TOWER, num_key_value_heads=4, head_dim=8, position_embedding_size=32, standardize=True)
VISION |= dict(patch_size=PATCH, pooling_kernel_size=KERNEL)
S, F = "sliding_attention", "full_attention"
TEXT = dict(
    SIZES,
    global_head_dim=16,
    layer_types=[S, F, S, F],
    sliding_window=6,  # shorter than an image
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=128,
)
GRIDS = [(4, 6), (8, 8), (6, 2)]  # patches high x wide: 6, 16 and 3 tokens


def _reference(bidirectional="vision"):
    """A random tiny Gemma 4 with an image tower; its standardization and projector drawn too."""
    torch.manual_seed(0)
    config = transformers.Gemma4Config(
        text_config={**TEXT, "use_bidirectional_attention": bidirectional},
        vision_config=VISION,
        audio_config=None,
        image_token_id=IMAGE,
        boi_token_id=BOI,
        eoi_token_id=EOI,
    )
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.vision_tower.std_bias.normal_(0.0, 0.5)
        model.model.vision_tower.std_scale.uniform_(0.5, 1.5)
    return config, model


def _image(rng, grid):
    """One image as ours takes it [64, 3*4*4 + 2] (patches beside their x, y; -1 past its own) and
    as transformers does (pixel_values [64, 48], image_position_ids [64, 2])."""
    h, w = grid
    pixels = np.zeros((KERNEL**2 * MAX_TOKENS, 3 * PATCH**2), np.float32)
    places = np.full((KERNEL**2 * MAX_TOKENS, 2), -1, np.int64)
    pixels[: h * w] = rng.uniform(0, 1, (h * w, 3 * PATCH**2))
    xs, ys = np.meshgrid(np.arange(w), np.arange(h), indexing="xy")
    places[: h * w] = np.stack([xs, ys], -1).reshape(-1, 2)
    return np.concatenate([pixels, places.astype(np.float32)], -1), pixels, places


def test_the_tower_and_projector_equal_transformers(tmp_path):
    from safetensors.numpy import load_file

    config, model = _reference()
    cfg = vision_from_hf(config.to_dict(), tokens_per_image=MAX_TOKENS)
    assert (cfg.encoder, cfg.image_attention, cfg.standardize) == (
        VisionEncoder.gemma4,
        ImageAttention.sliding_layers,
        True,
    )
    assert cfg.image_shape == (64, 50)
    rng = np.random.default_rng(0)
    ours, pixels, places = zip(*(_image(rng, g) for g in GRIDS))
    with torch.no_grad():
        out = model.model.get_image_features(
            torch.from_numpy(np.stack(pixels)), torch.from_numpy(np.stack(places))
        )
    expected = [e.numpy() for e in out.pooler_output]  # each image's own tokens
    assert [len(e) for e in expected] == [6, 16, 3]

    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for mesh_shape in ([[1, 1], ["fsdp", "tp"]], [[2, 2], ["fsdp", "tp"]]):
        tower = Gemma4VisionTower(cfg, text_dim=TEXT["hidden_size"], rngs=nnx.Rngs(1))
        arrays = tower_arrays(cfg, tensors.__getitem__, "model.vision_tower.", "model.embed_vision.")
        mesh, graphdef, state = sharded_tower(tower, arrays, mesh_shape)
        with jax.set_mesh(mesh):
            features = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, np.stack(ours))
        for image, want in zip(np.asarray(features), expected):
            np.testing.assert_allclose(image[: len(want)], want, atol=1e-4, rtol=0)
    assert min(np.abs(e).max() for e in expected) > 0.1


def _rows(rng, T: int):
    """Rows with images of GRIDS amid text (BOI, a placeholder per token, EOI), each row's images in
    order (zeros past its own): [rows, T] ids, ours [rows, 2, 64, 50], transformers' pixels and places."""
    per_row = [[0, 1], [2], [1, 2], [0]]
    tokens, images, pixels, places = [], np.zeros((4, 2, 64, 50), np.float32), [], []
    for r, grids in enumerate(per_row):
        row = [2]
        for i, g in enumerate(grids):
            ours, p, q = _image(rng, GRIDS[g])
            images[r, i] = ours
            pixels.append(p)
            places.append(q)
            n = GRIDS[g][0] * GRIDS[g][1] // KERNEL**2
            row += [*rng.integers(3, 120, 3 + r), BOI, *[IMAGE] * n, EOI]
        tokens.append(row + list(rng.integers(3, 120, T - len(row))))
    return np.array(tokens), images, np.stack(pixels), np.stack(places)


def _transformers_logits(model, tokens, pixels, places):
    ids = torch.from_numpy(tokens)
    with torch.no_grad():
        return model(
            input_ids=ids,
            pixel_values=torch.from_numpy(pixels),
            image_position_ids=torch.from_numpy(places),
            mm_token_type_ids=(ids == IMAGE).long(),
        ).logits.numpy()


@pytest.mark.parametrize(
    "mesh_shape, bidirectional",
    [
        ([[1, 1], ["fsdp", "tp"]], "vision"),
        ([[2, 2], ["fsdp", "tp"]], "vision"),
        pytest.param([[2, 2], ["dp", "fsdp"]], "vision", marks=pytest.mark.slow),
        pytest.param([[1, 1], ["fsdp", "tp"]], None, marks=pytest.mark.slow),
    ],
)
def test_logits_with_images_equal_transformers(tmp_path, mesh_shape, bidirectional):
    """A saved Gemma4ForConditionalGeneration read by model.init_from's importer: logits of rows
    with one and two images of three aspect ratios equal transformers'. With
    use_bidirectional_attention="vision" an image's tokens see each other in the sliding layers
    (not the global ones), and the per-layer inputs of image tokens are the padding token's."""
    from tunix_train import api

    _, model = _reference(bidirectional)
    model.save_pretrained(tmp_path)
    tokens, images, pixels, places = _rows(np.random.default_rng(1), 48)
    expected = _transformers_logits(model, tokens, pixels, places)
    if bidirectional:  # the mask matters: transformers' without it differs
        with torch.no_grad():
            causal = model(
                input_ids=torch.from_numpy(tokens),
                pixel_values=torch.from_numpy(pixels),
                image_position_ids=torch.from_numpy(places),
            ).logits.numpy()
        assert np.abs(expected - causal).max() > 1e-2
    loaded = api.load(tmp_path, mesh_shape=mesh_shape, devices=jax.devices()[: np.prod(mesh_shape[0])])
    attention = ImageAttention.sliding_layers if bidirectional else ImageAttention.causal
    assert loaded.config.vision.image_attention is attention
    np.testing.assert_allclose(loaded.logits(tokens, images=images), expected, atol=1e-4, rtol=0)


def test_hf_export_loads_in_transformers_with_its_logits(tmp_path):
    """Read in and written out by ours: transformers loads it, its logits with images equal the
    original's within 1e-5, and every tensor round-trips."""
    from safetensors.numpy import load_file

    from tunix_train import api
    from tunix_train.interop import hf

    _, model = _reference()
    model.save_pretrained(tmp_path / "in")
    loaded = api.load(tmp_path / "in", mesh_shape=[[2, 2], ["fsdp", "tp"]], devices=jax.devices()[:4])
    hf.export(loaded.params, loaded.config, tmp_path / "out")
    again = transformers.Gemma4ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    tokens, _, pixels, places = _rows(np.random.default_rng(2), 48)
    np.testing.assert_allclose(
        _transformers_logits(again, tokens, pixels, places),
        _transformers_logits(model, tokens, pixels, places),
        atol=1e-5,
        rtol=0,
    )
    written = load_file(tmp_path / "out" / "model.safetensors")
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
    assert set(state) == set(written)
    for name, tensor in state.items():
        np.testing.assert_array_equal(written[name], tensor.numpy(), err_msg=name)


def test_checkpoints_the_tower_cannot_read_are_one_line():
    config, _ = _reference()
    for change, message in [
        ({"use_clipped_linears": True}, "use_clipped_linears=true"),
        ({"num_key_value_heads": 2}, "num_key_value_heads = num_attention_heads"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ]:
        whole = config.to_dict()
        whole["vision_config"] = {**whole["vision_config"], **change}
        with pytest.raises(ConfigError, match=message):
            vision_from_hf(whole)
    whole = config.to_dict()
    whole["text_config"]["use_bidirectional_attention"] = "all"
    with pytest.raises(ConfigError, match="use_bidirectional_attention='all' is not read"):
        vision_from_hf(whole)
    assert isinstance(vision_from_hf(config.to_dict()), VisionConfig)


def _init(model_cfg):
    from tunix_train.model.factory import build_model

    return build_model(model_cfg, nnx.Rngs(0))


@pytest.mark.parametrize(
    "mesh_shape, overrides",
    # (pp does not run Gemma 4's per-layer inputs yet)
    [([[2, 2], ["fsdp", "tp"]], []), ([[2, 2], ["dp", "fsdp"]], [])],
)
@pytest.mark.slow  # two meshes, three compilations each
def test_gemma4_vision_tiny_gives_one_devices_loss_and_gradients(mesh_shape, overrides):
    """gemma4_vision_tiny (tower trainable, per-layer inputs, KV sharing) on rows with images of
    two aspect ratios: the loss and every gradient, the tower's included, equal one device's."""
    from tunix_train.compose import load_config

    cfg, _ = load_config(
        ["model=gemma4_vision_tiny", "model.vision.trainable=true", "data.seq_len=48", *overrides]
    )
    rng = np.random.default_rng(0)
    images = np.zeros((1, 2, 2, 64, 50), np.float32)
    rows = []
    for r, grids in enumerate([[(4, 6), (8, 8)], [(6, 2)]]):
        row = [2]
        for i, grid in enumerate(grids):
            images[0, r, i] = _image(rng, grid)[0]
            row += [*rng.integers(3, 250, 2), 253, *[255] * (grid[0] * grid[1] // 4), 254]
        rows.append(row + list(rng.integers(3, 250, 48 - len(row))))
    tokens = np.array(rows, np.int32)
    batch = {
        "inputs": tokens[None],
        "targets": np.roll(tokens, -1, axis=1)[None],
        "positions": np.broadcast_to(np.arange(48), (1, 2, 48)),
        "images": images,
    }

    expected_loss, expected = image_loss_and_grads(cfg, batch, [[1], ["fsdp"]])
    loss, grads = image_loss_and_grads(cfg, batch, mesh_shape)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    tower = expected["vision"]["layers"]["q"][...]
    assert np.abs(tower).max() > 0  # the tower learns
    # within 1e-4 of each leaf's largest gradient; a leaf whose gradient sums to nearly nothing
    # (a layer's scalar, 1e-5 where others reach 1e-1) within 1e-5 of the largest of all
    largest = max(np.abs(g).max() for g in jax.tree.leaves(expected))
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(grads)):
        atol = max(1e-4 * np.abs(want).max(), 1e-5 * largest)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol, err_msg=jax.tree_util.keystr(path))


def test_gemma4_image_attention_under_cp_is_refused_in_one_line():
    from tunix_train import parallel
    from tunix_train.compose import load_config

    cfg, _ = load_config(["model=gemma4_vision_tiny", "data.seq_len=48"])
    with pytest.raises(ConfigError, match="image_attention=sliding_layers .* does not combine with the cp"):
        parallel.for_run(make_mesh([[2], ["cp"]], jax.devices()[:2]), cfg.model, cfg.training, 48)


@pytest.mark.parametrize(
    "width, height, mode",
    [(64, 64, "RGB"), (45, 17, "RGB"), (30, 100, "RGBA"), (7, 5, "L"), (1200, 700, "RGB"), (900, 20, "RGB")],
)
def test_patches_equal_transformers_gemma4_image_processor(width, height, mode):
    """Six sizes and aspect ratios (one grey, one with alpha, one a strip), up- and down-scaled to
    budgets of 70 and 280 tokens, against transformers' Gemma4ImageProcessor (its Pillow backend):
    the patches, their places and the padding."""
    Image = pytest.importorskip("PIL.Image")
    from tunix_train.data.images import gemma4_patches

    rng = np.random.default_rng(width * height)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(array[..., 0] if mode == "L" else array, mode)
    for tokens in (70, 280):
        processor = transformers.Gemma4ImageProcessorPil(max_soft_tokens=tokens)
        out = processor(images=[image], return_tensors="np")
        ours = gemma4_patches(image, 16, tokens, 3)
        assert ours.shape == (tokens * 9, 16 * 16 * 3 + 2) and ours.dtype == np.float32
        np.testing.assert_allclose(ours[:, :-2], out["pixel_values"][0], atol=1e-6, rtol=0)
        np.testing.assert_array_equal(ours[:, -2:], out["image_position_ids"][0])
        assert (ours[:, -1] >= 0).sum() // 9 == out["num_soft_tokens_per_image"][0]


def test_conversations_with_images_become_rows_equal_to_transformers_processor(tmp_path):
    """Rows of conversations with images for gemma4_vision_tiny (a 70-token budget): each image
    part becomes <|image> + its own count of <|image|> + <image|>, the count and the text as
    transformers' Gemma4ImageProcessor and Gemma4Processor.replace_image_token make them (the
    processor itself needs torchvision for its video half), tokenized as transformers does; the
    images are the processor's patches and places; no image token carries loss."""
    import json
    import types

    from conftest import vision_tokenizer
    from PIL import Image
    from test_vision import _batch_rows, _image_records

    from tunix_train.compose import load_config
    from tunix_train.data import Data

    records, paths = _image_records(tmp_path, np.random.default_rng(0))
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = vision_tokenizer(tmp_path / "tok", ("<|image>", "<image|>", "<|image|>"))  # Gemma 4's
    cfg, _ = load_config(
        [
            "model=gemma4_vision_tiny",
            "model.vocab_size=4104",
            "model.vision.image_token_id=4100",
            "model.vision.tokens_per_image=70",
            "data=chat",
            "data.seq_len=256",
            "data.eval_fraction=0",
            "data.images_per_row=2",
            f"data.train_files=[{tmp_path / 'chats.jsonl'}]",
            f"data.tokenizer={tokenizer}",
        ]
    )
    data = Data(cfg)
    batches = data.train_batches(global_micro_batch=4)
    batch = next(iter(batches))
    batches.close()
    assert batch["images"].shape == (1, 4, 2, 280, 50)

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer)
    images_of = transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    processor = types.SimpleNamespace(boi_token="<|image>", image_token="<|image|>", eoi_token="<image|>")
    files = {0: [paths[0]], 1: [paths[2], paths[1]], 2: [paths[1], paths[0]], 3: []}
    seen = set()
    for row, inputs, n, record, text in _batch_rows(batch, records, data, tmp_path):
        seen.add(record)
        parts = text.split("<|image|>")
        if files[record]:
            expected = images_of(images=[Image.open(p) for p in files[record]], return_tensors="np")
            for i in range(len(files[record])):
                parts[i] += transformers.Gemma4Processor.replace_image_token(processor, expected, i)
                got = batch["images"][0, row, i]
                np.testing.assert_allclose(got[:, :-2], expected["pixel_values"][i], atol=1e-6, rtol=0)
                np.testing.assert_array_equal(got[:, -2:], expected["image_position_ids"][i])
        want = np.append(inputs[:n], batch["targets"][0, row, n - 1])
        ids = hf_tokenizer("".join(parts), add_special_tokens=False)["input_ids"]
        np.testing.assert_array_equal(want, ids)
        assert not batch["images"][0, row, len(files[record]) :].any()
        assert not batch["loss_mask"][0, row][inputs == 4100].any() and batch["loss_mask"][0, row].any()
    assert seen == {0, 1, 2, 3}


def test_greedy_generation_with_images_equals_transformers(tmp_path):
    """16 greedy tokens after prompts with one and two images of other aspect ratios equal
    transformers' generate (its prefill with the images, their places and token types); the engine
    with 8 slots gives each of 8 requests (pairs alike) the tokens it has alone."""
    from tunix_train import api

    _, model = _reference()
    model.save_pretrained(tmp_path)
    tokens, images, pixels, places = _rows(np.random.default_rng(3), 40)
    per_row, expected, first = [2, 1, 2, 1], [], 0
    with torch.no_grad():
        for r, n in enumerate(per_row):
            ids = torch.from_numpy(tokens[r : r + 1])
            out = model.generate(
                input_ids=ids,
                pixel_values=torch.from_numpy(pixels[first : first + n]),
                image_position_ids=torch.from_numpy(places[first : first + n]),
                mm_token_type_ids=(ids == IMAGE).long(),
                max_new_tokens=16,
                do_sample=False,
            )
            first += n
            new = out[0, tokens.shape[1] :].tolist()
            expected.append(new[: new.index(1)] if 1 in new else new)  # ours ends before the EOS
    assert len({tuple(e) for e in expected}) > 1
    loaded = api.load(tmp_path, mesh_shape=[[2], ["fsdp"]], devices=jax.devices()[:2])
    # loaded with the processor's default budget (280 tokens: 1120 patches), so padded to it
    assert loaded.config.vision.image_shape == (1120, 50)
    images = np.concatenate([images, np.zeros((4, 2, 1120 - 64, 50), np.float32)], axis=2)
    images[:, :, 64:, -2:] = -1
    own = [images[r, :n] for r, n in enumerate(per_row)]
    solo = [loaded.generate([tokens[r]], 16, images=[own[r]])[0] for r in range(4)]
    assert solo == expected
    loaded.engine.slots = 8
    assert loaded.generate([tokens[r % 4] for r in range(8)], 16, images=[own[r % 4] for r in range(8)]) == [
        solo[r % 4] for r in range(8)
    ]


@pytest.mark.parametrize(
    "model", ["gemma3_vision_tiny", pytest.param("gemma4_vision_tiny", marks=pytest.mark.slow)]
)
def test_lora_in_the_tower_adapts_it_merges_and_trains_only_its_adapters(model):
    """LoRA on the tower's projections (vision_q, vision_out, vision_up, vision_down beside the text
    model's q and v): with B drawn (not zero) the logits with images equal those of the merged
    model without adapters (W + (alpha / r) A B, model/weights.py); the base model is the same
    with adapters or without; the tower's adapters get gradients though the tower is frozen
    (model.vision.trainable=false), and only adapters are trainable."""
    from tunix_train.compose import load_config
    from tunix_train.model.factory import build_model
    from tunix_train.model.weights import Weights

    targets = "[q,v,vision_q,vision_out,vision_up,vision_down]"
    cfg, _ = load_config([f"model={model}", "training.lora.rank=4", f"training.lora.targets={targets}"])
    lora = cfg.training.lora
    adapted = build_model(cfg.model, nnx.Rngs(0), lora=lora)
    plain = build_model(cfg.model, nnx.Rngs(0))
    weights = Weights.for_run(cfg, keeps_reference=False)
    trainable, frozen = weights.split(nnx.state(adapted, nnx.Param))
    np.testing.assert_array_equal(
        frozen["vision"]["layers"]["q"][...], nnx.state(plain)["vision"]["layers"]["q"][...]
    )
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)}
    assert "vision.layers.q_lora.a" in names and "vision.layers.down_lora.b" in names
    assert all(n.endswith((".a", ".b")) for n in names)
    rng = np.random.default_rng(0)
    trainable = jax.tree.map(lambda x: x + 0.3 * rng.standard_normal(x.shape).astype(np.float32), trainable)

    rng = np.random.default_rng(1)
    if model == "gemma4_vision_tiny":
        images = np.stack([[_image(rng, (4, 6))[0], _image(rng, (8, 8))[0]]])
        count = [6, 16]
        image_tokens = [[253, *[255] * n, 254] for n in count]
    else:
        images = rng.standard_normal((1, 2, 3, 32, 32)).astype(np.float32)
        image_tokens = [[253, *[255] * 16, 254]] * 2
    row = [2, *rng.integers(3, 250, 3), *image_tokens[0], *rng.integers(3, 250, 2), *image_tokens[1]]
    tokens = np.array([row + list(rng.integers(3, 250, 48 - len(row)))], np.int32)
    graph = nnx.graphdef(adapted)

    @jax.jit
    def logits(trainable):
        return nnx.merge(graph, frozen, trainable)(tokens, images=images)

    with_adapters = logits(trainable)
    merged = jax.jit(lambda p: nnx.merge(nnx.graphdef(plain), p)(tokens, images=images))(
        weights.merged(trainable, frozen)
    )
    np.testing.assert_allclose(with_adapters, merged, atol=1e-4, rtol=0)  # logits of about 2
    base = logits(jax.tree.map(jnp.zeros_like, trainable))
    assert np.abs(np.asarray(with_adapters) - np.asarray(base)).max() > 1e-2
    grads = jax.jit(jax.grad(lambda t: jnp.mean(logits(t) ** 2)))(trainable)
    assert np.abs(grads["vision"]["layers"]["q_lora"]["a"][...]).max() > 0


def test_tower_lora_targets_are_checked_in_one_line():
    from tunix_train.compose import load_config

    for overrides, message in [
        (["model=gemma3_tiny", "training.lora.targets=[q,vision_q]"], "unknown projection 'vision_q'"),
        (["model=gemma3_vision_tiny", "training.lora.targets=[vision_gate]"], "vision_gate is Gemma 4's"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(["training.lora.rank=4", *overrides])
    load_config(["model=gemma4_vision_tiny", "training.lora.rank=4", "training.lora.targets=[vision_gate]"])


def test_the_mmproj_gguf_reads_back_as_the_towers_tensors(tmp_path):
    """Gemma 4's tower as llama.cpp's mmproj file (--dtype f32), read back with the gguf reader:
    clip.vision.projector_type gemma4v and the tower's sizes, and every tensor of transformers'
    tower and projector under the name convert_hf_to_gguf.py's Gemma4VisionAudioModel gives it,
    equal (the patch embedding as a convolution [D, 3, P, P], rows from (y, x, channel))."""
    gguf = pytest.importorskip("gguf")
    from test_vision import written_mmproj

    model, _, reader = written_mmproj(_reference()[1], tmp_path)

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "clip" and field("clip.vision.projector_type") == "gemma4v"
    for key, value in {
        "patch_size": 4,
        "embedding_length": 32,
        "block_count": 2,
        "projection_dim": 64,
    }.items():
        assert field(f"clip.vision.{key}") == value, key
    assert field("clip.vision.image_std") == pytest.approx([1.0] * 3)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 2)
    read = {t.name: t for t in reader.tensors}
    theirs = {n: t.numpy() for n, t in model.state_dict().items() if "vision" in n}
    assert len(read) == len(theirs) == 2 + 2 + 2 * 13 + 1  # patch, positions, std, 13 a layer, projection
    for name, want in theirs.items():
        name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(
            ".linear.weight", ".weight"
        )
        if name.endswith("position_embedding_table"):
            name += ".weight"
        if name.endswith("input_proj.weight"):
            want = want.reshape(32, 4, 4, 3).transpose(0, 3, 1, 2)
        tensor = read[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.name
        np.testing.assert_array_equal(np.asarray(tensor.data).reshape(want.shape), want, err_msg=tensor.name)
