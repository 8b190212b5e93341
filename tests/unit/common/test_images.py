"""Images as messages carry them: recognised by their bytes, decoded to RGB, errors naming the image."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image as PILImage

from streamrl.common.images import decode_image, encode_png, sniff_media_type
from streamrl.common.messages import Image


def encoded(pixels: PILImage.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    pixels.save(out, fmt)
    return out.getvalue()


def pixels(seed: int, mode: str = "RGB") -> PILImage.Image:
    rng = np.random.default_rng(seed)
    return PILImage.fromarray(rng.integers(0, 256, (40, 50, 4), dtype=np.uint8), "RGBA").convert(mode)


@pytest.mark.parametrize(
    ("fmt", "media_type"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp"), ("BMP", "image/bmp")],
)
def test_every_accepted_format_is_recognised_by_its_bytes_and_decodes(fmt: str, media_type: str) -> None:
    data = encoded(pixels(0), fmt)
    assert sniff_media_type(data) == media_type
    assert decode_image(Image(media_type, data)).size == (50, 40)


def test_anything_else_is_not_an_image() -> None:
    assert sniff_media_type(b"") is None and sniff_media_type(b'{"prompt": 1}') is None
    assert sniff_media_type(encoded(pixels(0), "TIFF")) is None


def test_decode_gives_rgb_pixels_and_names_what_is_wrong() -> None:
    rgba = pixels(0, mode="RGBA")
    decoded = decode_image(Image("image/png", encoded(rgba)))
    assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), np.asarray(rgba.convert("RGB")))
    with pytest.raises(ValueError, match=r"trajectory t/0: image 2 \(uri 's3://b/a\.png'\) has no inline bytes"):
        decode_image(Image("image/png", uri="s3://b/a.png"), "trajectory t/0: image 2")
    with pytest.raises(ValueError, match="image: media_type 'image/tiff' is not one of"):
        decode_image(Image("image/tiff", encoded(pixels(0), "TIFF")))
    with pytest.raises(ValueError, match=r"image: 10 bytes of image/png cannot be decoded as PNG"):
        decode_image(Image("image/png", b"not a png!"))
    with pytest.raises(ValueError, match="cannot be decoded as PNG"):  # a JPEG labelled PNG
        decode_image(Image("image/png", encoded(pixels(0), "JPEG")))
    with pytest.raises(ValueError, match="cannot be decoded as PNG"):  # cut short
        decode_image(Image("image/png", encoded(pixels(0))[:200]))


def test_png_encoding_is_lossless() -> None:
    grey = pixels(3, mode="L")
    stored = encode_png(grey)
    assert stored.media_type == "image/png"
    assert np.array_equal(np.asarray(decode_image(stored)), np.asarray(grey.convert("RGB")))
