"""Images as Gemma 3's image processor prepares them: RGB, resized to the tower's square with
Pillow's bilinear filter, scaled to [0, 1], then normalised with mean 0.5 and std 0.5 per channel:
pixel values [3, size, size] in float32 (transformers' Gemma3ImageProcessor with its defaults,
its Pillow backend; pan-and-scan is not here yet). Files are untrusted: an unreadable, truncated,
empty or oversized image is one line naming the file."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from tunix_train.config import ConfigError

MAX_PIXELS = 64 * 1024 * 1024  # a larger image is refused before it is decoded


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("images need Pillow: pip install 'tunix_train[vision]'") from None
    return Image


def open_image(source: str | Path | bytes, name: str = ""):
    """The decoded image (a PIL.Image) of a file path or its bytes; `name` says where bytes came from."""
    Image = _pillow()
    if not name:
        name = "an image's bytes" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise ConfigError(f"image {name}: no such file")
    try:  # Pillow's own bomb check (a warning, then an error past twice its limit) stays as it is
        image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        if image.width * image.height > MAX_PIXELS:  # from the header, before decoding
            raise Image.DecompressionBombError
        image.load()  # decodes now: a truncated file fails here, not later
    except Image.DecompressionBombError:
        raise ConfigError(f"image {name}: more than {MAX_PIXELS:,} pixels; make it smaller") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ConfigError(f"image {name}: cannot be read ({' '.join(str(err).split())})") from None
    if 0 in image.size:
        raise ConfigError(f"image {name}: it has no pixels ({image.size[0]} x {image.size[1]})")
    return image


def pixel_values(image, size: int) -> np.ndarray:
    """A PIL image as the tower takes it: [3, size, size] float32 in [-1, 1]; transparent pixels
    over white, as transformers converts them."""
    Image = _pillow()
    if "A" in image.getbands() or image.info.get("transparency") is not None:  # onto white
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    rgb = image.convert("RGB").resize((size, size), resample=Image.Resampling.BILINEAR)
    scaled = (np.asarray(rgb).astype(np.float64) * (1 / 255)).astype(np.float32)  # as transformers rescales
    return ((scaled - np.float32(0.5)) / np.float32(0.5)).transpose(2, 0, 1)
