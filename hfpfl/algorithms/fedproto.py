"""FedProto (Tan et al., AAAI 2022): only class prototypes travel; every model stays on its client.

Client i (Sec. "Local Model Update"; the per-sample form of Appendix B): minimise
CE(F_i(x), y) + lambda * mean_batch ||f_i(x) - C_bar[y]||^2 / d (samples whose class has no global prototype add 0;
the 1/d of the authors' nn.MSELoss by default, ``--proto_distance sq_l2`` drops it), then
upload C_i^(j) = mean of f_i(x) over its training samples of class j (Eq. 3, eval mode) and |D_i,j|.
Server (Eq. 6): C_bar^(j) = sum_i |D_i,j| C_i^(j) / sum_i |D_i,j| over the clients that hold class j
(``--proto_weights uniform``: the plain mean over those clients, as the authors' code). Inference: the class of the
nearest global prototype in L2 (Sec. "Prototype-based model inference"). f = the input of the head's last Linear.
"""
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import torch
from torch import nn

from ..options import non_negative, one_of, option
from ..training import iterate_batches, model_inputs
from .base import GLOBAL, PRIVATE, Algorithm, Update, register
from .fedper import is_head

PROTO, COUNT = "protos", "counts"          # parts that travel: prototypes and class counts (keys: the class as text)
SERVER = "prototypes"                      # server state: "table" [classes, d] and "known" [classes] (bool)
PSUM, WSUM = "proto_sum", "proto_weight"  # server-side running sums (never travel)


@dataclass
class FedProtoConfig:
    proto_lambda: float = option(1.0, "FedProto: weight lambda of the prototype distance (paper: 1 on MNIST/FEMNIST, "
                                      "0.1 on CIFAR-10).", check=non_negative())
    proto_weights: str = option("count", "FedProto: global prototype = class-count-weighted mean (Eq. 6) or "
                                         "'uniform' mean over the clients holding the class (authors' code).",
                                check=one_of("count", "uniform"))
    proto_distance: str = option("mse", "FedProto: the distance term per sample: 'mse' = ||f(x) - C_bar[y]||^2 / d "
                                        "(authors' code, nn.MSELoss, the scale the paper's lambdas were tuned at) or "
                                        "'sq_l2' = ||f(x) - C_bar[y]||^2 (Appendix B).",
                                 check=one_of("mse", "sq_l2"))
    #: the options that set the step size of what this method trains (named when training diverges; --lr always is)
    STEP_SIZES: ClassVar[dict[str, str]] = {"proto_lambda": "lower"}


def embedding_layer(model: nn.Module) -> nn.Linear:
    """The head's last Linear: its input is the embedding f(x)."""
    found = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and is_head(n + ".")]
    if not found:
        raise ValueError("fedproto needs a classifier head (a Linear under 'classifier', 'head' or 'fc')")
    return found[-1]


def forward_with_embedding(model: nn.Module, batch: dict):
    """(model output, f(x)) from one forward pass."""
    seen = {}
    hook = embedding_layer(model).register_forward_pre_hook(lambda m, args: seen.__setitem__("f", args[0]))
    try:
        out = model(**model_inputs(batch))
    finally:
        hook.remove()
    return out, seen["f"]


def proto_table(protos: dict, num_labels: int, like: torch.Tensor | None = None):
    """(P [num_labels, d], has [num_labels] bool) from {str(class): prototype}; None when there are none yet."""
    if not protos:
        return None
    d = next(iter(protos.values())).shape[-1]
    P, has = torch.zeros(num_labels, d), torch.zeros(num_labels, dtype=torch.bool)
    for c, p in protos.items():
        P[int(c)], has[int(c)] = p, True
    return (P, has) if like is None else (P.to(like.device, like.dtype), has.to(like.device))


class NearestPrototype(nn.Module):
    """Logits = -||f(x) - C_bar_j||^2 (argmax = nearest prototype); classes without a prototype get -inf."""

    def __init__(self, model: nn.Module, table):
        super().__init__()
        self.model, (self.P, self.has) = model, table

    def forward(self, labels=None, **inputs):
        _, f = forward_with_embedding(self.model, inputs)
        P, has = self.P.to(f.device, f.dtype), self.has.to(f.device)
        logits = -torch.cdist(f, P).pow(2)
        return SimpleNamespace(logits=logits.masked_fill(~has, float("-inf")))  # what evaluation reads


@register
class FedProto(Algorithm):
    """FedProto: only class prototypes travel; local CE + prototype distance; nearest-prototype inference."""
    name = "fedproto"
    aggregation = "stream"
    local_update = "own"
    personal_model = "own"
    Config = FedProtoConfig
    has_global_model = False   # the global state is a set of prototypes, not a classifier
    uses_server_hparams = frozenset()   # reduce averages prototypes; no model travels, no FedOpt step

    def key_role(self, key, default):
        return PRIVATE if default == GLOBAL else default   # whole model personal: no weights travel

    def init_server_state(self):
        # fixed keys from the start (checkpoints are checked against them): a class is "known" once uploaded
        d, k = embedding_layer(self.model).in_features, self.ctx.num_labels
        return {SERVER: {"table": torch.zeros(k, d), "known": torch.zeros(k, dtype=torch.bool)}}

    def download(self, server_state, client_id):
        s = server_state[SERVER]   # only the known global prototypes travel
        return {PROTO: {str(c): s["table"][c] for c in s["known"].nonzero().flatten().tolist()}}

    def aggregation_weights(self, client_ids):
        return {c: 1.0 for c in client_ids}   # the weights are per class (accumulate)

    def loss_fn(self, protos: dict):
        table, lam = proto_table(protos, self.ctx.num_labels), self.config.proto_lambda
        mse = self.config.proto_distance == "mse"

        def loss(model, batch):
            out, f = forward_with_embedding(model, batch)
            y = batch["labels"]
            ce = nn.functional.cross_entropy(out.logits, y)
            if table is None:
                return ce
            P, has = table[0].to(f.device, f.dtype), table[1].to(f.device)
            dist = ((f - P[y]) ** 2).sum(1) / (f.shape[1] if mse else 1)
            return ce + lam * (dist * has[y]).mean()
        return loss

    @torch.no_grad()
    def local_prototypes(self, data) -> tuple[dict, dict]:
        """Eq. 3: per-class mean embedding over ``data`` (eval mode), and the class counts."""
        was = self.model.training
        self.model.eval()
        sums, counts = {}, {}
        for batch in iterate_batches(data, self.ctx.run.eval_batch_size, shuffle=False, last="keep"):
            batch = {k: v.to(self.ctx.device) for k, v in batch.items()}
            f = forward_with_embedding(self.model, batch)[1].double()
            for c in batch["labels"].unique().tolist():
                m = batch["labels"] == c
                sums[str(c)] = sums.get(str(c), 0) + f[m].sum(0)
                counts[str(c)] = counts.get(str(c), 0) + int(m.sum())
        self.model.train(was)
        return ({c: (s / counts[c]).float().cpu() for c, s in sums.items()},
                {c: torch.tensor(n, dtype=torch.int64) for c, n in counts.items()})

    def client_update(self, client_id, down, private, round_idx):
        self.load_client(down, private)
        metrics = self.local_train(client_id, round_idx, loss_fn=self.loss_fn(down[PROTO]))
        protos, counts = self.local_prototypes(self.ctx.train_data(client_id))
        upload = {PROTO: protos, COUNT: counts} if self.config.proto_weights == "count" else {PROTO: protos}
        return Update(client_id, upload, len(self.ctx.train_data(client_id)),
                      {"model": self.ctx.snapshot(self.private_keys)}, metrics)

    def accumulate(self, sums, update, coef):
        counts = update.upload.get(COUNT, {})
        for c, p in update.upload[PROTO].items():
            w = float(counts[c]) if self.config.proto_weights == "count" else 1.0
            sums.add(PSUM, {c: p}, w)
            sums.add(WSUM, {c: torch.ones(1, dtype=torch.float64)}, w)

    def reduce(self, server_state, sums, round_idx):
        if PSUM not in sums:
            return server_state
        f64 = {c: torch.zeros((), dtype=torch.float64) for c in sums.sums[PSUM]}
        num, den = sums.get(PSUM, f64), sums.get(WSUM, f64)
        table, known = server_state[SERVER]["table"].clone(), server_state[SERVER]["known"].clone()
        for c in num:  # classes nobody uploaded this round keep their last global prototype
            table[int(c)], known[int(c)] = (num[c] / den[c]).float(), True
        return {**server_state, SERVER: {"table": table, "known": known}}

    def predictor(self, model, server_state):
        """Nearest global prototype; the model's own head before any prototype exists."""
        s = server_state[SERVER]
        return NearestPrototype(model, (s["table"], s["known"])) if bool(s["known"].any()) else model

    def load_personal(self, client_id, server_state, private, round_idx):
        return self.predictor(super().load_personal(client_id, server_state, private, round_idx), server_state)

    def personalize_new_client(self, client_id, server_state, data, round_idx):
        """Sec. "Model Inference": a new client fine-tunes its model on its own objective, global prototypes fixed."""
        self.load_client({}, self.init_private_state(client_id))
        if self.ctx.run.new_client_epochs > 0:
            self.local_train(client_id, round_idx, epochs=self.ctx.run.new_client_epochs, tag="new-client",
                             data=data, loss_fn=self.loss_fn(self.download(server_state, client_id)[PROTO]))
        return self.predictor(self.model, server_state)
