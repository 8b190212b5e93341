"""Images as messages carry them: encoded bytes (:class:`streamrl.common.messages.Image`), recognised
by their leading bytes, decoded to RGB pixels the same way by every service.

The coordinator reads images from datasets (:func:`sniff_media_type`), the rollout engines and the
learner decode them (:func:`decode_image`) - one implementation, so the rollout tier and the learner
feed their models the same pixels. PIL is imported only to decode or encode.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from streamrl.common.messages import Image

if TYPE_CHECKING:
    import PIL.Image

FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF", "image/bmp": "BMP"}
"""Media types an :class:`Image` may carry, and the PIL format its bytes must be in."""
_MAGIC = {
    b"\x89PNG\r\n\x1a\n": "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF87a": "image/gif",
    b"GIF89a": "image/gif",
    b"BM": "image/bmp",
}


def sniff_media_type(data: bytes) -> str | None:
    """The media type of encoded image bytes (one of :data:`FORMATS`), None for anything else."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return next((kind for magic, kind in _MAGIC.items() if data.startswith(magic)), None)


def decode_image(image: Image, where: str = "image") -> PIL.Image.Image:
    """The RGB pixels of ``image``; ValueError naming ``where`` when it has no inline bytes, an unknown
    media type, or bytes that do not decode as that type (decompression bombs included)."""
    import PIL.Image

    if image.data is None:
        uri = f" (uri {image.uri!r})" if image.uri else ""
        raise ValueError(f"{where}{uri} has no inline bytes: only images carried in the message are read")
    fmt = FORMATS.get(image.media_type.lower())
    if fmt is None:
        raise ValueError(f"{where}: media_type {image.media_type!r} is not one of {sorted(FORMATS)}")
    try:
        with PIL.Image.open(io.BytesIO(image.data), formats=[fmt]) as opened:
            opened.load()
            return opened.convert("RGB")
    except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:  # PIL: not such an image
        raise ValueError(
            f"{where}: {len(image.data)} bytes of {image.media_type} cannot be decoded as {fmt}: {e}"
        ) from e


def encode_png(pixels: Any) -> Image:
    """A PIL image as an :class:`Image` message, PNG-encoded (lossless: decoded later, these are the pixels, RGB)."""
    buffer = io.BytesIO()
    pixels.convert("RGB").save(buffer, format="PNG")
    return Image(media_type="image/png", data=buffer.getvalue())
