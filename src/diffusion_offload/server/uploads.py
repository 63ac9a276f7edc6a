"""Uploaded images (``/v1/images/edits``' ``image`` and ``mask``, chat image parts,
``/v1/videos``' ``input_reference``): PNG, JPEG or WebP, each under a byte cap, decoded by
Pillow under a pixel limit, EXIF orientation applied.

The pixel limits are checked from the headers, before any pixel is decoded, so a
decompression bomb (a small file of a huge image) is refused without being expanded:
each image is at most ``--max-pixels``, a request's images are at most
:data:`MAX_IMAGES` and :data:`TOTAL_PIXELS_FACTOR` times ``--max-pixels`` in all. The
routes decode them with :func:`decode_uploads_async`, off the event loop.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import APIError

__all__ = [
    "FORMATS", "MAX_IMAGES", "MAX_UPLOAD_BYTES", "TOTAL_PIXELS_FACTOR", "Upload",
    "check_count", "decode_upload", "decode_uploads", "decode_uploads_async", "max_total_pixels",
]

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_UPLOAD_BYTES = 16 * 1024 * 1024
"""Largest uploaded image file (bytes)."""
MAX_IMAGES = 16
"""Most images one request uploads (an edit's ``image`` files, a chat message's image
parts), as OpenAI's image edits allow; a mask comes on top."""
TOTAL_PIXELS_FACTOR = 4
"""A request's uploaded images hold at most this many times ``--max-pixels`` in all."""


def max_total_pixels(max_pixels: int) -> int:
    """Most pixels of all of one request's uploads together: ``TOTAL_PIXELS_FACTOR *
    max_pixels``."""
    return TOTAL_PIXELS_FACTOR * max_pixels


@dataclass(frozen=True)
class Upload:
    """One uploaded image to decode.

    Attributes:
        field: the request field, for messages (``"image"``, ``"mask"``,
            ``"messages[0].content[1]"``, ``"input_reference"``).
        data: the file's bytes.
        mode: the decoded image's mode (``"RGB"``; ``"L"`` for a mask).
    """

    field: str
    data: Any
    mode: str = "RGB"


def _bad(field: str, message: str, code: str = "invalid_image") -> APIError:
    return APIError(400, f"Invalid value for '{field}': {message}.", param=field, code=code)


def check_count(field: str, count: int, limit: int = MAX_IMAGES, what: str = "images") -> None:
    """Refuse more than ``limit`` uploads in ``field``.

    Raises:
        APIError: 400 naming ``field``, the count and the limit.
    """
    if count > limit:
        raise _bad(field, f"{count} {what} is more than this server takes in one request "
                          f"(at most {limit})", code="invalid_value")


def _open(upload: Upload, max_pixels: int, max_bytes: int) -> Any:
    """The upload opened by Pillow (header only: no pixel decoded), its size checked."""
    from PIL import Image, UnidentifiedImageError

    field, data = upload.field, upload.data
    if not isinstance(data, (bytes, bytearray)):
        raise _bad(field, "send an image file (PNG, JPEG or WebP) in a multipart form")
    if len(data) > max_bytes:
        raise _bad(field, f"the file is {len(data)} bytes, over the limit of {max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))  # header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own refusal past twice its limit (its warning past the limit, when
        # warnings are errors)
        raise _bad(field, f"its header claims an image over Pillow's decompression-bomb limit "
                          f"({exc}); this server takes at most {max_pixels} pixels "
                          "(--max-pixels)") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise _bad(field, "not a PNG, JPEG or WebP image") from None
    width, height = image.size
    if width * height > max_pixels:
        raise _bad(field, f"{width}x{height} = {width * height} pixels is over this server's "
                          f"limit of {max_pixels} (--max-pixels)")
    return image


def _decode(field: str, image: Any, mode: str) -> Any:
    """Decode an opened image (EXIF orientation applied) into ``mode``."""
    from PIL import Image, ImageOps

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
            WebP, over ``max_pixels`` (read from the header, before decoding; a header
            past Pillow's decompression-bomb limit too), or a file Pillow cannot decode.
    """
    return _decode(field, _open(Upload(field, data, mode), max_pixels, max_bytes), mode)


def decode_uploads(uploads: Sequence[Upload], max_pixels: int,
                   max_total: int | None = None, max_bytes: int = MAX_UPLOAD_BYTES) -> list[Any]:
    """A request's uploads as PIL images, in order, every header checked before any
    pixel is decoded.

    Args:
        uploads: the files.
        max_pixels: most pixels of one image (``--max-pixels``).
        max_total: most pixels of all of them together (default
            :func:`max_total_pixels` of ``max_pixels``).
        max_bytes: most bytes of one file.

    Raises:
        APIError: 400 naming the field at fault: what :func:`decode_upload` refuses, or
            the images together over ``max_total`` (the message gives the sum and the
            limit).
    """
    limit = max_total_pixels(max_pixels) if max_total is None else max_total
    opened = []
    total = 0
    for upload in uploads:
        image = _open(upload, max_pixels, max_bytes)
        width, height = image.size
        total += width * height
        if total > limit:
            raise _bad(upload.field, f"the {len(opened) + 1} images up to this one hold {total} "
                                     f"pixels in all, over this server's limit of {limit} "
                                     f"pixels per request ({TOTAL_PIXELS_FACTOR} x --max-pixels)",
                       code="invalid_value")
        opened.append(image)
    return [_decode(u.field, image, u.mode) for u, image in zip(uploads, opened)]


async def decode_uploads_async(uploads: Sequence[Upload], max_pixels: int,
                               max_total: int | None = None) -> list[Any]:
    """:func:`decode_uploads` on a worker thread, so that decoding never stalls the event
    loop (``/health``, other requests)."""
    return await asyncio.to_thread(decode_uploads, list(uploads), max_pixels, max_total)
