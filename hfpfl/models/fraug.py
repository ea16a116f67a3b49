"""FRAug's modules (Chen et al., ICCV 2023; dissertation ch. 2; method card ``docs/methods/fraug.md``).

- :class:`EmbeddingGenerator` g (shared, FedAvg-aggregated): ``concat(z, onehot(y)) -> FC -> BN -> ReLU -> FC -> BN
  -> ReLU`` (paper Table 4): a client-agnostic, non-negative embedding v_hat in R^{d_u}.
- :class:`RTNet` m^k (local, never leaves the client): ``FC(d_u, d_z) -> BN -> ReLU -> FC(d_z, d_u) -> BN`` (paper
  Table 5), no final activation: a signed residual.
- :class:`FRAugModel`: the classification model (a transformers ``ResNetForImageClassification``; f = ``resnet`` up
  to the pooled embedding, h = the last linear layer) plus g, m^k and the EMA class prototypes (a buffer), so that
  the engine's key roles say what travels (f, h without their BatchNorms, and g) and what stays (BNs of f, m^k,
  prototypes), and its per-client optimizer state covers all three optimizers.
- :class:`DigitsCNN`: the paper's 6-layer Digits CNN (appendix Table 3), for the parameter accounting of Table 4.

The generator's and the RTNet's BatchNorms use batch statistics only (``track_running_stats=False``): both networks
are only ever run on freshly sampled training batches, so running statistics would be dead state -- and dead state
that travels would break the paper's communication formula 4 * (|theta| - |BN_local| + |G|).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _bn(d: int) -> nn.BatchNorm1d:
    return nn.BatchNorm1d(d, track_running_stats=False)


class EmbeddingGenerator(nn.Module):
    """g(z, y): (B, d_z) noise and (B,) labels -> (B, d_u) non-negative embeddings."""

    def __init__(self, d_z: int, num_labels: int, d_u: int):
        super().__init__()
        self.d_z, self.num_labels, self.d_u = d_z, num_labels, d_u
        self.net = nn.Sequential(nn.Linear(d_z + num_labels, d_u), _bn(d_u), nn.ReLU(),
                                 nn.Linear(d_u, d_u), _bn(d_u), nn.ReLU())

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z, F.one_hot(labels, self.num_labels).to(z.dtype)], dim=1))


class RTNet(nn.Module):
    """m(v): (B, d_u) -> (B, d_u) residual (no final activation). ``label_conditioned`` is the authors' code variant
    (input ``concat(v, onehot(y))``), off by default as in the dissertation."""

    def __init__(self, d_u: int, d_z: int, num_labels: int = 0, label_conditioned: bool = False):
        super().__init__()
        self.num_labels, self.label_conditioned = num_labels, label_conditioned
        d_in = d_u + (num_labels if label_conditioned else 0)
        self.net = nn.Sequential(nn.Linear(d_in, d_z), _bn(d_z), nn.ReLU(), nn.Linear(d_z, d_u), _bn(d_u))

    def forward(self, v: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.label_conditioned:
            v = torch.cat([v, F.one_hot(labels, self.num_labels).to(v.dtype)], dim=1)
        return self.net(v)


def generator_num_parameters(d_z: int, num_labels: int, d_u: int) -> int:
    """|g| = (d_z+C) d_u + d_u + 2 d_u + d_u^2 + d_u + 2 d_u (the paper's generator; BN affine counted)."""
    return (d_z + num_labels) * d_u + d_u + 2 * d_u + d_u * d_u + d_u + 2 * d_u


def rtnet_num_parameters(d_u: int, d_z: int) -> int:
    """|m| = d_u d_z + d_z + 2 d_z + d_z d_u + d_u + 2 d_u (the paper's RTNet)."""
    return d_u * d_z + d_z + 2 * d_z + d_z * d_u + d_u + 2 * d_u


class FRAugModel(nn.Module):
    """The classifier (``net``) with FRAug's generator, RTNet and EMA prototypes attached.

    ``forward`` is the classifier's own forward (HF outputs with ``.logits`` / ``.loss``), so evaluation and the
    default loss see a plain classifier; ``embed(x)`` is f and ``head(u)`` is h."""

    def __init__(self, classifier: nn.Module, d_z: int, rtnet_label_conditioned: bool = False):
        super().__init__()
        if not (hasattr(classifier, "resnet") and isinstance(getattr(classifier, "classifier", None), nn.Sequential)):
            raise ValueError("fraug needs a transformers ResNetForImageClassification (f = .resnet, h = .classifier); "
                             f"got {type(classifier).__name__} (adapters are not supported: use --adapter none)")
        self.net = classifier
        head = classifier.classifier[-1]
        self.d_u, self.num_labels = head.in_features, head.out_features
        self.generator = EmbeddingGenerator(d_z, self.num_labels, self.d_u)
        self.rtnet = RTNet(self.d_u, d_z, self.num_labels, rtnet_label_conditioned)
        self.register_buffer("prototypes", torch.zeros(self.num_labels, self.d_u))

    @property
    def config(self):
        return self.net.config

    def forward(self, *args, **kwargs):
        return self.net(*args, **kwargs)

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.net.resnet(pixel_values).pooler_output.flatten(1)

    def head(self, u: torch.Tensor) -> torch.Tensor:
        return self.net.classifier(u)

    def head_parameters(self) -> list[nn.Parameter]:
        return list(self.net.classifier.parameters())

    def body_parameters(self) -> list[nn.Parameter]:
        return list(self.net.resnet.parameters())


class DigitsCNN(nn.Module):
    """The paper's Digits CNN (appendix Table 3) with FC(8192, 2048), i.e. 32x32 input (the table's FC size implies 32x32): 18,151,370
    parameters with 10 classes. Used for parameter accounting; the simulations use the engine's HF ResNet."""

    def __init__(self, num_labels: int = 10, flat: int = 8192):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 5, 1, 2), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(64, 64, 5, 1, 2), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(64, 128, 5, 1, 2), nn.BatchNorm2d(128), nn.ReLU(), nn.Flatten(),
            nn.Linear(flat, 2048), nn.BatchNorm1d(2048), nn.ReLU(),
            nn.Linear(2048, 512), nn.BatchNorm1d(512), nn.ReLU())
        self.head = nn.Linear(512, num_labels)

    def forward(self, x):
        return self.head(self.features(x))


# ------------------------------------------------------------------------------------------------ losses
def mmd(x: torch.Tensor, y: torch.Tensor, kernel_mul: float = 2.0, kernel_num: int = 5) -> torch.Tensor:
    """Biased squared MMD with a sum of ``kernel_num`` Gaussian kernels exp(-d^2 / (bw * mul^i)), bw = mean pairwise
    squared distance / mul^(num // 2) (the authors' ``MMD_loss``). Written with separate means
    (mean K_xx + mean K_yy - 2 mean K_xy), which equals the code's form for equal set sizes and stays valid when they
    differ (a choice the paper leaves open; docs/methods/fraug.md). The bandwidth is a statistic of the data, not a path for gradients (detached, as the
    code's ``.data``)."""
    n = x.shape[0]
    total = torch.cat([x, y], dim=0)
    d2 = torch.cdist(total, total).pow(2)
    m = total.shape[0]
    bw = d2.detach().sum() / max(m * m - m, 1)
    bw = bw.clamp_min(1e-12) / kernel_mul ** (kernel_num // 2)
    k = sum(torch.exp(-d2 / (bw * kernel_mul ** i)) for i in range(kernel_num))
    return k[:n, :n].mean() + k[n:, n:].mean() - 2 * k[:n, n:].mean()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_j p_j log p_j, batch mean."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1).mean()
