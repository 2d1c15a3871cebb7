"""Image preprocessing as llama.cpp's tools/mtmd/mtmd-image.cpp does it, bit for bit.

Resizing is Pillow's separable resampling in 22-bit fixed point (img_tool::resize_pillow:
horizontal pass, then vertical, each output pixel's weights normalized and rounded as
Pillow rounds them, the accumulator started at one half and shifted down); padding keeps
the aspect ratio (PAD_CEIL / PAD_NEAREST) and centres the image on the pad colour; the
float image is u8 / 255 then (x - mean) / std per channel, in float32.
"""
from __future__ import annotations

import enum
import math

import numpy as np

PRECISION_BITS = 32 - 8 - 2


class ResizeAlgo(enum.Enum):
    """resize_algo: the filter and its support radius."""
    BILINEAR = 1.0
    BICUBIC = 2.0
    LANCZOS = 3.0


class PadStyle(enum.Enum):
    """pad_style of img_tool::resize."""
    NONE = "none"
    CEIL = "ceil"
    NEAREST = "nearest"


def _filter(algo: ResizeAlgo, x: float) -> float:
    if algo is ResizeAlgo.LANCZOS:
        if -3.0 <= x < 3.0:
            def sinc(v: float) -> float:
                return 1.0 if v == 0.0 else math.sin(math.pi * v) / (math.pi * v)
            return sinc(x) * sinc(x / 3.0)
        return 0.0
    x = abs(x)
    if algo is ResizeAlgo.BILINEAR:
        return 1.0 - x if x < 1.0 else 0.0
    a = -0.5
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _weights(in_size: int, out_size: int, algo: ResizeAlgo) -> tuple[np.ndarray, np.ndarray]:
    """Each output pixel's first input pixel [out] and fixed-point weights [out, ksize]
    (precompute_weights), zero past the pixels it reads."""
    scale = filterscale = in_size / out_size
    filterscale = max(filterscale, 1.0)
    support = algo.value * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    xmins = np.zeros(out_size, np.int64)
    kk = np.zeros((out_size, ksize), np.int64)
    ss = 1.0 / filterscale
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        w = [_filter(algo, (x + xmin - center + 0.5) * ss) for x in range(xmax)]
        ww = sum(w)
        for x in range(xmax):
            v = w[x] / ww if ww != 0.0 else w[x]
            kk[xx, x] = int(v * (1 << PRECISION_BITS) + (-0.5 if v < 0 else 0.5))
        xmins[xx] = xmin
    return xmins, kk


def _clip8(acc: np.ndarray) -> np.ndarray:
    return np.clip(acc >> PRECISION_BITS, 0, 255).astype(np.uint8)


def _resample(img: np.ndarray, out_size: int, axis: int, algo: ResizeAlgo) -> np.ndarray:
    """One pass along axis (1: horizontal, 0: vertical) of a uint8 [ny, nx, 3] image."""
    in_size = img.shape[axis]
    xmins, kk = _weights(in_size, out_size, algo)
    src = np.moveaxis(img, axis, 0).astype(np.int64)            # [in, other, 3]
    acc = np.full((out_size,) + src.shape[1:], 1 << (PRECISION_BITS - 1), np.int64)
    for k in range(kk.shape[1]):
        idx = np.minimum(xmins + k, in_size - 1)                # weights past xmax are 0
        acc += src[idx] * kk[:, k][:, None, None]
    return np.moveaxis(_clip8(acc), 0, axis)


def resize_pillow(img: np.ndarray, nx: int, ny: int, algo: ResizeAlgo) -> np.ndarray:
    """uint8 [ny0, nx0, 3] -> uint8 [ny, nx, 3], as img_tool::resize_pillow."""
    if not (0 < nx <= 65536 and 0 < ny <= 65536):
        raise ValueError(f"resize target {nx}x{ny} is out of range (max 65536)")
    out = img
    if nx != img.shape[1]:
        out = _resample(out, nx, 1, algo)
    if ny != img.shape[0]:
        out = _resample(out, ny, 0, algo)
    return np.ascontiguousarray(out)


def _round(v) -> int:
    """std::round: halves away from zero (numpy rounds them to even)."""
    return int(math.copysign(math.floor(abs(float(v)) + 0.5), float(v)))


def resize(img: np.ndarray, nx: int, ny: int, algo: ResizeAlgo, pad: PadStyle = PadStyle.CEIL,
           pad_color: tuple[int, int, int] = (0, 0, 0)) -> np.ndarray:
    """img_tool::resize: to nx x ny directly (PadStyle.NONE) or keeping the aspect ratio,
    centred on pad_color."""
    h0, w0 = img.shape[:2]
    if (w0, h0) == (nx, ny):
        return img.copy()
    if pad is PadStyle.NONE:
        return resize_pillow(img, nx, ny, algo)
    scale = min(np.float32(nx) / np.float32(w0), np.float32(ny) / np.float32(h0))
    rnd = _round if pad is PadStyle.NEAREST else (lambda v: int(np.ceil(v)))
    new_w = min(rnd(np.float32(w0) * scale), nx)
    new_h = min(rnd(np.float32(h0) * scale), ny)
    resized = resize_pillow(img, new_w, new_h, algo)
    out = np.empty((ny, nx, 3), np.uint8)
    out[:] = np.asarray(pad_color, np.uint8)
    if pad is PadStyle.NEAREST:
        ox, oy = _round(np.float32(nx - new_w) / np.float32(2)), _round(np.float32(ny - new_h) / np.float32(2))
    else:
        ox, oy = (nx - new_w) // 2, (ny - new_h) // 2
    out[oy:oy + new_h, ox:ox + new_w] = resized[:max(0, ny - oy), :max(0, nx - ox)]
    return out


def calc_size_preserved_ratio(nx: int, ny: int, *, align: int, min_pixels: int = 0,
                              max_pixels: int = 0) -> tuple[int, int]:
    """img_tool::calc_size_preserved_ratio (transformers' smart_resize): the size nx x ny is
    resized to, each side a multiple of align near its own, scaled into [min_pixels,
    max_pixels] (0: no bound) keeping the aspect ratio; float32 as llama.cpp computes it."""
    f = np.float32(align)
    w, h = np.float32(nx), np.float32(ny)
    w_bar = max(align, _round(w / f) * align)
    h_bar = max(align, _round(h / f) * align)
    if max_pixels > 0 and w_bar * h_bar > max_pixels:
        beta = np.sqrt(h * w / np.float32(max_pixels))
        h_bar = max(align, int(np.floor(h / beta / f)) * align)
        w_bar = max(align, int(np.floor(w / beta / f)) * align)
    elif min_pixels > 0 and w_bar * h_bar < min_pixels:
        beta = np.sqrt(np.float32(min_pixels) / (h * w))
        h_bar = int(np.ceil(h * beta / f)) * align
        w_bar = int(np.ceil(w * beta / f)) * align
    return w_bar, h_bar


def normalize(img: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """clip_image_f32::from_u8 then normalize: float32 [3, ny, nx] (planar, inp_raw's layout)."""
    x = img.astype(np.float32) / np.float32(255.0)
    y = (x - np.asarray(mean[:3], np.float32)) / np.asarray(std[:3], np.float32)
    return np.ascontiguousarray(y.transpose(2, 0, 1))
