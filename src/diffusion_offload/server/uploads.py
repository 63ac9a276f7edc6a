"""Uploaded images (``/v1/images/edits``' ``image`` and ``mask``): PNG, JPEG or WebP,
each under a byte cap, decoded by Pillow under a pixel limit, EXIF orientation applied.

The pixel limit is checked from the header, before any pixel is decoded, so a
decompression bomb (a small file of a huge image) is refused without being expanded.
"""

from __future__ import annotations

import io
from typing import Any

from .errors import APIError

__all__ = ["FORMATS", "MAX_UPLOAD_BYTES", "decode_upload"]

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_UPLOAD_BYTES = 16 * 1024 * 1024
"""Largest uploaded image file (bytes)."""


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"Invalid value for '{field}': {message}.", param=field,
                    code="invalid_image")


def decode_upload(field: str, data: Any, max_pixels: int, max_bytes: int = MAX_UPLOAD_BYTES,
                  mode: str = "RGB") -> Any:
    """An uploaded file's bytes as a PIL image in ``mode``.

    Args:
        field: the form field, for messages (``"image"``, ``"mask"``).
        data: the file's bytes (anything else is "not a file").
        max_pixels: most ``width * height`` (the server's ``--max-pixels``).
        max_bytes: most bytes of the file.
        mode: the returned image's mode (``"RGB"``; ``"L"`` for a mask).

    Raises:
        APIError: 400 naming ``field``: not a file, over ``max_bytes``, not PNG, JPEG or
            WebP, over ``max_pixels`` (read from the header, before decoding), or a file
            Pillow cannot decode.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not isinstance(data, (bytes, bytearray)):
        raise _bad(field, "send an image file (PNG, JPEG or WebP) in a multipart form")
    if len(data) > max_bytes:
        raise _bad(field, f"the file is {len(data)} bytes, over the limit of {max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))  # header only
    except (UnidentifiedImageError, OSError, ValueError):
        raise _bad(field, "not a PNG, JPEG or WebP image") from None
    width, height = image.size
    if width * height > max_pixels:
        raise _bad(field, f"{width}x{height} = {width * height} pixels is over this server's "
                          f"limit of {max_pixels} (--max-pixels)")
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as exc:
        raise _bad(field, f"the {image.format} file cannot be decoded ({exc})") from None
    if mode == "RGB" and image.mode in ("RGBA", "LA", "P"):
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert(mode)
