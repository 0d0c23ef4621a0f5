"""Images as Gemma 3's image processor prepares them: RGB, resized to the tower's square with
Pillow's bilinear filter, scaled to [0, 1], then normalised with mean 0.5 and std 0.5 per channel:
pixel values [3, size, size] in float32 (transformers' Gemma3ImageProcessor with its defaults,
its Pillow backend), and pan-and-scan's crops of a long image. Files are untrusted: an unreadable,
truncated, empty or oversized image is one line naming the file.

And images in conversations: the content parts that name them (transformers' processors' format),
what each names (a path beside the data file, a data: URI, bytes), and the tokens each becomes
in a rendered conversation (ImageTokens, as Gemma3Processor expands them)."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tunix_train.config import ConfigError

MAX_PIXELS = 64 * 1024 * 1024  # a larger image is refused before it is decoded
# The formats decoded, each by Pillow's own code: never one that runs an external program (EPS and
# PDF go to Ghostscript) or reads other files; an animated image gives its first frame.
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("images need Pillow: pip install 'tunix_train[vision]'") from None
    return Image


def _said(err: BaseException) -> str:
    """An error's words on one line, without the memory addresses of objects' reprs."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", " ".join(str(err).split()))[:200]


def opened(source: str | Path | bytes, name: str = ""):
    """An image (a PIL.Image) of a file path or its bytes with only its header read: its format
    one of FORMATS, its size at most MAX_PIXELS; `name` says where bytes came from."""
    Image = _pillow()
    if not name:
        name = "an image's bytes" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise ConfigError(f"image {name}: no such file")
    try:  # Pillow's own bomb check (a warning, then an error past twice its limit) stays as it is
        image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source, formats=FORMATS)
        if image.width * image.height > MAX_PIXELS:
            raise Image.DecompressionBombError
    except Image.DecompressionBombError:
        raise ConfigError(f"image {name}: more than {MAX_PIXELS:,} pixels; make it smaller") from None
    except Image.UnidentifiedImageError:
        raise ConfigError(f"image {name}: not a {', '.join(FORMATS)} image") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ConfigError(f"image {name}: cannot be read ({_said(err)})") from None
    if 0 in image.size:
        raise ConfigError(f"image {name}: it has no pixels ({image.size[0]} x {image.size[1]})")
    return image


def open_image(source: str | Path | bytes, name: str = ""):
    """The decoded image (opened's, its first frame) of a file path or its bytes."""
    image = opened(source, name)
    try:
        image.load()  # decodes now: a truncated file fails here, not later
    except (OSError, SyntaxError, ValueError) as err:
        name = name or ("an image's bytes" if isinstance(source, bytes) else str(source))
        raise ConfigError(f"image {name}: cannot be read ({_said(err)})") from None
    return image


def pixel_values(image, size: int) -> np.ndarray:
    """A PIL image as the tower takes it: [3, size, size] float32 in [-1, 1]; transparent pixels
    over white, as transformers converts them."""
    Image = _pillow()
    rgb = _rgb(image).resize((size, size), resample=Image.Resampling.BILINEAR)
    scaled = (np.asarray(rgb).astype(np.float64) * (1 / 255)).astype(np.float32)  # as transformers rescales
    return ((scaled - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1)


def gemma4_patches(image, patch: int, max_tokens: int, kernel: int) -> np.ndarray:
    """A PIL image as Gemma 4's tower takes it (VisionConfig.image_shape): resized, its aspect ratio
    kept, with Pillow's bicubic filter to the largest sides that are multiples of kernel x patch
    pixels within max_tokens x kernel^2 patches; scaled to [0, 1]; cut into patches (rows y, x,
    channel), each beside its (x, y) in the patch grid, padded with zeros at place -1 to
    max_tokens x kernel^2 (transformers' Gemma4ImageProcessor, its Pillow backend)."""
    Image = _pillow()
    rgb = _rgb(image)
    budget, side = max_tokens * kernel**2, kernel * patch
    factor = math.sqrt(budget * patch**2 / (rgb.width * rgb.height))
    height = int(math.floor(factor * rgb.height / side)) * side
    width = int(math.floor(factor * rgb.width / side)) * side
    longest = (budget // kernel**2) * side
    if height == 0:  # a strip: one block high, as many wide as its ratio (transformers' rule)
        height, width = side, min(int(math.floor(rgb.width / rgb.height)) * side, longest)
    elif width == 0:
        height, width = min(int(math.floor(rgb.height / rgb.width)) * side, longest), side
    if (width, height) != rgb.size:
        rgb = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = (np.asarray(rgb).astype(np.float64) * (1 / 255)).astype(np.float32)  # [H, W, C]
    h, w = height // patch, width // patch
    patches = pixels.reshape(h, patch, w, patch, 3).transpose(0, 2, 1, 3, 4).reshape(h * w, -1)
    xs, ys = np.meshgrid(np.arange(w), np.arange(h), indexing="xy")
    out = np.zeros((budget, patches.shape[1] + 2), np.float32)
    out[:, -2:] = -1
    out[: h * w, :-2] = patches
    out[: h * w, -2:] = np.stack([xs, ys], -1).reshape(-1, 2)
    return out


def _rgb(image):
    """RGB, transparent pixels over white (as transformers converts them)."""
    Image = _pillow()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return image.convert("RGB")


def image_array(image, vision) -> np.ndarray:
    """A PIL image as the model's tower takes it (vision: its VisionConfig, image_shape)."""
    if vision.traits.patches:
        return gemma4_patches(image, vision.patch_size, vision.tokens_per_image, vision.pooling_kernel)
    return pixel_values(image, vision.image_size)


def pan_and_scan(image, min_crop_size: int, max_crops: int, min_ratio: float) -> list:
    """Gemma 3's pan-and-scan: an image at least `min_ratio` times wider than tall (or taller than
    wide) cut into 2 to `max_crops` equal crops along its long side, about one per its aspect
    ratio (rounded half up), each at least `min_crop_size` pixels a side; else none. The crops
    follow the image itself, each prepared as an image of its own (pixel_values)."""
    width, height = image.size
    long, short = max(width, height), min(width, height)
    if long / short < min_ratio:
        return []
    crops = min(max_crops, max(2, min(math.floor(long / min_crop_size), math.floor(long / short + 0.5))))
    across, down = (crops, 1) if width >= height else (1, crops)
    crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
    if min(crop_w, crop_h) < min_crop_size:
        return []
    return [  # the last crop stops at the image's edge
        image.crop((x, y, min(x + crop_w, width), min(y + crop_h, height)))
        for y in range(0, crop_h * down, crop_h)
        for x in range(0, crop_w * across, crop_w)
    ]


MAX_IMAGE_BYTES = 20 * 1024 * 1024  # a larger encoded image (a file, a data: URI) is refused


def anchored(messages: list[dict], folder: Path, where: str) -> list[dict]:
    """The conversation with each image part's relative path made absolute against `folder` (the
    data file's: none may lead outside it), for records read later from elsewhere; other image
    parts as they are."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {
                    **part,
                    **{
                        k: str(image_bytes(part[k], folder, where)[0])
                        for k in ("image", "path")
                        if part["type"] == "image" and _is_path(part.get(k))
                    },
                }
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def anchored_paths(payloads: list, folder: Path, where: str) -> list:
    """A record's `images` list with each relative path made absolute against `folder` (as anchored)."""
    return [str(image_bytes(p, folder, where)[0]) if _is_path(p) else p for p in payloads]


def _is_path(payload) -> bool:
    return isinstance(payload, str) and not payload.startswith("data:") and "://" not in payload


def image_bytes(payload, folder: Path | None, where: str) -> tuple[bytes | Path, str]:
    """What an image part of a record names, as (bytes or a file, its name in messages): a file path
    relative to `folder` (the data file's; none may lead outside it; None: any local path, as the
    command line gives them), a `data:` URI, bytes, or a `datasets` Image ({bytes, path}). Remote
    URLs and file: URLs are not read."""
    if isinstance(payload, dict):  # datasets' Image feature as stored: its bytes, else its path
        payload = payload.get("bytes") or payload.get("path")
    if isinstance(payload, (bytes, bytearray)):
        if len(payload) > MAX_IMAGE_BYTES:
            raise ConfigError(f"{where}: an image of {len(payload):,} bytes; at most {MAX_IMAGE_BYTES:,}")
        return bytes(payload), f"{where} (image bytes)"
    if not isinstance(payload, str) or not payload:
        raise ConfigError(
            f"{where}: an image must be a path, a data: URI or bytes (got {str(payload)[:60]!r})"
        )
    if payload.startswith("data:"):
        return data_uri_bytes(payload, where), f"{where} (a data: URI)"
    if "://" in payload or payload.startswith("file:"):
        raise ConfigError(
            f"{where}: image {payload[:80]!r} is a URL; give a path relative to the data file or a data: URI"
        )
    path = (Path(payload) if folder is None else folder / payload).expanduser().resolve()
    if folder is not None and not path.is_relative_to(folder.resolve()):
        raise ConfigError(f"{where}: image {payload[:80]!r} lies outside the data file's folder {folder}")
    if path.is_file() and path.stat().st_size > MAX_IMAGE_BYTES:
        raise ConfigError(f"{where}: image {path} has more than {MAX_IMAGE_BYTES:,} bytes")
    return path, f"{where}: image {path}"


def pixel_stack(payloads, vision, folder: Path | None, where: str) -> np.ndarray:
    """Images (image_bytes' payloads) as the tower takes them: [n, *vision.image_shape] float32."""
    arrays = [image_array(open_image(*image_bytes(p, folder, where)), vision) for p in payloads]
    return np.stack(arrays) if arrays else np.zeros((0, *vision.image_shape), np.float32)


def data_uri_bytes(uri: str, where: str) -> bytes:
    """The bytes of a base64 `data:image/...;base64,...` URI, or a one-line error."""
    import base64
    import binascii

    head, _, body = uri.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ConfigError(f"{where}: a data: URI must be data:image/<type>;base64,<data> (got {head[:60]!r})")
    if len(body) * 3 // 4 > MAX_IMAGE_BYTES:
        raise ConfigError(f"{where}: a data: URI of more than {MAX_IMAGE_BYTES:,} bytes")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{where}: a data: URI whose base64 cannot be decoded") from None


# -- images in conversations: the parts that name them, and the tokens they become --------------

IMAGE_PART_TYPES = ("image", "image_url")


def content_parts(content: Any, where: str) -> bool:
    """Whether `content` is a list of text and image parts; a one-line error for a malformed part."""
    if not isinstance(content, list) or not content:
        return False
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image" or (kind == "image_url" and isinstance(part.get("image_url"), dict)):
            continue
        raise ConfigError(
            f"{where}: a content part must be {{type: text, text}}, {{type: image, image}} or "
            f"{{type: image_url, image_url: {{url}}}} (got {json.dumps(part, default=str)[:80]})"
        )
    return True


def split_images(messages: Sequence[dict]) -> tuple[list[dict], list[Any]]:
    """The conversation with each image part as {"type": "image"} (what templates read), and what
    each named, in order: its `image` (or `url`, `path`), an image_url's url, or None for a part
    that names nothing (the record's `images` list supplies it)."""
    plain, found = [], []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for part in content:
                if part["type"] in IMAGE_PART_TYPES:
                    if part["type"] == "image_url":
                        found.append(part["image_url"].get("url"))
                    else:
                        found.append(next((part[k] for k in ("image", "url", "path") if part.get(k)), None))
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        plain.append(message)
    return plain, found


def has_images(messages: Sequence[dict]) -> bool:
    return any(
        isinstance(m["content"], list) and any(p["type"] in IMAGE_PART_TYPES for p in m["content"])
        for m in messages
    )


def image_payloads(messages: Sequence[dict], listed: Sequence[Any], where: str) -> list[Any]:
    """What each image part of a conversation names, in order: its own image, else the next of
    `listed` (its record's `images` field); one line naming `where` when their numbers differ."""
    named, listed = split_images(messages)[1], list(listed)
    if sum(p is None for p in named) != len(listed):
        raise ConfigError(
            f"{where}: {sum(p is None for p in named)} image parts name no image but its record's "
            f"images field holds {len(listed)}: give each part its image, or list them in order"
        )
    return [p if p is not None else listed.pop(0) for p in named]


def conversation_pixels(
    messages, listed, vision, per_row: int, folder: Path | None, where: str
) -> np.ndarray:
    """A conversation's images as the tower takes them [n, *image_shape] (image_payloads'), at
    most per_row (data.images_per_row) of them; vision: the model's VisionConfig."""
    return conversation_images(messages, listed, vision, per_row, folder, where)[0]


PAN_AND_SCAN = dict(min_crop_size=256, min_ratio=1.2)  # transformers' Gemma3ImageProcessor defaults


def conversation_images(
    messages, listed, vision, per_row: int, folder: Path | None, where: str, crops: int = 0
) -> tuple[np.ndarray, list[int]]:
    """conversation_pixels' images and each one's pan-and-scan crops: with crops > 0 (Gemma 3's
    data.pan_and_scan_crops) a long image is followed by up to that many crops of it, each an
    image of its own; the second list says how many followed each image."""
    payloads = image_payloads(messages, listed, where) if has_images(messages) else []
    arrays, counts = [], []
    for payload in payloads:
        image = open_image(*image_bytes(payload, folder, where))
        pieces = [image, *(pan_and_scan(image, max_crops=crops, **PAN_AND_SCAN) if crops else [])]
        arrays += [image_array(piece, vision) for piece in pieces]
        counts.append(len(pieces) - 1)
    if len(arrays) > per_row:
        crops_said = f" and their {sum(counts)} crops" if sum(counts) else ""
        raise ConfigError(
            f"{where}: {len(payloads)} images{crops_said}, more than data.images_per_row={per_row}"
        )
    return (np.stack(arrays) if arrays else np.zeros((0, *vision.image_shape), np.float32)), counts


def fewest_tokens(vision) -> int:
    """The fewest tokens one image becomes in a prompt, its begin and end tokens included (Gemma 3's
    are all tokens_per_image; a Gemma 4 image has at least one), counted before it is read."""
    if vision is None:
        raise ConfigError("this model reads no images (its model.vision is null)")
    return 2 + (1 if vision.traits.patches else vision.tokens_per_image)


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """How the images a template places become tokens, as transformers' processors make them: each
    `marker` the template writes becomes `around` + boi + n image tokens + eoi + `around`, where n is
    the image's token count (model.vision's: Gemma 3's are all tokens_per_image, a Gemma 4 image's
    its own), tokenized with the rest."""

    vision: Any  # model.vision (a VisionConfig)
    boi: str = "<start_of_image>"
    eoi: str = "<end_of_image>"
    image: str = "<image_soft_token>"
    marker: str = "<start_of_image>"  # what the template writes for an image part
    around: str = "\n\n"

    @property
    def image_id(self) -> int:
        return self.vision.image_token_id

    @classmethod
    def for_model(cls, tokenizer, vision) -> ImageTokens:
        """The markers of model.vision's family (Gemma 3's, or Gemma 4's: <|image> <|image|> <image|>,
        as its tokenizer_config.json names them), each one token of `tokenizer`, the image token
        model.vision's id."""
        tokens = cls(vision, *vision.traits.markers)
        for name in ("boi", "eoi", "image"):
            ids = tokenizer.encode_with_offsets(getattr(tokens, name))[0]
            if len(ids) != 1:
                raise ConfigError(
                    f"data.tokenizer: {getattr(tokens, name)} is not one token of this tokenizer; a model "
                    f"with model.vision needs its family's image tokens ({tokens.boi}, {tokens.image}, "
                    f"{tokens.eoi}) in its tokenizer"
                )
            if name == "image" and ids[0] != vision.image_token_id:
                raise ConfigError(
                    f"model.vision.image_token_id={vision.image_token_id} but the tokenizer's {tokens.image} "
                    f"is token {ids[0]}; set model.vision.image_token_id={ids[0]}"
                )
        return tokens

    def counts(self, images, n: int) -> list[int]:
        """The tokens of each of n images (images: their arrays as the tower takes them)."""
        from tunix_train.model.vision import token_counts

        if not self.vision.traits.patches:
            return [self.vision.tokens_per_image] * n
        if images is None or len(images) < n:
            raise ConfigError(f"{n} images placed but {0 if images is None else len(images)} given")
        return [int(c) for c in token_counts(self.vision, np.asarray(images)[:n])]

    def expand(
        self, text: str, spans: list[tuple[int, int]], images=None, crops=None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The text with each marker expanded (the i-th for images[i]), and the character spans moved
        with it (a span holding a marker holds its expansion). crops: how many pan-and-scan crops
        follow each image (Gemma 3), which Gemma3Processor introduces in words."""
        starts = [m.start() for m in re.finditer(re.escape(self.marker), text)]
        if not starts:
            return text, spans
        pieces, grown, last = [], [], 0
        for i, (at, n) in enumerate(zip(starts, self.counts(images, len(starts)))):
            sequence = f"{self.around}{self.boi}{self.image * n}{self.eoi}{self.around}"
            if crops and crops[i]:  # the words of transformers' Gemma3Processor.replace_image_token
                sequence = (
                    f"Here is the original image {sequence} and here are some crops to help you see better "
                    + " ".join([sequence] * crops[i])
                )
            pieces += [text[last:at], sequence]
            grown.append(len(sequence) - len(self.marker))
            last = at + len(self.marker)

        def moved(at: int) -> int:
            return at + sum(g for s, g in zip(starts, grown) if s < at)

        return "".join(pieces) + text[last:], [(moved(a), moved(b)) for a, b in spans]
