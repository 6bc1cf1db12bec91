"""Tiny raster drawing primitives for the envs' `render` methods (episode recordings).

A canvas is a numpy uint8 array [H, W, 3]; coordinates are pixels as floats, x to the right and y
down, pixel (row i, column j) covering [j, j + 1) x [i, i + 1). A shape fills the pixels whose
centres lie inside it (no anti-aliasing), so drawing is deterministic. Everything clips at the
canvas border. `alpha` < 1 blends the colour over what is there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

Color = tuple[int, int, int]


def canvas(h: int, w: int, rgb: Color = (255, 255, 255)) -> np.ndarray:
    """A new [h, w, 3] uint8 image filled with `rgb`."""
    img = np.empty((int(h), int(w), 3), dtype=np.uint8)
    img[:] = rgb
    return img


def to_tensor(img: np.ndarray) -> torch.Tensor:
    """The canvas as a CPU uint8 tensor [H, W, 3] (a copy)."""
    return torch.from_numpy(np.ascontiguousarray(img, dtype=np.uint8).copy())


def mix(a: Color, b: Color, t: float) -> Color:
    """The colour `t` of the way from `a` to `b` (t in [0, 1])."""
    return tuple(int(round(x + (y - x) * t)) for x, y in zip(a, b))  # type: ignore[return-value]


def _span(lo: float, hi: float, size: int) -> tuple[int, int]:
    """Indices [i0, i1) of the pixels whose centres lie in [lo, hi), clipped to [0, size)."""
    i0 = max(0, math.ceil(lo - 0.5))
    i1 = min(size, math.ceil(hi - 0.5))
    return i0, max(i0, i1)


def _paint(img: np.ndarray, ys: slice, xs: slice, mask: np.ndarray | None, rgb: Color, alpha: float) -> None:
    region = img[ys, xs]
    color = np.asarray(rgb, dtype=np.float64)
    if alpha >= 1.0:
        if mask is None:
            region[:] = rgb
        else:
            region[mask] = rgb
        return
    blended = np.round(region * (1.0 - alpha) + color * alpha).astype(np.uint8)
    if mask is None:
        region[:] = blended
    else:
        region[mask] = blended[mask]


def _grid(img: np.ndarray, x0: float, y0: float, x1: float, y1: float):
    """Pixel-centre coordinates of the clipped box [x0, x1) x [y0, y1) (None when empty)."""
    h, w = img.shape[:2]
    c0, c1 = _span(x0, x1, w)
    r0, r1 = _span(y0, y1, h)
    if c0 >= c1 or r0 >= r1:
        return None
    yy, xx = np.meshgrid(np.arange(r0, r1) + 0.5, np.arange(c0, c1) + 0.5, indexing="ij")
    return slice(r0, r1), slice(c0, c1), xx, yy


def fill_rect(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, rgb: Color, alpha: float = 1.0) -> None:
    """Fill the box between corners (x0, y0) and (x1, y1) (in either order)."""
    h, w = img.shape[:2]
    c0, c1 = _span(min(x0, x1), max(x0, x1), w)
    r0, r1 = _span(min(y0, y1), max(y0, y1), h)
    if c0 < c1 and r0 < r1:
        _paint(img, slice(r0, r1), slice(c0, c1), None, rgb, alpha)


def outline_rect(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, rgb: Color, width: float = 1.0) -> None:
    """The border of a box, `width` pixels thick, inside the box."""
    x0, x1 = min(x0, x1), max(x0, x1)
    y0, y1 = min(y0, y1), max(y0, y1)
    fill_rect(img, x0, y0, x1, y0 + width, rgb)
    fill_rect(img, x0, y1 - width, x1, y1, rgb)
    fill_rect(img, x0, y0, x0 + width, y1, rgb)
    fill_rect(img, x1 - width, y0, x1, y1, rgb)


def fill_circle(img: np.ndarray, cx: float, cy: float, r: float, rgb: Color, alpha: float = 1.0) -> None:
    """Fill the disc of radius `r` around (cx, cy)."""
    g = _grid(img, cx - r, cy - r, cx + r, cy + r)
    if g is not None:
        ys, xs, xx, yy = g
        _paint(img, ys, xs, (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r, rgb, alpha)


def ring(img: np.ndarray, cx: float, cy: float, r: float, rgb: Color, width: float = 1.0) -> None:
    """A circle's outline: the pixels at distance r - width .. r from (cx, cy)."""
    g = _grid(img, cx - r, cy - r, cx + r, cy + r)
    if g is not None:
        ys, xs, xx, yy = g
        d2 = (xx - cx) ** 2 + (yy - cy) ** 2
        inner = max(0.0, r - width)
        _paint(img, ys, xs, (d2 <= r * r) & (d2 >= inner * inner), rgb, 1.0)


def draw_line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, rgb: Color, width: float = 1.0,
              alpha: float = 1.0) -> None:
    """A segment `width` pixels thick with round caps (the pixels within width / 2 of it)."""
    r = max(width, 1.0) / 2.0
    g = _grid(img, min(x0, x1) - r, min(y0, y1) - r, max(x0, x1) + r, max(y0, y1) + r)
    if g is None:
        return
    ys, xs, xx, yy = g
    dx, dy = x1 - x0, y1 - y0
    length2 = dx * dx + dy * dy
    t = np.zeros_like(xx) if length2 == 0 else np.clip(((xx - x0) * dx + (yy - y0) * dy) / length2, 0.0, 1.0)
    d2 = (xx - (x0 + t * dx)) ** 2 + (yy - (y0 + t * dy)) ** 2
    _paint(img, ys, xs, d2 <= r * r, rgb, alpha)


def fill_polygon(img: np.ndarray, points: Sequence[tuple[float, float]], rgb: Color, alpha: float = 1.0) -> None:
    """Fill a simple polygon given by its corners (even-odd rule on the pixel centres)."""
    px = [float(p[0]) for p in points]
    py = [float(p[1]) for p in points]
    g = _grid(img, min(px), min(py), max(px) + 1e-9, max(py) + 1e-9)
    if g is None:
        return
    ys, xs, xx, yy = g
    inside = np.zeros(xx.shape, dtype=bool)
    n = len(px)
    for k in range(n):
        xa, ya, xb, yb = px[k], py[k], px[(k + 1) % n], py[(k + 1) % n]
        if ya == yb:
            continue
        crosses = (ya > yy) != (yb > yy)
        x_at = xa + (yy - ya) * (xb - xa) / (yb - ya)
        inside ^= crosses & (xx < x_at)
    _paint(img, ys, xs, inside, rgb, alpha)


def bar(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, frac: float, rgb: Color,
        back: Color = (60, 60, 60)) -> None:
    """A horizontal gauge: the box in `back`, its left `frac` (clipped to [0, 1]) in `rgb`."""
    frac = min(1.0, max(0.0, float(frac)))
    fill_rect(img, x0, y0, x1, y1, back)
    if frac > 0:
        fill_rect(img, x0, y0, x0 + (x1 - x0) * frac, y1, rgb)


# Distinct colours for agent slots (tab10-like), cycled.
PALETTE: tuple[Color, ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (148, 103, 189), (140, 86, 75),
    (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207), (214, 39, 40),
)


def slot_color(i: int) -> Color:
    return PALETTE[int(i) % len(PALETTE)]
