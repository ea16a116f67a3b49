"""FedPCE's training augmentation (FedPCE paper section 5, "Implementation details"), on batches of model inputs:

    "The training images are augmented by first padding with 4 pixels of value 0 on all sides, randomly cropping the
    image to 32x32, flipping the image horizontally with a probability of 0.25, rotating it by a degree uniformly
    sampled from (-15, 15) with a probability of 0.25, and randomly erasing a rectangle of size between 16 and 256
    pixels with a probability of 0.5."

On model inputs in [-1, 1]: the paper's pixel value 0 (black) is -1 here, and it fills the padding and the corners a
rotation uncovers (torchvision's RandomRotation fill 0). The paper's images are 32 px; at another size the padding
(4 px) and the erased area (16 to 256 px) scale with the image: padding round(4 H / 32), area (16 .. 256) H W / 1024.
The erased rectangle's aspect ratio is log-uniform in (0.3, 3.3) and it is filled with 0 (torchvision's
RandomErasing defaults; the paper gives neither). Parameters are drawn per image from a torch.Generator
(:func:`draw`), then applied (:func:`apply`), so that both are testable on their own.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

P_FLIP, P_ROTATE, P_ERASE = 0.25, 0.25, 0.5
MAX_DEGREES = 15.0
BLACK = -1.0


def scaled_pad(size: int) -> int:
    return max(1, round(4 * size / 32))


def draw(n: int, height: int, width: int, generator: torch.Generator) -> dict:
    """Per-image parameters: crop offsets in 0..2 pad, flip / rotate / erase switches, angle (degrees), the erased
    box (top, left, h, w)."""
    g = generator
    pad = scaled_pad(height)
    u = torch.rand(n, 5, generator=g, dtype=torch.float64)
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    area = (16 + 240 * u[:, 3]) * height * width / 1024
    ratio = torch.exp(math.log(0.3) + (math.log(3.3) - math.log(0.3)) * u[:, 4])
    h = torch.clamp(torch.round(torch.sqrt(area * ratio)), 1, height).long()
    w = torch.clamp(torch.round(torch.sqrt(area / ratio)), 1, width).long()
    pos = torch.rand(n, 2, generator=g, dtype=torch.float64)
    top = torch.floor(pos[:, 0] * (height - h + 1)).long()
    left = torch.floor(pos[:, 1] * (width - w + 1)).long()
    switches = torch.rand(n, 3, generator=g, dtype=torch.float64)
    return {"pad": pad, "offsets": offsets, "flip": switches[:, 0] < P_FLIP, "rotate": switches[:, 1] < P_ROTATE,
            "angle": (2 * u[:, 0] - 1) * MAX_DEGREES, "erase": switches[:, 2] < P_ERASE,
            "box": torch.stack([top, left, h, w], 1)}


def rotate(x: torch.Tensor, degrees: torch.Tensor) -> torch.Tensor:
    """Each image of ``x`` [N, C, H, W] rotated by its angle about the centre (bilinear), uncovered corners black.
    Positive angles turn the image counter-clockwise (torchvision's convention)."""
    a = degrees.to(torch.float64) * math.pi / 180
    cos, sin = torch.cos(a), torch.sin(a)
    zero = torch.zeros_like(a)
    # output -> input sampling; y grows downward, so a counter-clockwise turn samples at (cos, -sin; sin, cos)^T
    theta = torch.stack([torch.stack([cos, -sin, zero], 1), torch.stack([sin, cos, zero], 1)], 1).to(x.dtype)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x - BLACK, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + BLACK


def apply(x: torch.Tensor, p: dict) -> torch.Tensor:
    """The augmentation of :func:`draw`'s parameters on ``x`` [N, C, H, W] (a new tensor)."""
    n, _, height, width = x.shape
    pad = p["pad"]
    padded = F.pad(x, (pad, pad, pad, pad), value=BLACK)
    out = torch.stack([padded[i, :, oy:oy + height, ox:ox + width]
                       for i, (oy, ox) in enumerate(p["offsets"].tolist())])
    out = torch.where(p["flip"].view(n, 1, 1, 1).to(out.device), out.flip(-1), out)
    turn = p["rotate"].nonzero().flatten()
    if len(turn):
        out[turn] = rotate(out[turn], p["angle"][turn].to(out.device))
    for i in p["erase"].nonzero().flatten().tolist():
        top, left, h, w = p["box"][i].tolist()
        out[i, :, top:top + h, left:left + w] = 0.0
    return out


def paper_augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw and apply (parameters drawn on the CPU from ``generator``)."""
    return apply(x, draw(x.shape[0], x.shape[-2], x.shape[-1], generator))
