"""A member's per-client score: the validation loss of each *locally trained* model w^k (dissertation ch. 4, A2.1).

The engine aggregates the uploads inside ``step()`` and keeps no copy of w^k, so the score is taken right after each
client's local update: the uploaded model part is loaded into ``ctx.model`` (a method may train more after w^k, as
Ditto's personal model) and evaluated on that client's val split; a method that uploads no model part (SCAFFOLD's
deltas) is scored on the model its update leaves. Evaluation is in eval mode and changes no weights or statistics."""
from __future__ import annotations

from ..federated.callbacks import Callback
from ..federated.state import MODEL


class ValidationScorer(Callback):
    """Records ``member.scores[client_id]`` after each client's local update of the member's simulation."""

    needs_each_client = True  # it reads each client's own upload as it is produced: clients train one by one

    def __init__(self, member):
        self.member = member

    def after_client_update(self, sim, client_id, update) -> None:
        ctx = sim.algorithm.ctx
        if MODEL in update.upload:  # score w^k as uploaded: Ditto, e.g., leaves its personal model in ctx.model
            ctx.load(update.upload[MODEL])
        res = ctx.evaluate(ctx.model, ctx.val_data(client_id))
        self.member.scores[client_id] = float(res["loss"])
