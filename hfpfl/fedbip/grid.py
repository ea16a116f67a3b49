"""PNG grid: for each client, rows of its real train images and rows of the synthetic images made from its upload;
one column per class."""
from __future__ import annotations

import os

import numpy as np
import torch


def _pick(images: torch.Tensor, labels: torch.Tensor, num_classes: int, per_class: int) -> list[list]:
    """rows[r][c] = image r of class c (or None)."""
    rows = [[None] * num_classes for _ in range(per_class)]
    for c in range(num_classes):
        idx = (labels == c).nonzero().flatten()[:per_class]
        for r, i in enumerate(idx.tolist()):
            rows[r][c] = images[i]
    return rows


def save_real_vs_synthetic_grid(path, real, synthetic, names, num_classes: int, per_class: int = 3,
                                scale: int = 2) -> str:
    """real / synthetic: one (images (N, C, H, W) in [-1, 1], labels (N,)) per client; names: one label per client."""
    from PIL import Image, ImageDraw

    h, w = real[0][0].shape[-2:]
    pad, margin = 2, 120
    blocks = []
    for (rx, ry), (sx, sy), name in zip(real, synthetic, names):
        blocks.append((f"{name} real", _pick(rx, ry, num_classes, per_class)))
        blocks.append((f"{name} synthetic", _pick(sx, sy, num_classes, per_class)))
    n_rows = len(blocks) * per_class
    H = n_rows * (h + pad) + len(blocks) * 4
    W = margin + num_classes * (w + pad)
    canvas = np.full((H, W, 3), 255, dtype=np.uint8)
    y0, text = 0, []
    for title, rows in blocks:
        text.append((y0, title))
        for row in rows:
            for c, im in enumerate(row):
                if im is None:
                    continue
                a = ((im.float().clamp(-1, 1) + 1) * 127.5).round().byte()
                a = a.expand(3, -1, -1) if a.shape[0] == 1 else a
                x0 = margin + c * (w + pad)
                canvas[y0 : y0 + h, x0 : x0 + w] = a.permute(1, 2, 0).numpy()
            y0 += h + pad
        y0 += 4
    img = Image.fromarray(canvas).resize((W * scale, H * scale), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    for y, t in text:
        draw.text((4, y * scale + 2), t.replace(" synthetic", "\nsynthetic").replace(" real", "\nreal"),
                  fill=(0, 0, 0))
    for c in range(num_classes):
        draw.text(((margin + c * (w + pad)) * scale + 2, 0), str(c), fill=(255, 0, 0))
    os.makedirs(os.path.dirname(os.path.abspath(str(path))), exist_ok=True)
    img.save(str(path))
    return str(path)
