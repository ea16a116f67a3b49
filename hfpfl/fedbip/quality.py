"""Judges that never saw a client image, and what they read off a FedBiP run (DESIGN "honest stand-ins").

* the **judge**: a small CNN trained on labelled public images (never on client data), with its own held-out accuracy
  reported. ``judge_pool="public"`` (the default, "a judge trained on real public images") trains
  it on the pool's real public splits only (the ``public-*`` styles: public mnist / usps / mnistm / syn);
  ``"all"`` on the whole pool (public splits + procedural styles: recipe v4's judge). Both share one held-out split
  of the whole pool, so the two judges are scored on the same unseen images. It ships with the tiny LDM
  (``judge.pt``); the LDM's own quality report (plain-prompt fidelity, grids per style) is the pretraining's,
  :mod:`hfpfl.fedbip.pretraining.report`;
* the **style judge**: a domain classifier on the public splits;
* :func:`synthetic_quality`: both judges on a run's synthetic set (a study's metrics hook).
"""
from __future__ import annotations

import functools
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


JUDGE_EPOCHS = 12


class Judge(nn.Module):
    """conv(32)-conv(64)-conv(128) + BN/ReLU/pool, linear head: a 10-way digit classifier on (3, 32, 32) in [-1,1]."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        layers, c = [], 3
        for w in (32, 64, 128):
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2)]
            c = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


def augment_digits(x: torch.Tensor, g: torch.Generator, shift: float = 3.0, scale: float = 0.1,
                   invert_p: float = 0.3) -> torch.Tensor:
    """Per-image random translation (up to ``shift`` pixels) and zoom (1 +- ``scale``), colour inversion with
    probability ``invert_p`` and a random channel permutation: label-preserving for digits in any of the pool's
    styles."""
    b, _, h, _ = x.shape
    theta = torch.zeros(b, 2, 3)
    s = 1 + scale * (torch.rand(b, generator=g) * 2 - 1)
    theta[:, 0, 0] = s
    theta[:, 1, 1] = s
    theta[:, :, 2] = (torch.rand(b, 2, generator=g) * 2 - 1) * shift * 2 / h
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    out = F.grid_sample(x, grid, padding_mode="border", align_corners=False)
    flip = torch.rand(b, generator=g) < invert_p
    out[flip] = -out[flip]
    perm = torch.stack([torch.randperm(3, generator=g) for _ in range(b)])
    return torch.gather(out, 1, perm[:, :, None, None].expand_as(out))


def judge_split(n: int, seed: int = 0, holdout: float = 0.1, generator: torch.Generator | None = None):
    """(held-out, train) indices of :func:`train_judge` for a pool of ``n`` images."""
    perm = torch.randperm(n, generator=generator or torch.Generator().manual_seed(seed))
    n_hold = int(n * holdout)
    return perm[:n_hold], perm[n_hold:]


@torch.no_grad()
def reconstruction_fidelity(vae, judge, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 128) -> float:
    """Judge accuracy on VAE reconstructions (posterior mean, decoded) of ``images``: an upper bound on what an LDM
    with this VAE can reach in class fidelity (the judge cannot read a digit the VAE does not keep)."""
    rec = []
    for i in range(0, len(images), batch_size):
        x = images[i : i + batch_size].to(vae.device, vae.dtype)
        rec.append(vae.decode(vae.encode(x).latent_dist.mean).sample.clamp(-1, 1).float().cpu())
    return judge_accuracy(judge, torch.cat(rec), labels)


JUDGE_POOLS = ("public", "all")
PUBLIC_STYLE_PREFIX = "public-"


def judge_train_mask(styles, judge_pool: str = "public") -> np.ndarray:
    """Which pool images a judge of ``judge_pool`` may train on: ``"public"`` = the real public splits (styles
    ``public-*``), ``"all"`` = every image."""
    if judge_pool not in JUDGE_POOLS:
        raise ValueError(f"judge_pool must be one of {', '.join(JUDGE_POOLS)}, got {judge_pool!r}")
    st = np.asarray(styles)
    if judge_pool == "all":
        return np.ones(len(st), bool)
    mask = np.char.startswith(st.astype(str), PUBLIC_STYLE_PREFIX)
    if not mask.any():
        raise ValueError(f"judge_pool='public': no pool image has a style starting with {PUBLIC_STYLE_PREFIX!r}")
    return mask


def train_judge(images: torch.Tensor, labels: torch.Tensor, epochs: int | None = None, batch_size: int = 64,
                seed: int = 0, holdout: float = 0.1, augment: bool = True, lr: float = 3e-3, styles=None,
                report: dict | None = None, train_mask=None, device="cpu", num_classes: int = 10):
    """Train the judge on (images (N,3,32,32) in [-1,1], labels in ``range(num_classes)``); returns (judge, held-out
    accuracy). ``report`` (a
    dict) receives the held-out accuracy per style (``styles``: one name per image) and the recipe.

    The held-out split (:func:`judge_split`) is always drawn over all N images; ``train_mask`` (bool, N; see
    :func:`judge_train_mask`) restricts the *training* images to a subset. The returned accuracy is on the held-out
    images of that subset (the judge's own distribution); ``report["heldout_accuracy_all"]`` is on every held-out
    image.

    ``device``: where the judge trains (batches are drawn and augmented on the CPU with the seeded generator, then
    moved; the returned judge stays there).

    ``epochs`` (default): :data:`JUDGE_EPOCHS` over the whole pool's train split, i.e. the same number of optimisation
    steps whatever ``train_mask`` keeps (a subset of a third of the pool gets three times the epochs; measured on the
    v4 pool, 12 epochs on the 2,261 public train images left the public-only judge at 0.69 on public held-out
    images, 0.42 on public-syn)."""
    g = torch.Generator().manual_seed(seed)
    hold, train = judge_split(len(labels), seed, holdout, g)
    own_hold, n_train_all = hold, len(train)
    if train_mask is not None:
        m = torch.as_tensor(np.asarray(train_mask, bool))
        if len(m) != len(labels):
            raise ValueError(f"train_mask has {len(m)} entries for {len(labels)} images")
        train, own_hold = train[m[train]], hold[m[hold]]
    if epochs is None:
        epochs = max(1, round(JUDGE_EPOCHS * n_train_all / max(1, len(train))))
    n_hold = len(hold)
    torch.manual_seed(seed)
    judge = Judge(num_classes).to(device)
    opt = torch.optim.AdamW(judge.parameters(), lr=lr, weight_decay=1e-4)
    steps = epochs * (len(train) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=max(1, steps))
    judge.train()
    for _ in range(epochs):
        order = train[torch.randperm(len(train), generator=g)]
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            x = images[idx]
            if augment:
                x = augment_digits(x, g)
            else:  # the earlier recipe: one random shift by up to 2 pixels per batch
                dx, dy = torch.randint(-2, 3, (2,), generator=g).tolist()
                x = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
            loss = F.cross_entropy(judge(x.to(device)), labels[idx].to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    judge.eval()
    acc = judge_accuracy(judge, images[own_hold], labels[own_hold])
    if report is not None:
        report.update(heldout_accuracy=acc, epochs=epochs, augment=augment, n_heldout=len(own_hold),
                      n_train=len(train), heldout_accuracy_all=judge_accuracy(judge, images[hold], labels[hold]),
                      n_heldout_all=n_hold)
        if styles is not None:
            st = np.asarray(styles)[hold.numpy()]
            with torch.no_grad():
                pred = torch.cat([judge(images[hold][i : i + 256].to(device)).argmax(1).cpu()
                                  for i in range(0, n_hold, 256)])
            ok = (pred == labels[hold]).numpy()
            report["heldout_accuracy_per_style"] = {s: float(ok[st == s].mean()) for s in sorted(set(st))}
    return judge, acc


def load_ldm_judge(path: str):
    """The quality judge published with a tiny LDM (``judge.pt`` in its snapshot folder, trained on the pool's public
    images; see :func:`hfpfl.fedbip.pretraining.report.measure_ldm`), in eval mode on the CPU; None when the folder
    has none (e.g. a real SD checkpoint)."""
    f = os.path.join(str(path), "judge.pt")
    if not os.path.isfile(f):
        return None
    judge = Judge()
    judge.load_state_dict(torch.load(f, map_location="cpu", weights_only=True))
    return judge.eval()


@torch.no_grad()
def judge_accuracy(judge, images: torch.Tensor, labels: torch.Tensor) -> float:
    if len(labels) == 0:
        return float("nan")
    dev = next(judge.parameters(), torch.empty(0)).device  # the judge's device (CPU for a parameter-free judge)
    pred = torch.cat([judge(images[i : i + 256].to(dev).float()).argmax(1).cpu() for i in range(0, len(images), 256)])
    return float((pred == labels.cpu()).float().mean())


# the Digits domains whose public splits the tiny LDM saw (hfpfl.fedbip.pool); the style judge tells them apart
STYLE_DOMAINS = ("mnist", "usps", "mnistm", "syn")
STYLE_JUDGE_EPOCHS = 4  # 0.99 held-out accuracy at 32 x 32 (16 s on one core)


def train_style_judge(image_size: int = 32, epochs: int = STYLE_JUDGE_EPOCHS, seed: int = 0, device="cpu",
                      report: dict | None = None):
    """A **style judge**: the :class:`Judge` CNN trained to tell :data:`STYLE_DOMAINS` apart on their *public* splits
    (the images the LDM saw; clients hold only train / test splits). Returns (judge, held-out accuracy).

    The class judge reads whether a synthetic image shows its label; this one reads whether it is in the client's
    domain (USPS's blurred grey strokes, MNIST-M's photo patches, SYN's coloured font tiles): the grids' "each
    client's rows keep its style", as a number. Trained without the class judge's colour inversion and channel
    permutation, which would erase the very colours that tell MNIST-M and SYN apart."""
    from .pool import pool_to_tensor
    from .pool import POOL_SPLIT_SEED, _public

    xs, ys = [], []
    for i, domain in enumerate(STYLE_DOMAINS):
        x, _ = _public(domain, POOL_SPLIT_SEED)
        xs.append(pool_to_tensor(x, image_size))
        ys.append(torch.full((len(x),), i))
    return train_judge(torch.cat(xs), torch.cat(ys), epochs=epochs, seed=seed, augment=False, report=report,
                       device=device, num_classes=len(STYLE_DOMAINS))


@torch.no_grad()
def style_fidelity(judge, images: torch.Tensor, clients: torch.Tensor, client_domains: dict[int, str]) -> dict:
    """The share of each client's images (``clients``: the client id of every row) that the style judge of
    :func:`train_style_judge` assigns to that client's domain, by domain name, and their mean over clients
    (``"mean"``). Clients whose domain is not in :data:`STYLE_DOMAINS` are left out; {} when none is in."""
    clients = torch.as_tensor(clients)
    per = {}
    for cid, domain in sorted(client_domains.items()):
        rows = clients == cid
        if domain not in STYLE_DOMAINS or not bool(rows.any()):
            continue
        n = int(rows.sum())
        per.setdefault(domain, []).append(
            judge_accuracy(judge, images[rows], torch.full((n,), STYLE_DOMAINS.index(domain))))
    if not per:
        return {}
    out = {d: float(np.mean(v)) for d, v in per.items()}
    out["mean"] = float(np.mean([a for v in per.values() for a in v]))
    return out


@functools.lru_cache(maxsize=2)
def shared_style_judge(image_size: int):
    """:func:`train_style_judge` at ``image_size``, trained once per process (seconds; every row reuses it), under a
    forked RNG so that the runs' own random draws stay as they were."""
    import logging

    with torch.random.fork_rng(devices=[]):
        judge, acc = train_style_judge(int(image_size))
    logging.getLogger("hfpfl").info("style judge (domain classifier on the public splits): held-out accuracy %.3f",
                                    acc)
    return judge


def synthetic_quality(sim, results: dict) -> None:
    """What a FedBiP run's synthetic set is, read by judges that never saw a client image, added to
    ``results["final"]`` (a study's ``metrics_hook``, and the main job's table): ``synthetic_fidelity_judge``, the
    share of images the LDM's public-image judge reads as their label (absent when the LDM ships no judge), and
    ``synthetic_style``, the share of each client's images the style judge assigns to the client's own domain (mean
    over clients whose domain it knows). Nothing for a run without a synthetic set."""
    syn = getattr(sim.algorithm, "synthetic", None)
    if not syn or len(syn["labels"]) == 0:
        return
    x = syn["images"].expand(-1, 3, -1, -1) if syn["images"].shape[1] == 1 else syn["images"]   # the judges read RGB
    final = results["final"]
    judge = load_ldm_judge(sim.algorithm.pipe.name_or_path)   # the local folder the run's pipeline loaded
    if judge is not None:
        final["synthetic_fidelity_judge"] = judge_accuracy(judge, x, syn["labels"])
    domains = {c.client_id: c.domain for c in sim.data.clients}
    if any(d in STYLE_DOMAINS for d in domains.values()):
        final["synthetic_style"] = style_fidelity(shared_style_judge(int(x.shape[-1])), x, syn["clients"],
                                                  domains).get("mean")
