"""Writing images and videos to files (PIL for PNG, imageio + ffmpeg for MP4, imageio for GIF).

Files are written atomically: to a temporary file beside the target, then renamed, so
a failure never leaves a half-written output.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy and PIL load on first encode, not when paths are checked
    from PIL import Image

__all__ = [
    "IMAGE_EXTENSIONS", "VIDEO_EXTENSIONS", "check_output_path", "check_writable_folder",
    "encode_image", "encode_png", "encode_video", "write_atomic",
]

IMAGE_EXTENSIONS = (".png",)
VIDEO_EXTENSIONS = (".mp4", ".gif")


def check_output_path(path: str | os.PathLike, is_video: bool | None) -> Path:
    """Validate an output path before any work is done.

    ``is_video=None`` (the model's kind not known yet) checks only what does not depend
    on it: a known extension and a writable folder.

    Raises:
        ValueError: the extension is unknown or does not fit the output kind (``.png``
            for images; ``.mp4`` or ``.gif`` for videos), the folder does not exist or
            does not accept new files, or the path is a folder or a read-only file.
    """
    out = Path(path)
    ext = out.suffix.lower()
    if is_video is None:
        allowed, what = IMAGE_EXTENSIONS + VIDEO_EXTENSIONS, "images and videos"
    else:
        allowed = VIDEO_EXTENSIONS if is_video else IMAGE_EXTENSIONS
        what = f"this {'video' if is_video else 'image'} model"
    if ext not in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS:
        raise ValueError(
            f"output {str(out)!r} has unknown extension {ext or '(none)'!r}; allowed: "
            f"{list(allowed)} for {what}"
        )
    if ext not in allowed:
        kind = "a video" if is_video else "an image"
        raise ValueError(f"output {str(out)!r}: this model produces {kind}; use one of {list(allowed)}")
    check_writable_folder(out, "output")
    if out.exists() and (out.is_dir() or not os.access(out, os.W_OK)):
        raise ValueError(f"output {str(out)!r} is not writable")
    return out


def check_writable_folder(path: str | os.PathLike, what: str = "output") -> Path:
    """Check that a file can be created beside ``path`` (its folder exists and takes new files).

    The check creates and removes a temporary file in the folder, since ``os.access``
    says yes to root for read-only folders, where the atomic write would fail later.

    Raises:
        ValueError: the folder does not exist or does not accept new files (the message
            names ``what``, the path and the reason).
    """
    out = Path(path)
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise ValueError(f"{what} {str(out)!r}: folder {str(folder)!r} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".probe", dir=folder)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(
            f"{what} {str(out)!r} is not writable: folder {str(folder)!r} does not accept new files ({reason})"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return out


def encode_png(image: "Image.Image") -> bytes:
    """PNG bytes of ``image``."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def encode_image(image: "Image.Image", fmt: str = "png", compression: int | None = None) -> bytes:
    """``image`` as ``png``, ``jpeg`` or ``webp`` bytes.

    Args:
        image: the image (RGB).
        fmt: the format.
        compression: OpenAI's ``output_compression``, 0-100: the JPEG and WebP quality
            (None: 100, OpenAI's default); PNG is lossless and ignores it.

    Raises:
        ValueError: another format.
    """
    buf = io.BytesIO()
    if fmt == "png":
        image.save(buf, format="PNG")
    elif fmt in ("jpeg", "webp"):
        image.save(buf, format=fmt.upper(), quality=100 if compression is None else compression)
    else:
        raise ValueError(f"image format {fmt!r} is not allowed; allowed: png, jpeg, webp")
    return buf.getvalue()


def encode_video(frames: Sequence["Image.Image"], fps: int, ext: str = ".mp4") -> bytes:
    """Encode PIL frames as MP4 (H.264, yuv420p, via imageio-ffmpeg) or GIF; returns bytes.

    Frame sizes are padded by ffmpeg's macro-block rule only if needed: tiny sizes are
    kept exact by ``macro_block_size=1``.
    """
    import numpy as np

    arrays = [np.asarray(f.convert("RGB")) for f in frames]
    import imageio.v2 as imageio

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"video{ext}"
        if ext == ".gif":
            imageio.mimsave(path, arrays, duration=1000.0 / fps, loop=0)
        else:
            writer = imageio.get_writer(
                path, fps=fps, codec="libx264", macro_block_size=1,
                ffmpeg_log_level="error", output_params=["-pix_fmt", "yuv420p"],
            )
            try:
                for a in arrays:
                    writer.append_data(a)
            finally:
                writer.close()
        return path.read_bytes()


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
