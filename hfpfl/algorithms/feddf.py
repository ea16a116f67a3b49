"""FedDF-style ensemble distillation (Lin et al., NeurIPS 2020): FedAvg (sample-weighted) of the uploaded models,
then the average is distilled on the unlabeled public pool from the logit ensemble of the uploaded client models.
Works on the full model or, with --adapter, on the adapter (same KD function as PerAda: :mod:`.distill`)."""
from .base import MODEL, Algorithm, register
from .distill import KDConfig, ensemble_distill, push_global_adapter


@register
class FedDF(Algorithm):
    """FedDF: FedAvg + server-side ensemble distillation on unlabeled public data."""

    name = "feddf"
    aggregation = "gather"
    Config = KDConfig

    def aggregate(self, server_state, updates, round_idx):
        state = super().aggregate(server_state, updates, round_idx)
        self.last_kd = {}
        if updates and self.config.kd_active(round_idx):
            avg = {k: state[MODEL][k] for k in self.global_keys}
            distilled, self.last_kd = ensemble_distill(self, avg, [u.upload[MODEL] for u in updates], self.config,
                                                       round_idx)
            state = {**state, MODEL: {**state[MODEL], **distilled}}
        if self.config.push_adapters_to_hub_cache:
            push_global_adapter(self, {k: state[MODEL][k] for k in self.global_keys}, round_idx,
                                self.config.push_adapters_to_hub_cache)
        return state
