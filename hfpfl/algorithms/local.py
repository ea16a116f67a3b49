"""Local-only training: every key is private, nothing travels, no aggregation."""
from .base import GLOBAL, PRIVATE, Algorithm, register


@register
class LocalOnly(Algorithm):
    name = "local"
    has_global_model = False
    uses_server_hparams = frozenset()  # nothing is aggregated

    def key_role(self, key, default):
        return PRIVATE if default == GLOBAL else default

    def reduce(self, server_state, sums, round_idx):
        return server_state  # nothing travels, nothing to aggregate
