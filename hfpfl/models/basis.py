"""FedBasis' basis-combined network (paper 004, spec adapters_fedbasis.md PART B): K+1 copies ("bases") of a
template network's parameters; a client's network is, group by group (ResNet: stem+stage 1, stages 2-4, head),
theta[p] = 1/2 v'[p] + 1/2 sum_k softmax(psi_g / tau)[k] v_k[p] (v' = the major basis, B2.2). The combined
parameters are built once per forward (per mini-batch) and run through the template with
``torch.func.functional_call``: inference costs one network whatever K is; :meth:`combined_state` exports that
single network's state dict (load it into the template architecture to deploy).

State-dict keys: ``bases.<k>.<param path with '.'->'__'>`` (k = 0 is the major basis) and ``coef.<group>`` (psi).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call
from transformers.modeling_outputs import ImageClassifierOutput


def resnet_groups(template) -> dict[str, str]:
    """Parameter name -> group for :class:`CondNormResNetForImageClassification` (one group per stage + head)."""
    depths = template.config.depths
    stage_of_block = [s for s, d in enumerate(depths) for _ in range(d)]
    out = {}
    for n, _ in template.named_parameters():
        if n.startswith("stem_"):
            out[n] = "layer1"
        elif n.startswith("blocks."):
            out[n] = f"layer{stage_of_block[int(n.split('.')[1])] + 1}"
        else:
            out[n] = "fc"
    return out


class BasisCombinedModel(nn.Module):
    def __init__(self, template: nn.Module, num_bases: int, groups: dict[str, str], major: bool = True,
                 noise: float = 0.0):
        super().__init__()
        self.num_bases, self.major = num_bases, major
        names = [n for n, _ in template.named_parameters()]
        self.groups = groups
        self.group_names = sorted(set(groups.values()))
        self.bases = nn.ModuleList()
        for _ in range(num_bases + (1 if major else 0)):
            pd = nn.ParameterDict({n.replace(".", "__"): nn.Parameter(p.detach().clone())
                                   for n, p in template.named_parameters()})
            self.bases.append(pd)
        self.coef = nn.ParameterDict({g: nn.Parameter(torch.zeros(num_bases)) for g in self.group_names})
        self.temperature = 1.0
        self.major_only = False   # FedAvg warm start: the network is the major basis v' alone
        self.fixed_alpha: dict[str, torch.Tensor] | None = None   # sharpened, detached (improved training step 4)
        self._names = names
        object.__setattr__(self, "_template", template.to("meta"))   # architecture only; not a submodule
        self.config = template.config

    def alphas(self) -> dict[str, torch.Tensor]:
        if self.fixed_alpha is not None:
            return self.fixed_alpha
        return {g: torch.softmax(self.coef[g] / self.temperature, 0) for g in self.group_names}

    def combined_params(self) -> dict[str, torch.Tensor]:
        if self.major_only:
            return {n: self.bases[0][n.replace(".", "__")] for n in self._names}
        a = self.alphas()
        first = 1 if self.major else 0
        out = {}
        for n in self._names:
            key = n.replace(".", "__")
            mix = sum(a[self.groups[n]][k] * self.bases[first + k][key] for k in range(self.num_bases))
            out[n] = 0.5 * self.bases[0][key] + 0.5 * mix if self.major else mix
        return out

    @torch.no_grad()
    def combined_state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.combined_params().items()}

    def forward(self, pixel_values, labels=None, **kwargs):
        out = functional_call(self._template, self.combined_params(), (pixel_values,), {"labels": labels})
        return ImageClassifierOutput(loss=out.loss, logits=out.logits)
