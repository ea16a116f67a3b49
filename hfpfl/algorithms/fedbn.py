"""FedBN (Li et al. 2021): normalization layers (affine + running statistics) stay local and never travel."""
from .base import GLOBAL, PRIVATE, Algorithm, register


def norm_key_prefixes(model) -> tuple[str, ...]:
    from torch import nn
    norm_types = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm)
    return tuple(name + "." for name, m in model.named_modules() if isinstance(m, norm_types))


@register
class FedBN(Algorithm):
    name = "fedbn"
    has_global_model = False  # there is no global normalization: evaluation is per client

    def key_role(self, key, default):
        if not hasattr(self, "_norm_prefixes"):
            self._norm_prefixes = norm_key_prefixes(self.model)
        if default == GLOBAL and key.startswith(self._norm_prefixes):
            return PRIVATE
        return default
