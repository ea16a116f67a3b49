"""A CIFAR-style ResNet whose every normalization layer can be conditioned on a client embedding (FedPCE).

``CondNormResNetConfig(conditional=True)``: every norm layer is an affine-free InstanceNorm whose (beta, gamma) come
from a shared per-layer MLP_k(v) = W2 ReLU(W1 v + b1) + b2 (E -> h -> 2C, split as (beta, delta_gamma),
gamma = 1 + delta_gamma: spec fedpce.md section 6 #3/#4), v = the model's ``client_embedding`` (E numbers, the only
per-client state). ``conditional=False``: the same topology with ordinary affine InstanceNorms (the baselines'
IN-ResNet: FedAvg, FedProx, FedBN, FedPer).

Topology (paper 000 section 4.3, spec section 2.3): 3x3/s1 stem conv + norm, four stages of BasicBlocks with
1x1-conv + norm projection shortcuts where the stride or width changes, global average pooling, one extra norm on the
pooled features before the final linear layer (K = 21 norm layers at ResNet-18 depth). On the [B, C] head features
instance norm is degenerate (spec section 6 #5): the head norm normalizes over the C features per sample.

transformers' ``ResNetBasicLayer`` / ``ResNetConvLayer`` hard-wire ``nn.BatchNorm2d`` and take no conditioning input,
so the blocks are written here; the model is a ``PreTrainedModel`` registered with the Auto classes
(``save_pretrained`` / ``from_pretrained`` / ``AutoModelForImageClassification``) and returns
``ImageClassifierOutput`` with the cross-entropy loss like the HF ResNet.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForImageClassification, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ImageClassifierOutput

EMBEDDING_KEY = "client_embedding"


class CondNormResNetConfig(PretrainedConfig):
    model_type = "cond_norm_resnet"

    def __init__(self, num_channels: int = 3, hidden_sizes=(64, 128, 256, 512), depths=(2, 2, 2, 2),
                 conditional: bool = True, embedding_dim: int = 32, mlp_hidden: int = 64, norm_eps: float = 1e-5,
                 **kwargs):
        self.num_channels = num_channels
        self.hidden_sizes = list(hidden_sizes)
        self.depths = list(depths)
        self.conditional = conditional
        self.embedding_dim = embedding_dim
        self.mlp_hidden = mlp_hidden
        self.norm_eps = norm_eps
        super().__init__(**kwargs)


class CondNorm(nn.Module):
    """Instance norm (4-D input) or per-sample feature norm (2-D input) with an affine that is either a free
    (weight, bias) pair or generated from the client embedding by this layer's MLP."""

    def __init__(self, channels: int, config: CondNormResNetConfig):
        super().__init__()
        self.channels, self.eps, self.conditional = channels, config.norm_eps, config.conditional
        if self.conditional:
            self.mlp = nn.Sequential(nn.Linear(config.embedding_dim, config.mlp_hidden), nn.ReLU(),
                                     nn.Linear(config.mlp_hidden, 2 * channels))
        else:
            self.weight = nn.Parameter(torch.ones(channels))
            self.bias = nn.Parameter(torch.zeros(channels))

    def affine(self, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.conditional:
            return self.weight, self.bias
        beta, dgamma = self.mlp(v).split(self.channels)       # Eq. 3, output ordered (beta, gamma)
        return 1.0 + dgamma, beta

    def forward(self, x: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() == 4:
            y = F.instance_norm(x, eps=self.eps)
            shape = (1, -1, 1, 1)
        else:
            y = F.layer_norm(x, (x.shape[-1],), eps=self.eps)
            shape = (1, -1)
        gamma, beta = self.affine(v)
        return y * gamma.view(shape) + beta.view(shape)       # Eq. 4


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, config):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = CondNorm(cout, config)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = CondNorm(cout, config)
        self.has_shortcut = stride != 1 or cin != cout
        if self.has_shortcut:
            self.shortcut_conv = nn.Conv2d(cin, cout, 1, stride, bias=False)
            self.shortcut_norm = CondNorm(cout, config)

    def forward(self, x, v):
        out = F.relu(self.norm1(self.conv1(x), v))
        out = self.norm2(self.conv2(out), v)
        sc = self.shortcut_norm(self.shortcut_conv(x), v) if self.has_shortcut else x
        return F.relu(out + sc)


class CondNormResNetForImageClassification(PreTrainedModel):
    config_class = CondNormResNetConfig
    main_input_name = "pixel_values"
    base_model_prefix = "resnet"

    def __init__(self, config: CondNormResNetConfig):
        super().__init__(config)
        w = config.hidden_sizes
        self.stem_conv = nn.Conv2d(config.num_channels, w[0], 3, 1, 1, bias=False)
        self.stem_norm = CondNorm(w[0], config)
        blocks, cin = [], w[0]
        for i, (cout, depth) in enumerate(zip(w, config.depths)):
            for j in range(depth):
                blocks.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1, config))
                cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.head_norm = CondNorm(w[-1], config)
        self.classifier = nn.Linear(w[-1], config.num_labels)
        if config.conditional:   # v_n lives in the model; the engine swaps each client's value in (private key)
            self.client_embedding = nn.Parameter(torch.zeros(config.embedding_dim))
        self.post_init()

    def _init_weights(self, module):  # keep PyTorch's default initialisation (spec section 6 #3)
        pass

    def norm_layers(self) -> list[tuple[str, CondNorm]]:
        return [(n, m) for n, m in self.named_modules() if isinstance(m, CondNorm)]

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, **kwargs):
        v = self.client_embedding if self.config.conditional else None
        x = F.relu(self.stem_norm(self.stem_conv(pixel_values), v))
        for block in self.blocks:
            x = block(x, v)
        x = self.head_norm(x.mean(dim=(2, 3)), v)
        logits = self.classifier(x)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ImageClassifierOutput(loss=loss, logits=logits)


AutoConfig.register(CondNormResNetConfig.model_type, CondNormResNetConfig, exist_ok=True)
AutoModelForImageClassification.register(CondNormResNetConfig, CondNormResNetForImageClassification, exist_ok=True)
