"""Gemma 3's image tower and its merge into the text model (model/vision.py, interop/vision.py)
against transformers: a random tiny Gemma3ForConditionalGeneration's SigLIP encoder output,
projected image features and whole-model logits on conversations with images, read into ours, on
one device and sharded (fsdp2 x tp2, dp2 x fsdp2); the image processor against transformers'."""

import collections
import dataclasses
import io

import jax
import numpy as np
import pytest
from conftest import image_loss_and_grads, sharded_tower, vision_tokenizer
from flax import nnx
from hf_reference import SIZES, TOWER

from tunix_train.config import ConfigError, ModelConfig, VisionConfig
from tunix_train.interop.vision import tower_arrays, vision_from_hf
from tunix_train.model.layout import validate_model
from tunix_train.model.vision import VisionTower

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VISION = dict(TOWER, image_size=32, patch_size=4, layer_norm_eps=1e-6)


IMAGE, BOI, EOI = 127, 125, 126  # the image placeholder, start and end of image: in the vocabulary
TEXT = dict(SIZES, sliding_window=6, sliding_window_pattern=2)  # sliding, global, sliding, global


def _reference(text=SIZES):
    """A random tiny Gemma 3 with an image tower (8 x 8 patches pooled to 4 x 4 tokens), its
    projector's weights drawn too (transformers starts them at zero). text: the parity tests' tiny
    text model (4 layers, every one sliding-window), or TEXT."""
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=16,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
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
    cfg = vision_from_hf(config.to_dict())
    assert cfg == VisionConfig(32, 4, 3, 32, 64, 2, 4, 1e-6, 16, IMAGE)
    pixels = np.random.default_rng(0).standard_normal((4, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels))
    expected_hidden, expected = out.last_hidden_state.numpy(), out.pooler_output.numpy()
    assert expected.shape == (4, 16, SIZES["hidden_size"])

    tower = VisionTower(cfg, text_dim=SIZES["hidden_size"], rngs=nnx.Rngs(1))
    model.save_pretrained(tmp_path)  # the names in the file, which an importer reads
    tensors = load_file(tmp_path / "model.safetensors")
    arrays = tower_arrays(cfg, tensors.__getitem__, "vision_tower.", "multi_modal_projector.")
    mesh, graphdef, state = sharded_tower(tower, arrays, mesh_shape)
    with jax.set_mesh(mesh):
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
    def model(**vision):
        return ModelConfig(
            family="gemma3", name="t", num_layers=1, embed_dim=8, hidden_dim=8, num_heads=1, num_kv_heads=1,
            head_dim=8, vocab_size=16, vision=VisionConfig(**{"image_token_id": 15, **vision}),
        )  # fmt: skip

    validate_model(model(image_size=32, patch_size=4, tokens_per_image=16))
    square = "tokens_per_image=9 must be a square whose side divides the 8"
    for vision, message in [
        (dict(image_size=32, patch_size=4, tokens_per_image=15), "tokens_per_image=15 must be a square"),
        (dict(image_size=32, patch_size=4, tokens_per_image=9), square),
        (dict(image_size=30, patch_size=4, tokens_per_image=4), "image_size=30 must be a multiple of"),
        (dict(image_size=32, patch_size=4, tokens_per_image=16, image_token_id=16), "image_token_id=16"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_model(model(**vision))


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


def _conversations(rng, rows: int, T: int):
    """Token rows with one or two images each (BOI, 16 placeholders, EOI amid text) and each row's
    images in order, zeros past a row's own: [rows, T] ids, [rows, 2, 3, 32, 32] pixels."""
    image = [BOI, *[IMAGE] * 16, EOI]
    tokens, images = [], np.zeros((rows, 2, 3, 32, 32), np.float32)
    for r in range(rows):
        splits = [(5, 7), (10,), (0, 3), (20,)][r % 4]  # text between the images (a row's first: 1 or 2)
        row = [2]
        for i, text in enumerate(splits):
            row += [*rng.integers(3, 120, text), *image]
            images[r, i] = rng.standard_normal((3, 32, 32))
        tokens.append(row + list(rng.integers(3, 120, T - len(row))))
    return np.array(tokens), images


@pytest.mark.parametrize(
    "mesh_shape",
    [[[1, 1], ["fsdp", "tp"]], [[2, 2], ["fsdp", "tp"]], [[2, 2], ["dp", "fsdp"]]],
)
def test_logits_with_images_equal_transformers(tmp_path, mesh_shape):
    """A saved Gemma3ForConditionalGeneration (sliding window 6, shorter than an image) read whole by
    model.init_from's importer: logits of rows with one and two images equal transformers' (its
    token types mark the images, whose tokens attend to each other both ways). The bidirectional
    mask matters: transformers' logits without it differ."""
    from tunix_train import api

    _, model = _reference(TEXT)
    model.save_pretrained(tmp_path)
    tokens, images = _conversations(np.random.default_rng(0), 4, 64)
    per_row = [2, 1, 2, 1]
    pixels = np.concatenate([images[r, :n] for r, n in enumerate(per_row)])
    with torch.no_grad():
        ids = torch.from_numpy(tokens)
        expected, causal = (
            model(input_ids=ids, pixel_values=torch.from_numpy(pixels), token_type_ids=types).logits.numpy()
            for types in ((ids == IMAGE).long(), None)
        )
    assert np.abs(expected - causal).max() > 1e-2

    loaded = api.load(tmp_path, mesh_shape=mesh_shape, devices=jax.devices()[: np.prod(mesh_shape[0])])
    assert loaded.config.vision == VisionConfig(32, 4, 3, 32, 64, 2, 4, 1e-6, 16, IMAGE)
    np.testing.assert_allclose(loaded.logits(tokens, images=images), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "mesh_shape, overrides",
    [
        ([[2], ["cp"]], []),
        ([[2], ["cp"]], ["model.context_parallel_strategy=ring"]),
        ([[2], ["pp"]], ["training.pipeline_microbatches=2"]),
    ],
)
def test_images_under_cp_and_pp_give_one_devices_loss_and_gradients(mesh_shape, overrides):
    """gemma3_vision_tiny (tower trainable) on rows whose images straddle the cp chunks' edges (64
    tokens, 4 chunks of 16): the loss and every gradient, the tower's included, equal one device's.
    Under cp the rows come reordered and the images' tokens are found in the rows' own order."""
    from tunix_train.compose import load_config

    cfg, _ = load_config(
        ["model=gemma3_vision_tiny", "model.vision.trainable=true", "data.seq_len=64", *overrides]
    )
    image = [254, *[255] * 16, 253]  # each image's tokens cross a chunk edge (16, 32, 48)
    rng = np.random.default_rng(0)
    tokens = np.stack(
        [[2, *rng.integers(3, 250, 9), *image, *rng.integers(3, 250, 7), *image, *rng.integers(3, 250, 11)]]
        + [[2, *rng.integers(3, 250, 39), *image, *rng.integers(3, 250, 6)]]
    ).astype(np.int32)
    batch = {
        "inputs": tokens[None],
        "targets": np.roll(tokens, -1, axis=1)[None],
        "positions": np.broadcast_to(np.arange(64), (1, 2, 64)),
        "images": rng.standard_normal((1, 2, 2, 3, 32, 32)).astype(np.float32),
    }

    expected_loss, expected = image_loss_and_grads(cfg, batch, [[1], ["fsdp"]])
    loss, grads = image_loss_and_grads(cfg, batch, mesh_shape)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(grads)):
        # the keys' bias shifts every score of a query alike: its gradient is zero up to rounding
        scale = 1.0 if path[-2].key == "k_bias" else np.abs(want).max()
        assert scale > 0, path
        np.testing.assert_allclose(
            got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path)
        )


def _init(model_cfg):
    from tunix_train.model.factory import build_model

    return build_model(model_cfg, nnx.Rngs(0))


@pytest.mark.parametrize("trainable", [False, True])
def test_a_frozen_tower_gets_no_gradient_update_or_optimizer_state(trainable):
    """model.vision.trainable=false (the default): the images' embeddings carry no gradient into
    the tower, and AdamW keeps no moments for it nor decays it; true: it trains like the rest."""
    from tunix_train.compose import load_config
    from tunix_train.model.common import output_logits
    from tunix_train.train.forward import cross_entropy
    from tunix_train.train.optimizer import make_optimizer

    cfg, _ = load_config(
        ["model=gemma3_vision_tiny", f"model.vision.trainable={trainable}", "training.warmup_steps=0"]
    )
    model = _init(cfg.model)
    graphdef, params = nnx.split(model)
    tokens = np.array([[2, 254, *[255] * 16, 253, 7, 9, 11]])
    images = np.random.default_rng(0).standard_normal((1, 1, 3, 32, 32)).astype(np.float32)

    def loss(params):
        m = nnx.merge(graphdef, params)
        return cross_entropy(
            output_logits(m.hidden(tokens, images=images), m.output_table(), None), tokens
        ).sum()

    grads = jax.jit(jax.grad(loss))(params)
    optimizer, _ = make_optimizer(cfg.training, cfg.model)
    opt_state = jax.jit(optimizer.init)(params)
    updates, _ = jax.jit(optimizer.update)(grads, opt_state, params)
    tower_grad = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads["vision"]))
    tower_update = max(float(np.abs(u).max()) for u in jax.tree.leaves(updates["vision"]))
    text_update = float(np.abs(updates["embedding_VD"][...]).max())
    moments = sum(x.size for x in jax.tree.leaves(opt_state))
    tower_size = sum(x.size for x in jax.tree.leaves(params["vision"]))
    text_size = sum(x.size for x in jax.tree.leaves(params)) - tower_size
    assert text_update > 0
    if trainable:
        assert tower_grad > 0 and tower_update > 0 and moments >= 2 * (text_size + tower_size)
    else:
        assert tower_grad == tower_update == 0 and moments < 2 * text_size + tower_size


def test_greedy_generation_with_images_equals_transformers_and_each_request_its_solo_tokens(tmp_path):
    """16 greedy tokens after prompts with one and two images equal transformers' generate (its
    prefill with the images and their token types); the engine with 8 slots, 12 requests (two
    pairs alike, one pair the same prompt with other images) gives each the tokens it has alone."""
    from tunix_train import api

    _, model = _reference(TEXT)
    model.save_pretrained(tmp_path)
    tokens, images = _conversations(np.random.default_rng(1), 4, 56)
    per_row = [2, 1, 2, 1]
    expected = []
    with torch.no_grad():
        for r, n in enumerate(per_row):
            ids = torch.from_numpy(tokens[r : r + 1])
            out = model.generate(
                input_ids=ids,
                pixel_values=torch.from_numpy(images[r, :n]),
                token_type_ids=(ids == IMAGE).long(),
                max_new_tokens=16,
                do_sample=False,
            )
            expected.append(out[0, tokens.shape[1] :].tolist())
    loaded = api.load(tmp_path, mesh_shape=[[2], ["fsdp"]], devices=jax.devices()[:2])
    own = [images[r, :n] for r, n in enumerate(per_row)]
    solo = [loaded.generate([tokens[r]], 16, images=[own[r]])[0] for r in range(4)]
    assert solo == expected

    other = np.random.default_rng(9).standard_normal(own[1].shape).astype(np.float32)
    prompts = [tokens[r % 4] for r in range(12)]
    pictures = [own[r % 4] for r in range(12)]
    pictures[5] = other  # row 1's prompt with another image: not the same prefill
    alone = loaded.generate([prompts[5]], 16, images=[other])[0]
    assert alone != solo[1]
    loaded.engine.slots = 8
    together = loaded.generate(prompts, 16, images=pictures)
    assert together == [alone if r == 5 else solo[r % 4] for r in range(12)]
    assert loaded.engine.stats["prefix_hits"] > 0


def test_hf_export_of_a_vision_model_loads_in_transformers_with_its_logits(tmp_path):
    """A saved Gemma3ForConditionalGeneration read in and written out by ours loads in transformers
    (its published layout: language_model.model.*, vision_tower.vision_model.*); its logits with
    images equal the original's within 1e-5, and every tensor round-trips."""
    from safetensors.numpy import load_file

    from tunix_train import api
    from tunix_train.interop import hf

    _, model = _reference(TEXT)
    model.save_pretrained(tmp_path / "in")
    loaded = api.load(tmp_path / "in", mesh_shape=[[2, 2], ["fsdp", "tp"]], devices=jax.devices()[:4])
    hf.export(loaded.params, loaded.config, tmp_path / "out")
    again = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    tokens, images = _conversations(np.random.default_rng(2), 2, 64)
    pixels = torch.from_numpy(np.concatenate([images[0], images[1, :1]]))  # two images, then one
    with torch.no_grad():
        ids = torch.from_numpy(tokens)
        expected, got = (
            m(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits.numpy()
            for m in (model, again)
        )
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    written = load_file(tmp_path / "out" / "model.safetensors")

    def published(name):  # transformers 5's names in memory -> the published checkpoints'
        name = name.replace("model.language_model.", "language_model.model.").removeprefix("model.")
        return name.replace("vision_tower.", "vision_tower.vision_model.", 1)

    # the tied output layer, and SigLIP's pooling head, which Gemma 3 does not read (nor we keep)
    state = {
        published(n): t for n, t in model.state_dict().items() if n != "lm_head.weight" and ".head." not in n
    }
    assert set(state) == set(written)
    for name, tensor in state.items():
        np.testing.assert_array_equal(written[name], tensor.numpy(), err_msg=name)


VISION_DATA = [
    "model=gemma3_vision_tiny",
    "model.vocab_size=4104",  # the tokenizer's 4101, padded to divide tp
    "model.vision.image_token_id=4100",
    "data=chat",
    "data.seq_len=96",
    "data.eval_fraction=0",
    "data.images_per_row=2",
]


def _image_records(folder, rng):
    """Conversations about small PNGs beside the data file: by path, by data: URI, and by the
    record's `images` list (parts that name nothing), one or two images each, and one without."""
    import base64

    Image = pytest.importorskip("PIL.Image")
    (folder / "pics").mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(3):
        path = folder / "pics" / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (20 + 5 * i, 30, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    uri = "data:image/png;base64," + base64.b64encode(paths[2].read_bytes()).decode()

    def ask(*parts, answer="A square."):
        return [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": answer},
        ]

    image = {"type": "image"}
    return [
        {"messages": ask({"type": "image", "image": "pics/0.png"})},
        {
            "messages": ask(
                {"type": "image_url", "image_url": {"url": uri}}, {"type": "image", "path": "pics/1.png"}
            )
        },
        {"messages": ask(image, image, answer="Two."), "images": ["pics/1.png", "pics/0.png"]},
        {"messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hi."}]},
    ], paths


def test_conversations_with_images_become_rows_equal_to_transformers_processor(tmp_path):
    """Rows of a JSON-lines file of conversations with images (paths relative to it, a data: URI, a
    record's `images` list): each row's input ids and image token types equal transformers'
    Gemma3Processor on the same rendered text and images; its images are the files' pixel values
    in order (zeros past them); no image token carries loss; one conversation per row."""
    import json

    from PIL import Image

    from tunix_train.compose import load_config
    from tunix_train.data import Data
    from tunix_train.data.images import pixel_values

    records, paths = _image_records(tmp_path, np.random.default_rng(0))
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = vision_tokenizer(tmp_path / "tok")
    cfg, _ = load_config(
        [*VISION_DATA, f"data.train_files=[{tmp_path / 'chats.jsonl'}]", f"data.tokenizer={tokenizer}"]
    )
    data = Data(cfg)
    batches = data.train_batches(global_micro_batch=4)
    batch = next(iter(batches))
    batches.close()
    assert batch["images"].shape == (1, 4, 2, 3, 32, 32)

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=hf_tokenizer,
        image_seq_length=16,
    )
    files = {0: [paths[0]], 1: [paths[2], paths[1]], 2: [paths[1], paths[0]], 3: []}
    seen = set()
    for row, inputs, n, record, text in _batch_rows(batch, records, data, tmp_path):
        seen.add(record)
        images = [Image.open(p) for p in files[record]]
        expected = processor(
            text=[text], images=[images] if images else None, add_special_tokens=False, return_tensors="np"
        )
        want = np.append(inputs[:n], batch["targets"][0, row, n - 1])
        np.testing.assert_array_equal(want, expected["input_ids"][0])
        np.testing.assert_array_equal(want == 4100, expected["token_type_ids"][0] == 1)
        for i, p in enumerate(files[record]):
            np.testing.assert_array_equal(batch["images"][0, row, i], pixel_values(Image.open(p), 32))
        assert not batch["images"][0, row, len(files[record]) :].any()
        assert not batch["loss_mask"][0, row][inputs == 4100].any() and batch["loss_mask"][0, row].any()
    assert seen == {0, 1, 2, 3}


def _batch_rows(batch, records, data, folder):
    """Each row of a batch's first micro-batch: (row, its inputs, its token count, the index of the
    record it holds, that record's text as the chat template renders it)."""
    from tunix_train.data.images import split_images

    for row in range(batch["inputs"].shape[1]):
        inputs = batch["inputs"][0, row]
        n = int(batch["segment_ids"][0, row].sum())
        record = next(
            i
            for i, r in enumerate(records)
            if data.features(_doc(r, folder))["inputs"].tolist() == inputs[:n].tolist()
        )
        text, _ = data.chat.render(split_images(records[record]["messages"])[0])
        yield row, inputs, n, record, text


def _doc(record, folder):
    return {
        "messages": record["messages"],
        "where": "t",
        "folder": str(folder),
        **({"images": record["images"]} if "images" in record else {}),
    }


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda r, f: r[0]["messages"][0]["content"].__setitem__(
                0, {"type": "image", "image": "pics/none.png"}
            ),
            "no such file",
        ),
        (
            lambda r, f: r[0]["messages"][0]["content"].__setitem__(
                0, {"type": "image", "image": "../outside.png"}
            ),
            "outside the data file's folder",
        ),
        (
            lambda r, f: (f / "pics" / "0.png").write_bytes((f / "pics" / "0.png").read_bytes()[:60]),
            "cannot be read",
        ),
        (lambda r, f: (f / "pics" / "0.png").write_bytes(b""), "not a PNG, JPEG, GIF, WEBP, BMP image"),
        (
            lambda r, f: r[0]["messages"][0]["content"].__setitem__(
                0, {"type": "image", "image": "https://example.com/a.png"}
            ),
            "is a URL",
        ),
        (
            lambda r, f: r[2]["images"].append("pics/2.png"),
            "2 image parts name no image but its record's images field holds 3",
        ),
        (
            lambda r, f: r[2]["images"].pop(),
            "2 image parts name no image but its record's images field holds 1",
        ),
        (
            lambda r, f: r[2]["messages"][0]["content"].insert(0, {"type": "image", "image": "pics/2.png"}),
            "3 images, more than data.images_per_row=2",
        ),
        (
            "data.seq_len=48",
            "jsonl:2: a conversation of 67 tokens .its images' included. is longer than a row of data",
        ),
        ("model.vision=null", "a conversation with images, but this model reads none"),
        ("template", "1 images but the chat template placed 0"),
    ],
)
def test_bad_images_in_conversations_are_one_line_naming_the_record(tmp_path, change, message):
    import json

    from tunix_train.compose import load_config
    from tunix_train.config import ConfigError
    from tunix_train.data import Data

    records, _ = _image_records(tmp_path, np.random.default_rng(0))
    overrides = []
    if change == "template":  # a template that ignores image parts
        (tmp_path / "t.jinja").write_text(
            "{% for m in messages %}"
            "{{ m['content'] if m['content'] is string else m['content'][-1]['text'] }}{% endfor %}"
        )
        overrides = [f"data.chat_template={tmp_path / 't.jinja'}"]
    elif isinstance(change, str):
        overrides = [change]
    else:
        change(records, tmp_path)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg, _ = load_config(
        [
            *VISION_DATA,
            f"data.train_files=[{tmp_path / 'chats.jsonl'}]",
            f"data.tokenizer={vision_tokenizer(tmp_path / 'tok')}",
            *overrides,
        ]
    )
    with pytest.raises(ConfigError, match=message) as err:
        Data(cfg)
    assert "\n" not in str(err.value) and "chats.jsonl:" in str(err.value)


@pytest.mark.slow
def test_training_on_conversations_with_images_resumes_bit_identically(tmp_path):
    """SFT of gemma3_vision_tiny on the image conversations over fsdp2 x tp2: stopped after 2 steps
    and resumed, the 4th step's parameters equal an uninterrupted run's bit for bit (the image
    rows' data position included); the frozen tower is where it started; the loss is finite."""
    import json

    import orbax.checkpoint as ocp
    from conftest import assert_same_parameters, straight_and_resumed, train_losses

    from tunix_train.compose import load_config

    records, _ = _image_records(tmp_path, np.random.default_rng(0))
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records * 3))
    tokenizer = vision_tokenizer(tmp_path / "tok")

    cfg, _ = load_config(
        [
            *VISION_DATA,
            f"data.train_files=[{tmp_path / 'chats.jsonl'}]",
            f"data.tokenizer={tokenizer}",
            'model.mesh_shape=[[2,2],["fsdp","tp"]]',
            "training.micro_batch_size=4",
            "training.log_every=1",
            "training.eval_every=0",
            "checkpoint.every_steps=2",
        ]
    )
    straight, resumed = straight_and_resumed(cfg, tmp_path, 4, 2, jax.devices()[:4])
    assert_same_parameters(straight, resumed, 4)
    losses = train_losses(straight)
    assert len(losses) == 4 and np.isfinite(losses).all()
    assert train_losses(resumed)[-2:] == losses[-2:]
    first, last = (
        ocp.StandardCheckpointer().restore((run / "checkpoints" / str(step) / "state").resolve())
        for run, step in ((resumed, 2), (straight, 4))
    )
    np.testing.assert_array_equal(
        np.asarray(first["params"]["vision"]["projection"]["value"]),
        np.asarray(last["params"]["vision"]["projection"]["value"]),
    )


def _vision_checkpoint(directory):
    """A saved random Gemma3ForConditionalGeneration whose vocabulary is the vision tokenizer's
    (written beside it), and that tokenizer as transformers reads it."""
    torch.manual_seed(0)
    config = transformers.Gemma3Config(
        text_config=dict(TEXT, vocab_size=4104),
        vision_config=VISION,
        mm_tokens_per_image=16,
        image_token_index=4100,
        boi_token_index=4098,
        eoi_token_index=4099,
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0.0, 0.5)
    model.save_pretrained(directory)
    vision_tokenizer(directory)
    return model, transformers.AutoTokenizer.from_pretrained(directory)


def _transformers_continuation(model, tokenizer, text, image, stops):
    """transformers' 12 greedy tokens after `text` with `image` (Gemma3Processor's ids and token
    types), up to the first of `stops`."""
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
        image_seq_length=16,
    )
    inputs = processor(text=[text], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    return next((new[:i] for i, t in enumerate(new) if t in stops), new)


def test_generate_image_and_chat_image_give_transformers_tokens(tmp_path, monkeypatch, capsys):
    """`python -m tunix_train.generate DIR --prompt "<start_of_image>..." --image FILE` prints the
    prompt and the text of transformers' greedy tokens for the same prompt and image; in --chat,
    `/image FILE` puts the image in the next turn, and the reply is transformers' tokens after the
    chat template's prompt."""
    import io

    from PIL import Image

    from tunix_train.data.chat import GEMMA_TEMPLATE, ChatTemplate
    from tunix_train.data.tokenizer import load_tokenizer
    from tunix_train.generate.__main__ import main

    model, hf_tokenizer = _vision_checkpoint(tmp_path / "ckpt")
    picture = tmp_path / "pic.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 24, 3), dtype=np.uint8)).save(picture)
    ours = load_tokenizer(tmp_path / "ckpt", 4104)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

    prompt = "<start_of_image>What is it?"
    expected = _transformers_continuation(model, hf_tokenizer, prompt, Image.open(picture), {1})
    args = [str(tmp_path / "ckpt"), "--max_new_tokens", "12"]
    assert main([*args, "--prompt", prompt, "--image", str(picture)]) == 0
    assert capsys.readouterr().out == prompt + ours.decode(expected) + "\n"

    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    chat_prompt = ChatTemplate(GEMMA_TEMPLATE, "t", ours).render(conversation, add_generation_prompt=True)[0]
    expected = _transformers_continuation(
        model, hf_tokenizer, chat_prompt.removeprefix("<s>"), Image.open(picture), {1, 4097}
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(f"/image {picture}\nDescribe.\n"))
    assert main([*args, "--chat"]) == 0
    assert capsys.readouterr().out == ours.decode(expected) + "\n"


@pytest.mark.slow  # three generations of the CLI
def test_speculative_generation_of_an_image_prompt_gives_the_plain_tokens(tmp_path, monkeypatch, capsys):
    """`generate --image` with --prompt_lookup and with --draft (the model as its own draft, which
    prefills the image too) prints what it prints without them (greedy: the same tokens)."""
    from PIL import Image

    from tunix_train.generate.__main__ import main

    _vision_checkpoint(tmp_path / "ckpt")
    picture = tmp_path / "pic.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 24, 3), dtype=np.uint8)).save(picture)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    args = [str(tmp_path / "ckpt"), "--max_new_tokens", "12", "--prompt", "<start_of_image>What is it?"]
    assert main([*args, "--image", str(picture)]) == 0
    plain = capsys.readouterr().out
    for speculation in (["--prompt_lookup", "2"], ["--draft", str(tmp_path / "ckpt")]):
        assert main([*args, "--image", str(picture), *speculation]) == 0
        out = capsys.readouterr()
        assert out.out == plain and "speculative decoding accepted" in out.err


@pytest.mark.slow
def test_the_server_answers_an_image_as_the_chat_does_and_refuses_remote_files_and_large_ones(tmp_path):
    """The official openai client sends an image as a data: URI: the reply is the text the chat
    (and `generate --chat` with /image) gives for the same conversation. A remote URL is a 400
    (without --allow_remote_images), a file: URL too, and a 20 MB image a 413."""
    import base64
    import subprocess
    import sys
    import time
    import urllib.request

    from conftest import REPO, cpu_env
    from PIL import Image

    openai = pytest.importorskip("openai")
    from tunix_train import api

    _vision_checkpoint(tmp_path / "ckpt")
    picture = tmp_path / "pic.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 24, 3), dtype=np.uint8)).save(picture)
    uri = "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tunix_train.serve",
            str(tmp_path / "ckpt"),
            "--port",
            str(port),
            "--name",
            "v",
        ]
        + ["--max_len", "96", "--max_body_bytes", str(64 << 20), "--mesh_shape", '[[1],["fsdp"]]'],
        cwd=REPO,
        env=cpu_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                assert process.poll() is None, process.stderr.read()[-2000:]
                time.sleep(0.25)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(url):
            content = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Describe."},
            ]
            return client.chat.completions.create(
                model="v", messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0
            )

        got = ask(uri).choices[0].message.content
        model = api.load(tmp_path / "ckpt", mesh_shape=[[1], ["fsdp"]], devices=jax.devices()[:1])
        conversation = [
            {
                "role": "user",
                "content": [{"type": "image", "image": str(picture)}, {"type": "text", "text": "Describe."}],
            }
        ]
        assert got == "".join(model.reply(conversation, 12)) and got
        for url, status in [
            ("https://example.com/a.png", 400),
            (f"file://{picture}", 400),
            (str(picture), 400),
        ]:
            with pytest.raises(openai.APIStatusError) as err:
                ask(url)
            assert err.value.status_code == status
        big = "data:image/png;base64," + base64.b64encode(b"\0" * 20_000_000).decode()
        with pytest.raises(openai.APIStatusError) as err:
            ask(big)
        assert err.value.status_code == 413 and "--max_image_bytes" in str(err.value)
        assert ask(uri).choices[0].message.content == got  # still serving
    finally:
        process.kill()


@pytest.mark.slow
def test_lora_and_qlora_with_a_frozen_tower_start_at_the_base_loss_and_train(tmp_path):
    """On the image conversations over fsdp2 x tp2 (head_dim 64, so nf4's blocks fit): LoRA's first
    loss is the full model's (its adapters start at zero; the tower and base frozen), QLoRA nf4's
    within 2% of it, and both fall over 5 steps."""
    import json

    from conftest import train_losses

    from tunix_train.compose import load_config
    from tunix_train.train.loop import train

    records, _ = _image_records(tmp_path, np.random.default_rng(0))
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records * 4))
    tokenizer = vision_tokenizer(tmp_path / "tok")

    def losses(name, *overrides):
        cfg, _ = load_config(
            [
                *VISION_DATA,
                f"data.train_files=[{tmp_path / 'chats.jsonl'}]",
                f"data.tokenizer={tokenizer}",
                'model.mesh_shape=[[2,2],["fsdp","tp"]]',
                "model.head_dim=64",
                "training.micro_batch_size=4",
                "training.max_steps=5",
                "training.warmup_steps=0",
                "training.learning_rate=0.01",
                "training.log_every=1",
                "training.eval_every=0",
                *overrides,
            ]
        )
        train(cfg, tmp_path / name, devices=jax.devices()[:4])
        return np.array(train_losses(tmp_path / name))

    full = losses("full")
    lora = losses("lora", "training.lora.rank=4", "training.lora.targets=[q,k,v,o,gate,up,down]")
    nf4 = losses(
        "nf4",
        "training.lora.rank=4",
        "training.lora.targets=[q,k,v,o,gate,up,down]",
        "training.lora.base_quantization=nf4",
    )
    np.testing.assert_allclose(lora[0], full[0], rtol=1e-6)
    np.testing.assert_allclose(nf4[0], full[0], rtol=2e-2)
    assert lora[-1] < 0.8 * lora[0] and nf4[-1] < 0.8 * nf4[0], (lora, nf4)


def _grpo_on_image_prompts(tmp_path, n: int, *overrides):
    """The config of a GRPO run on n prompts, each with one of the _image_records pictures (in turn),
    6 new tokens and image_prompt_reward."""
    import json

    from tunix_train.compose import load_config

    _image_records(tmp_path, np.random.default_rng(0))
    question = {"type": "text", "text": "What is it?"}
    prompts = [
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": f"pics/{i % 3}.png"}, question]}]}
        for i in range(n)
    ]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    cfg, _ = load_config(
        [
            *[o for o in VISION_DATA if not o.startswith("data=")],
            "objective=grpo",
            "data=jsonl",
            f"data.train_files=[{tmp_path / 'prompts.jsonl'}]",
            f"data.tokenizer={vision_tokenizer(tmp_path / 'tok')}",
            "training.rollout.max_new_tokens=6",
            "training.rollout.reward=[test_vision:image_prompt_reward]",
            *overrides,
        ]
    )
    return cfg


def image_prompt_reward(prompts, completions, **_):
    """A GRPO reward that checks it receives each prompt with its image (an absolute path)."""
    from pathlib import Path

    for prompt in prompts:
        (image,) = [p for p in prompt[-1]["content"] if p["type"] == "image"]
        assert Path(image["image"]).is_absolute() and Path(image["image"]).is_file()
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("images", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_grpo_samples_and_trains_on_prompts_with_images(tmp_path, images):
    """GRPO on prompts each with an image (fsdp2 x tp2): the engine samples with the image and the
    step computes the same log-probabilities (the train-inference mismatch under 1e-4). With the
    step's images removed from the rows (images=False: the rows as if images were lost) the
    mismatch is large: the images reach both sides."""

    from conftest import read_metrics

    from tunix_train.train.loop import train
    from tunix_train.train.objectives import grpo

    cfg = _grpo_on_image_prompts(
        tmp_path,
        8,
        'model.mesh_shape=[[2,2],["fsdp","tp"]]',
        "training.micro_batch_size=4",
        "training.rollout.num_generations=4",
        "training.max_steps=1",
        "training.log_every=1",
    )
    if not images:
        real = grpo.OnPolicy._rows_of

        def without_images(self, rollout, state=None):
            rows = real(self, rollout, state)
            rows["images"] = np.zeros_like(rows["images"])
            return rows

        import unittest.mock

        patch = unittest.mock.patch.object(grpo.OnPolicy, "_rows_of", without_images)
        patch.start()
    try:
        train(cfg, tmp_path / "run", devices=jax.devices()[:4])
    finally:
        if not images:
            patch.stop()
    steps = [m for m in read_metrics(tmp_path / "run") if "logprob_mismatch_max" in m]
    assert len(steps) == 1 and all(np.isfinite(m["loss"]) for m in steps)
    mismatch = max(m["logprob_mismatch_max"] for m in steps)
    assert mismatch < 1e-4 if images else mismatch > 1e-2, mismatch


def test_an_id_past_the_tokenizers_pieces_decodes_to_no_text():
    """A model whose vocabulary is padded past its tokenizer's (4104 over 4101 here) may sample an id
    the tokenizer lacks: it decodes to nothing (SentencePiece raised, and ended a GRPO run)."""
    from tunix_train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None, 4096)
    assert tokenizer.decode([400, 4100, 401, -1]) == tokenizer.decode([400, 401]) != ""


@pytest.mark.slow  # 12 steps, about a minute
def test_dpo_on_image_grounded_pairs_reads_the_images_and_learns_them(tmp_path):
    """DPO of gemma3_vision_tiny (tower trainable) on pairs whose right answer is the colour of the
    prompt's image (the same words either way): the rows carry each pair's image (a part's own, or
    the record's `images` list beside the data file), the first step's loss is log 2, and the
    policy learns to prefer the image's colour: the reward margin grows and the loss falls. An image
    in an answer is one line."""
    import json
    import math

    from conftest import train_losses
    from PIL import Image

    from tunix_train.compose import load_config
    from tunix_train.data import Data
    from tunix_train.train.loop import train
    from tunix_train.train.objectives import make_objective

    (tmp_path / "pics").mkdir()
    colours = {"red": (220, 30, 30), "blue": (30, 30, 220)}
    for name, rgb in colours.items():
        Image.new("RGB", (32, 32), rgb).save(tmp_path / "pics" / f"{name}.png")
    records = []
    for i in range(16):
        right, wrong = ("red", "blue") if i % 2 else ("blue", "red")
        part = {"type": "image", "image": f"pics/{right}.png"} if i % 4 < 2 else {"type": "image"}
        record = {
            "prompt": [{"role": "user", "content": [part, {"type": "text", "text": "Which colour?"}]}],
            "chosen": right,
            "rejected": wrong,
        }
        if "image" not in part:
            record["images"] = [f"pics/{right}.png"]
        records.append(record)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = vision_tokenizer(tmp_path / "tok")
    overrides = [
        *VISION_DATA,
        "data=jsonl",
        "objective=dpo",
        "model.vision.trainable=true",
        f"data.train_files=[{tmp_path / 'pairs.jsonl'}]",
        f"data.tokenizer={tokenizer}",
        "data.images_per_row=1",
        "training.micro_batch_size=8",
        "training.max_steps=12",
        "training.learning_rate=3e-3",
        "training.warmup_steps=0",
        "training.log_every=1",
        "training.eval_every=0",
        'model.mesh_shape=[[2],["fsdp"]]',
    ]
    cfg, _ = load_config(overrides)
    objective = make_objective(cfg)
    objective.read(Data(cfg, objective.record_fields))
    pair = objective._pairs["train"][0]  # record 1: blue, its image its part's own
    assert pair["images"].shape == (2, 1, 3, 32, 32)
    assert pair["images"][0, 0, 2].mean() > 0.5 > pair["images"][0, 0, 0].mean()  # blue, both rows
    np.testing.assert_array_equal(pair["images"][0], pair["images"][1])
    listed = objective._pairs["train"][2]  # record 3: its image from the record's list
    assert listed["images"][0, 0, 2].mean() > 0.5

    train(cfg, tmp_path / "run", devices=jax.devices()[:2])
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert steps[-1]["reward_margin"] > 0.1 and train_losses(tmp_path / "run")[-1] < math.log(2) - 0.1

    records[0]["chosen"] = [{"role": "assistant", "content": [{"type": "image", "image": "pics/red.png"}]}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg, _ = load_config([*overrides, f"data.train_files=[{tmp_path / 'bad.jsonl'}]"])
    with pytest.raises(ConfigError, match="pair 1: an image in its chosen; images belong in the prompt"):
        make_objective(cfg).read(Data(cfg, ("prompt", "chosen", "rejected")))


@pytest.mark.slow  # a training run and an export
def test_a_reward_model_on_images_learns_them_and_exports_as_transformers_gemma3_with_a_head(tmp_path):
    """objective=reward on gemma3_vision_tiny (tower trainable), pairs whose right answer is the
    colour of the prompt's image: each answer is chosen as often as rejected, so only the image
    tells them apart. The held-out pairs (other records, the same two colours) go from at most half
    ranked right to all of them. The export is transformers' Gemma3ForSequenceClassification: it
    loads with nothing missing, and its scores of the held-out pairs (their rows and images as
    ours, read at the EOS) average to our evaluation's eval_reward_chosen and eval_reward_rejected
    (1e-4) and rank them alike. As a GRPO reward model, which reads text only, it is one line."""
    import json

    from conftest import read_metrics
    from PIL import Image

    from tunix_train import export
    from tunix_train.compose import load_config
    from tunix_train.data import Data
    from tunix_train.train.loop import train
    from tunix_train.train.objectives import make_objective
    from tunix_train.train.objectives.reward_models import RewardModels

    (tmp_path / "pics").mkdir()
    for name, rgb in {"red": (220, 30, 30), "blue": (30, 30, 220)}.items():
        Image.new("RGB", (32, 32), rgb).save(tmp_path / "pics" / f"{name}.png")

    def pairs(name, count, offset):
        records = []
        for i in range(offset, offset + count):
            right, wrong = ("red", "blue") if i % 2 else ("blue", "red")
            part = {"type": "image", "image": f"pics/{right}.png"}
            prompt = [{"role": "user", "content": [part, {"type": "text", "text": f"Colour {i}?"}]}]
            records.append({"prompt": prompt, "chosen": right, "rejected": wrong})
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
        return tmp_path / name

    overrides = [
        *VISION_DATA,
        "data=jsonl",
        "objective=reward",
        "model.vision.trainable=true",
        f"data.train_files=[{pairs('train.jsonl', 32, 0)}]",
        f"data.eval_files=[{pairs('eval.jsonl', 8, 100)}]",
        f"data.tokenizer={vision_tokenizer(tmp_path / 'tok')}",
        "data.images_per_row=1",
        "training.micro_batch_size=8",
        "training.max_steps=12",
        "training.learning_rate=3e-3",
        "training.warmup_steps=0",
        "training.eval_every=12",
        "training.eval_batches=1",
        'model.mesh_shape=[[2],["fsdp"]]',
    ]
    cfg, _ = load_config(overrides)
    train(cfg, tmp_path / "run", devices=jax.devices()[:2])
    evals = [m for m in read_metrics(tmp_path / "run") if "eval_accuracy" in m]
    assert evals[0]["eval_accuracy"] <= 0.5 and evals[-1]["eval_accuracy"] == 1.0, evals
    assert export.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert type(model).__name__ == "Gemma3ForSequenceClassification"
    assert not any(info.values()), info

    objective = make_objective(cfg)
    objective.read(Data(cfg, objective.record_fields))
    scores, image = [], cfg.model.vision.image_token_id
    with torch.no_grad():
        for pair in objective._pairs["eval"]:
            for row in range(2):
                end = int(np.argmax(pair["loss_mask"][row])) + 1  # through the EOS, where it is read
                ids = torch.from_numpy(pair["inputs"][row, :end][None].astype(np.int64))
                pixels = torch.from_numpy(pair["images"][row])
                out = model.eval()(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == image).long())
                scores.append(float(out.logits[0, 0]))
    scores = np.array(scores).reshape(-1, 2)
    assert scores[:, 0].mean() == pytest.approx(evals[-1]["eval_reward_chosen"], abs=1e-4)
    assert scores[:, 1].mean() == pytest.approx(evals[-1]["eval_reward_rejected"], abs=1e-4)
    assert (scores[:, 0] > scores[:, 1]).all()

    grpo, _ = load_config(
        [
            *VISION_DATA,
            "objective=grpo",
            "data=jsonl",
            "data.train_files=[x.jsonl]",
            f"data.tokenizer={tmp_path / 'tok'}",
            "training.rollout.reward=[]",
            f"training.rollout.reward_models=[{tmp_path / 'hf'}]",
        ]
    )
    with pytest.raises(
        ConfigError, match="has an image tower .*GRPO's reward models read the completions' text"
    ):
        RewardModels(grpo)


def test_a_reward_models_config_json_is_gemma3s_sequence_classifier_and_gemma4s_is_one_line():
    """With model.score_head, a Gemma 3 tower's config.json is transformers'
    Gemma3ForSequenceClassification with one label at the top level (where transformers reads it);
    Gemma 4 has no class with a scalar head, so its export is a one-line error."""
    from tunix_train.compose import load_config
    from tunix_train.interop import hf

    gemma3 = dataclasses.replace(load_config(["model=gemma3_vision_tiny"])[0].model, score_head=True)
    written = hf.hf_config(gemma3)
    assert written["architectures"] == ["Gemma3ForSequenceClassification"] and written["num_labels"] == 1
    assert "num_labels" not in written["text_config"]
    assert hf.hf_config(dataclasses.replace(gemma3, score_head=False))["architectures"] == [
        "Gemma3ForConditionalGeneration"
    ]
    gemma4 = dataclasses.replace(load_config(["model=gemma4_vision_tiny"])[0].model, score_head=True)
    with pytest.raises(ConfigError, match="transformers has no gemma4 model with a scalar head"):
        hf.hf_config(gemma4)


def written_mmproj(model, tmp_path):
    """transformers' `model` saved, loaded by ours (fsdp 2), its tower written as an mmproj GGUF
    (f32): (model, the LoadedModel, a gguf reader of the file)."""
    import gguf

    from tunix_train import api
    from tunix_train.interop import gguf_mmproj

    model.save_pretrained(tmp_path / "hf")
    loaded = api.load(tmp_path / "hf", mesh_shape=[[2], ["fsdp"]], devices=jax.devices()[:2])
    gguf_mmproj.export(loaded.params, loaded.config, tmp_path / "mmproj.gguf", "f32")
    return model, loaded, gguf.GGUFReader(tmp_path / "mmproj.gguf")


def test_the_mmproj_gguf_reads_back_as_the_towers_tensors(tmp_path):
    """The image tower of a loaded Gemma 3 written as llama.cpp's mmproj file, read back with the
    gguf reader: its metadata as convert_hf_to_gguf.py --mmproj writes it for Gemma 3 (clip,
    projector gemma3, the sizes, mean and std 0.5, the scale factor of a tower that pools other
    than 4 x 4), and every tensor of transformers' tower under its mmproj name, equal (F32), or
    equal as F16 (the input projection), the projector's norm as 1 + w."""
    gguf = pytest.importorskip("gguf")
    from tunix_train.interop import gguf_mmproj

    model, loaded, reader = written_mmproj(_reference()[1], tmp_path)

    def field(key):
        return reader.fields[key].contents()

    assert field("general.architecture") == "clip" and field("general.type") == "mmproj"
    assert field("clip.projector_type") == "gemma3" and field("clip.has_vision_encoder") is True
    sizes = {"image_size": 32, "patch_size": 4, "embedding_length": 32, "feed_forward_length": 64}
    for key, value in {**sizes, "block_count": 2, "projection_dim": SIZES["hidden_size"]}.items():
        assert field(f"clip.vision.{key}") == value, key
    assert field("clip.vision.attention.head_count") == 4
    assert field("clip.vision.image_mean") == pytest.approx([0.5] * 3)
    assert field("clip.vision.projector.scale_factor") == 2  # 8 patches a side pooled to 4 tokens

    theirs = {  # SigLIP's pooling head, which Gemma 3 does not read, aside
        n: t.numpy()
        for n, t in model.state_dict().items()
        if ("vision_tower" in n or "projector" in n) and ".head." not in n
    }
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 2)
    read = {t.name: t for t in reader.tensors}
    assert len(read) == len(theirs)
    for name, want in theirs.items():
        name = name.removeprefix("model.").replace("vision_tower.", "vision_tower.vision_model.", 1)
        name = name.replace("mm_input_projection_weight", "mm_input_projection.weight")
        tensor = read[names.get_name(name, try_suffixes=(".weight", ".bias"))]
        got = np.asarray(tensor.data).reshape(want.shape)
        if tensor.name == "mm.soft_emb_norm.weight":
            want = want + 1
        if tensor.name == "mm.input_projection.weight":
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F16
            np.testing.assert_array_equal(got, want.astype(np.float16))
        else:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.name
            np.testing.assert_array_equal(got, want)

    with pytest.raises(ConfigError, match="mmproj.gguf exists: pass --overwrite"):
        gguf_mmproj.export(loaded.params, loaded.config, tmp_path / "mmproj.gguf")
    text_only = dataclasses.replace(loaded.config, vision=None)
    with pytest.raises(ConfigError, match="--mmproj: this model has no image tower"):
        gguf_mmproj.export(loaded.params, text_only, tmp_path / "other.gguf")


def test_grpo_turns_carry_the_prompts_images_in_every_request(tmp_path):
    """GRPO with an environment (it asks again after the answer): the conversation's first prompt
    holds its image's tokens, and every turn's request to the engine carries the prompt's image.
    The engine is a stand-in that ends each turn at once (a random model rarely ends its turn)."""

    from tunix_train.data import Data
    from tunix_train.generate.session import Completion
    from tunix_train.train.objectives import make_objective

    cfg = _grpo_on_image_prompts(
        tmp_path,
        3,
        "training.rollout.num_generations=2",
        "training.rollout.environment=tests.test_tools:Checker",
        "training.rollout.max_turns=3",
    )
    objective = make_objective(cfg)
    data = Data(cfg, objective.record_fields)
    objective.read(data)
    sampler, seen = objective.sampler, []
    end_of_turn = data.chat.end_of_turn_id()

    class Engine:
        record_routes, speculation, lookahead, stats = False, None, 0, collections.Counter()

        def generate(self, params, requests, max_len, draft_params=None):
            seen.extend(requests)
            return [Completion([7, 8], [-1.0, -1.0], "stop", end_of_turn, -1.0) for _ in requests]

    sampler.engine = Engine()
    docs = sampler.docs
    out = sampler.complete(docs, sampler.prompts, None, None, seed=0, stream=0)
    assert out["turns"] == [2, 2, 2] and len(seen) == 6  # the answer, then once more after "Sure?"
    for request in seen:
        i = request.stream % 3
        np.testing.assert_array_equal(request.images, sampler.images[id(docs[i])])
        assert request.prompt.count(4100) == 16  # the image's tokens, in every turn's prompt


def test_peft_applies_adapters_in_the_tower_and_the_text_model_with_our_logits(tmp_path):
    """LoRA adapters on a loaded Gemma3ForConditionalGeneration (q and v of the text model, q, out,
    up and down of SigLIP; B drawn, not zero) written in PEFT's format: PeftModel on transformers'
    model gives the logits with images ours give (the text modules under model.language_model,
    the tower's under model.vision_tower; target_modules a pattern, as the tower's modules share
    the text model's names)."""
    pytest.importorskip("peft")
    from peft import PeftModel

    from tunix_train import api
    from tunix_train.config import LoraConfig
    from tunix_train.interop import peft as our_peft
    from tunix_train.model.factory import build_model
    from tunix_train.model.weights import Weights

    _, model = _reference(TEXT)
    model.save_pretrained(tmp_path / "base")
    loaded = api.load(tmp_path / "base", mesh_shape=[[1], ["fsdp"]], devices=jax.devices()[:1])
    lora = LoraConfig(
        rank=4, alpha=8.0, targets=["q", "v", "vision_q", "vision_out", "vision_up", "vision_down"]
    )
    adapted = build_model(loaded.config, nnx.Rngs(0), lora=lora)
    adapters, _ = Weights(lora, False).split(nnx.state(adapted, nnx.Param))
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: x + 0.2 * rng.standard_normal(x.shape).astype(np.float32), adapters)
    tokens, images = _conversations(np.random.default_rng(4), 2, 64)
    ours = nnx.merge(nnx.graphdef(adapted), loaded.params, adapters)(tokens, images=images)

    our_peft.export(adapters, loaded.config, lora, tmp_path / "adapters")
    pixels = torch.from_numpy(np.concatenate([images[0], images[1, :1]]))  # two images, then one
    with torch.no_grad():
        ids = torch.from_numpy(tokens)
        plain = model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits.numpy()
        peft_model = PeftModel.from_pretrained(model, tmp_path / "adapters").eval()
        theirs = peft_model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long()).logits
    tower_adapted = [n for n, _ in peft_model.named_modules() if "vision_tower" in n and n.endswith("lora_A")]
    assert len(tower_adapted) == 2 * 4  # two layers, four projections
    assert np.abs(theirs.numpy() - plain).max() > 1e-2  # the adapters change the model
    np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-4, rtol=0)


def test_pan_and_scan_rows_equal_transformers_processor(tmp_path):
    """data.pan_and_scan_crops=4: a 900 x 300 image is followed by its three crops, introduced in
    Gemma3Processor's words; the row's ids and image token types equal transformers' processor
    with do_pan_and_scan, and its images equal the processor's pixel values (the image, then its
    crops, then the square image, which has none)."""
    import json

    from PIL import Image

    from tunix_train.compose import load_config
    from tunix_train.data import Data
    from tunix_train.data.images import split_images

    rng = np.random.default_rng(0)
    (tmp_path / "pics").mkdir()
    for name, size in (("long", (900, 300)), ("square", (40, 40))):
        array = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(array).save(tmp_path / "pics" / f"{name}.png")
    parts = [{"type": "image", "image": "pics/long.png"}, {"type": "image", "image": "pics/square.png"}]
    record = {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "Two."},
        ]
    }
    (tmp_path / "chats.jsonl").write_text(json.dumps(record) + "\n")
    tokenizer = vision_tokenizer(tmp_path / "tok")
    cfg, _ = load_config(
        [
            *VISION_DATA,
            "data.seq_len=160",
            "data.images_per_row=6",
            "data.pan_and_scan_crops=4",
            f"data.train_files=[{tmp_path / 'chats.jsonl'}]",
            f"data.tokenizer={tokenizer}",
        ]
    )
    data = Data(cfg)
    row = data.features({"messages": record["messages"], "where": "t", "folder": str(tmp_path)})
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=transformers.AutoTokenizer.from_pretrained(tokenizer),
        image_seq_length=16,
    )
    text, _ = data.chat.render(split_images(record["messages"])[0])
    images = [Image.open(tmp_path / "pics" / n) for n in ("long.png", "square.png")]
    expected = processor(
        text=[text], images=[images], do_pan_and_scan=True, add_special_tokens=False, return_tensors="np"
    )
    assert expected["pixel_values"].shape == (5, 3, 32, 32)  # the long image, its 3 crops, the square
    ids = np.append(row["inputs"], row["targets"][-1])
    np.testing.assert_array_equal(ids, expected["input_ids"][0])
    np.testing.assert_array_equal(ids == 4100, expected["token_type_ids"][0] == 1)
    assert row["images"].shape == (5, 3, 32, 32)
    np.testing.assert_allclose(row["images"], expected["pixel_values"], atol=1e-6, rtol=0)
    cfg.data.images_per_row = 3  # checked at start-up, naming the record
    with pytest.raises(
        ConfigError, match=r"chats.jsonl:1: 2 images and their 3 crops, more than data.images_per_row=3"
    ):
        Data(cfg)
