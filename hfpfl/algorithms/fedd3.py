"""FedD3 (Song et al., "Federated Learning via Decentralized Dataset Distillation in Resource-Constrained Edge
Environments", IJCNN 2023), a one-shot baseline of the FedBiP paper's Tables 1-2 (dissertation ch. 5, App. A: "we
adopt Kernel Inducing Points (KIP) to distill the original dataset into 1 image per class per domain and transmit
them to the central server").

One round (``one_shot = True``):

* **client**: distils its real train split with KIP (Nguyen et al., ICLR 2021) into ``images_per_class`` images per
  class it holds and uploads them with their labels (part ``"distilled"``), nothing else. KIP fits support images
  X_s (labels Y_s fixed one-hot) so that kernel ridge regression from them predicts the client's real labels:

      L(X_s) = 1/2 * mean over the real images and classes of (Y_t - K(X_t, X_s) (K(X_s, X_s) + lam I)^-1 Y_s)^2,
      lam = reg * trace(K(X_s, X_s)) / n_s   (KIP's regularisation, relative to the kernel's scale),

  with the RBF kernel K(a, b) = exp(-||a - b||^2 / (gamma * D)), D the number of pixels x channels (an RBF kernel is
  one of KIP's kernels; its FC / conv NTKs need a neural-tangents library), full-batch Adam on X_s, each pixel
  clipped to the model inputs' [-1, 1] after every step, X_s initialised from random real images of each class
  (KIP's initialisation).
* **server**: trains the classifier on the union of the uploads, exactly ``classifier_steps`` steps with the engine's
  training loop (the budget every row of a FedBiP comparison shares).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..options import at_least, non_negative, positive, validate
from ..training import TensorData
from .base import MODEL, Algorithm, Update, register

PART = "distilled"


@dataclass
class FedD3Config:
    images_per_class: int = field(default=1, metadata={
        "help": "Distilled images per class each client uploads (dissertation ch. 5, App. A: 1 per class per domain).",
        "check": at_least(1)})
    kip_steps: int = field(default=200, metadata={"help": "Adam steps of the clients' KIP distillation.",
                                                  "check": at_least(0)})
    kip_lr: float = field(default=0.01, metadata={"help": "Adam learning rate of the distilled pixels.",
                                                  "check": positive()})
    kip_reg: float = field(default=1e-6, metadata={
        "help": "Kernel ridge regularisation, relative to trace(K_ss) / n_s (KIP's convention).",
        "check": non_negative()})
    kernel_gamma: float = field(default=1.0, metadata={
        "help": "RBF bandwidth: K(a, b) = exp(-||a - b||^2 / (gamma * D)), D the pixels x channels.",
        "check": positive()})
    classifier_steps: int = field(default=500, metadata={
        "help": "Server classifier steps on the union of the distilled sets.", "check": at_least(1)})

    def __post_init__(self):
        validate(self)


def rbf_kernel(a: torch.Tensor, b: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """K[i, j] = exp(-||a_i - b_j||^2 / (gamma * D)) over flattened inputs, D their dimension."""
    a, b = a.flatten(1), b.flatten(1)
    sq = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
    return torch.exp(-sq.clamp_min(0) / (gamma * a.shape[1]))


def kip_loss(x_support, y_support, x_target, y_target, reg: float = 1e-6, gamma: float = 1.0) -> torch.Tensor:
    """KIP's loss: 1/2 mean((Y_t - K_ts (K_ss + lam I)^-1 Y_s)^2), lam = reg * trace(K_ss) / n_s."""
    k_ss = rbf_kernel(x_support, x_support, gamma)
    k_ts = rbf_kernel(x_target, x_support, gamma)
    n = len(x_support)
    lam = reg * torch.trace(k_ss) / n
    pred = k_ts @ torch.linalg.solve(k_ss + lam * torch.eye(n, dtype=k_ss.dtype), y_support)
    return 0.5 * ((y_target - pred) ** 2).mean()


def init_support(x: torch.Tensor, y: torch.Tensor, per_class: int, generator: torch.Generator | None = None):
    """``per_class`` random real images of every class present (with replacement if a class has fewer), in class
    order: KIP's initialisation."""
    xs, ys = [], []
    for c in sorted(y.unique().tolist()):
        idx = (y == c).nonzero().flatten()
        pick = idx[torch.randint(0, len(idx), (per_class,), generator=generator)] if len(idx) < per_class else \
            idx[torch.randperm(len(idx), generator=generator)[:per_class]]
        xs.append(x[pick])
        ys.append(torch.full((per_class,), c, dtype=torch.long))
    return torch.cat(xs).clone(), torch.cat(ys)


def distill(x: torch.Tensor, y: torch.Tensor, num_classes: int, per_class: int, steps: int, lr: float, reg: float,
            gamma: float, generator: torch.Generator | None):
    """KIP on one client's images: returns (distilled images, their labels, loss per step)."""
    x_s, y_s = init_support(x, y, per_class, generator)
    x_s = x_s.float().requires_grad_(True)
    onehot_s = torch.nn.functional.one_hot(y_s, num_classes).float()
    onehot_t = torch.nn.functional.one_hot(y, num_classes).float()
    opt = torch.optim.Adam([x_s], lr=lr)
    losses = []
    for _ in range(steps):
        loss = kip_loss(x_s, onehot_s, x.float(), onehot_t, reg, gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            x_s.clamp_(-1.0, 1.0)
        losses.append(float(loss.detach()))
    return x_s.detach(), y_s, losses


@register
class FedD3(Algorithm):
    """FedD3: clients upload a KIP-distilled set once; the server trains the classifier on their union."""

    name = "fedd3"
    aggregation = "gather"
    local_update = "own"
    personal_model = "own"
    Config = FedD3Config
    one_shot = True
    # clients distil with the config's Adam; the server trains with the run's optimizer and classifier_steps
    uses_server_hparams = frozenset()
    uses_client_hparams = frozenset()

    def download(self, server_state, client_id):
        return {}

    def init_private_state(self, client_id):
        return {}

    def client_update(self, client_id, down, private, round_idx):
        cfg, data = self.config, self.ctx.train_data(client_id)
        x_s, y_s, losses = distill(data.pixel_values, data.labels, self.ctx.data.num_labels, cfg.images_per_class,
                                   cfg.kip_steps, cfg.kip_lr, cfg.kip_reg, cfg.kernel_gamma,
                                   self.ctx.generator(round_idx, client_id, "fedd3-kip"))
        metrics = {"kip_loss_first": losses[0], "kip_loss_last": losses[-1]} if losses else {}
        return Update(client_id, upload={PART: {"pixel_values": x_s, "labels": y_s}}, num_samples=len(data),
                      metrics=metrics)

    def aggregate(self, server_state, updates, round_idx):
        if not updates:
            return server_state
        ups = sorted(updates, key=lambda u: u.client_id)
        data = TensorData(torch.cat([u.upload[PART]["pixel_values"] for u in ups]),
                          torch.cat([u.upload[PART]["labels"] for u in ups]))
        self.ctx.load({k: server_state[MODEL][k] for k in self.global_keys})
        self.server_training = self.local_train(-1, round_idx, steps=self.config.classifier_steps, data=data,
                                                tag="fedd3-classifier")
        return {**server_state, MODEL: self.ctx.snapshot(self.global_keys)}

    def load_personal(self, client_id, server_state, private, round_idx):
        return self.load_global(server_state)

    def personalize_new_client(self, client_id, server_state, data, round_idx):
        return self.load_global(server_state)
