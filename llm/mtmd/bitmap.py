"""Media in: decoded RGB images and sounds (libmtmd's mtmd_bitmap) and the typed error of bad media.

llama.cpp decodes files with stb_image (mtmd_helper_bitmap_init_from_buf); here Pillow
decodes them (PNG, JPEG, WebP, GIF's first frame, BMP). Both give the same pixels for the
lossless formats; JPEG decoders may differ by a step of 1 in some pixels. The image's size is
read from its header and checked against a pixel limit before any pixel is decoded, so a
decompression bomb is refused without allocating its buffer. Sounds (WAV, MP3, FLAC, told
apart by their first bytes as mtmd-helper does) are decoded in audio.py.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import warnings
from dataclasses import dataclass, field

import numpy as np

from llm.errors import MediaError

# the most pixels a decoded image may have (stb_image's own limit is 2^24 per side); a
# 30000 x 30000 image (900 M pixels, 2.7 GB of RGB) is refused before decoding
MAX_PIXELS = 1 << 26
DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)"
                      r"(?P<b64>;base64)?,(?P<data>.*)", re.DOTALL)


@dataclass(frozen=True, eq=False)
class Bitmap:
    """An RGB image, uint8 [ny, nx, 3], or a sound, mono float32 [n_samples] at 16 kHz
    (mtmd_bitmap; nx = n_samples, ny = 1 for a sound); `id` is the SHA-256 of its size and
    values, which keys the encoder's cache."""
    data: np.ndarray = field(repr=False)
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            kind = "audio:" if self.is_audio else ""
            h = hashlib.sha256(f"{kind}{self.nx}x{self.ny}:".encode() + self.data.tobytes())
            object.__setattr__(self, "id", h.hexdigest())

    @property
    def is_audio(self) -> bool:
        return self.data.ndim == 1

    @property
    def nx(self) -> int:
        return int(self.data.shape[0 if self.is_audio else 1])

    @property
    def ny(self) -> int:
        return 1 if self.is_audio else int(self.data.shape[0])

    @classmethod
    def from_array(cls, pixels: np.ndarray) -> Bitmap:
        """uint8 [ny, nx, 3] RGB ([ny, nx] grey or [ny, nx, 4] RGBA, its alpha dropped as
        stb_image does when asked for 3 channels); a 1-d float array is a sound (mono samples
        at 16 kHz, mtmd_bitmap_init_from_audio)."""
        a = np.asarray(pixels)
        if a.ndim == 1:
            return cls._audio(a)
        if a.dtype != np.uint8:
            raise MediaError(f"image array must be uint8, got {a.dtype}")
        if a.ndim == 2:
            a = np.repeat(a[:, :, None], 3, axis=2)
        if a.ndim != 3 or a.shape[2] not in (3, 4):
            raise MediaError(f"image array must be [ny, nx, 3] (or [ny, nx] / [ny, nx, 4]), got shape {a.shape}")
        if a.shape[0] == 0 or a.shape[1] == 0:
            raise MediaError(f"image array is empty: shape {a.shape}")
        if a.shape[0] * a.shape[1] > MAX_PIXELS:
            raise MediaError(f"image of {a.shape[1]}x{a.shape[0]} pixels is over the pixel limit of {MAX_PIXELS}")
        return cls(np.ascontiguousarray(a[:, :, :3]))

    @classmethod
    def _audio(cls, a: np.ndarray) -> Bitmap:
        from llm.mtmd import audio
        if a.dtype.kind != "f":
            raise MediaError(f"audio array must hold float samples, got {a.dtype}")
        if a.size == 0:
            raise MediaError("audio array is empty")
        if a.size > audio.MAX_SECONDS * audio.SAMPLE_RATE:
            raise MediaError(f"audio of {a.size} samples is over the limit of {audio.MAX_SECONDS} s")
        if not np.isfinite(a).all():
            raise MediaError("audio array holds NaN or infinite samples")
        return cls(np.ascontiguousarray(a, np.float32))

    @classmethod
    def from_bytes(cls, buf: bytes, what: str = "image") -> Bitmap:
        """Decode an image or sound file's bytes; `what` names it in errors."""
        from PIL import Image, UnidentifiedImageError

        from llm.mtmd import audio
        if audio.is_audio(buf):
            return cls(audio.decode(buf, what))
        try:
            with warnings.catch_warnings():
                # our own limit below replaces Pillow's DecompressionBombWarning
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                im = Image.open(io.BytesIO(buf))
                nx, ny = im.size
                if nx * ny > MAX_PIXELS:
                    raise MediaError(f"{what}: {nx}x{ny} pixels is over the pixel limit of {MAX_PIXELS} "
                                     f"(refused before decoding)")
                if nx <= 0 or ny <= 0:
                    raise MediaError(f"{what}: invalid size {nx}x{ny}")
                im.seek(0)              # an animation's first frame
                im.load()
                rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
        except MediaError:
            raise
        except Image.DecompressionBombError as e:     # Pillow's own check, at twice its limit
            raise MediaError(f"{what}: over the pixel limit, refused before decoding: {e}") from None
        except UnidentifiedImageError:
            raise MediaError(f"{what}: not an image in a known format, nor WAV / MP3 / FLAC audio "
                             f"({len(buf)} bytes)") from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise MediaError(f"{what}: cannot decode the image: {e}") from None
        return cls(np.ascontiguousarray(rgb))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Bitmap:
        try:
            with open(path, "rb") as f:
                buf = f.read()
        except OSError as e:
            raise MediaError(f"{os.fspath(path)}: {e.strerror or e}") from None
        return cls.from_bytes(buf, os.fspath(path))

    @classmethod
    def from_url(cls, url: str, what: str = "image_url") -> Bitmap:
        """A data URL (`data:image/png;base64,...`); remote http(s) URLs are refused, as
        llama-server fetches none by default."""
        if not isinstance(url, str):
            raise MediaError(f"{what}: the url must be a string, got {type(url).__name__}")
        if url.startswith(("http://", "https://")):
            raise MediaError(f"{what}: remote URLs are not fetched ({url[:64]}); pass the image as a data URL")
        m = DATA_URL.fullmatch(url)
        if m is None:
            raise MediaError(f"{what}: not a data URL (data:image/...;base64,...): {url[:32]!r}")
        if not m["b64"]:
            raise MediaError(f"{what}: the data URL is not base64-encoded")
        try:
            buf = base64.b64decode(m["data"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"{what}: the data URL's base64 is invalid: {e}") from None
        return cls.from_bytes(buf, what)


def default_marker() -> str:
    """The text that stands for one image in a prompt (mtmd_default_marker)."""
    return "<__media__>"
