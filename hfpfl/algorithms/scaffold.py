"""SCAFFOLD (Karimireddy et al. 2020), option II control variates.

Server state: the model x (part ``"model"``) and the global control c (part ``"control"``). Client i keeps c_i
(private part ``"control"``). Local step: g <- g - c_i + c. After K local SGD steps with learning rate eta:
c_i+ = c_i - c + (x - y_i) / (K eta). Upload (delta y_i, delta c_i) as parts ``"delta_y"`` and ``"delta_c"``;
server: x += eta_g * mean(delta y), c += |S|/N * mean(delta c) (uniform means, as in the paper's Algorithm 1).
eta_g is the engine's server learning rate, ``--server_lr`` (1 = the paper's default).

Option II's formula is derived for plain SGD: momentum, Adam and weight decay change the step that c_i+ assumes,
so they are rejected (use option I or FedDyn-style corrections for those; not implemented).
"""
import torch

from .base import MODEL, Algorithm, Update, register

CONTROL, DELTA_Y, DELTA_C = "control", "delta_y", "delta_c"


def check_plain_sgd(hp) -> None:
    if hp.optimizer != "sgd" or hp.momentum != 0 or hp.weight_decay != 0:
        raise ValueError(f"scaffold's control variates (option II) assume plain SGD; got --optimizer {hp.optimizer} "
                         f"--momentum {hp.momentum} --weight_decay {hp.weight_decay}: pass --optimizer sgd "
                         "--momentum 0 --weight_decay 0")


@register
class Scaffold(Algorithm):
    name = "scaffold"
    aggregation = "stream"
    local_update = "own"
    uses_server_hparams = frozenset({"server_lr"})  # eta_g; reduce has no momentum and no decay
    # option II assumes plain SGD: momentum and weight decay must stay 0 (check_plain_sgd rejects others)
    uses_client_hparams = Algorithm.uses_client_hparams - {"momentum", "weight_decay"}

    def __init__(self, ctx, config):
        super().__init__(ctx, config)
        check_plain_sgd(ctx.run_hparams)

    def _param_keys(self):
        params = dict(self.model.named_parameters())
        return [k for k in self.global_keys if k in params and params[k].requires_grad]

    def init_server_state(self):
        state = super().init_server_state()
        state[CONTROL] = {k: torch.zeros_like(state[MODEL][k]) for k in self._param_keys()}
        return state

    def download(self, server_state, client_id):
        return {MODEL: dict(server_state[MODEL]), CONTROL: dict(server_state[CONTROL])}  # x and c both travel

    def aggregation_weights(self, client_ids):
        return {c: 1.0 for c in client_ids}  # uniform means (Algorithm 1)

    def client_update(self, client_id, down, private, round_idx):
        hp = self.ctx.hparams(client_id)
        check_plain_sgd(hp)
        keys = self._param_keys()
        c = down[CONTROL]
        c_i = (private or {}).get(CONTROL) or {k: torch.zeros_like(c[k]) for k in keys}
        self.load_client(down, private)
        params = dict(self.model.named_parameters())
        correction = {k: (c[k] - c_i[k]).to(self.ctx.device) for k in keys}

        def before_step(model):
            for k in keys:
                if params[k].grad is not None:
                    params[k].grad.add_(correction[k])

        metrics = self.local_train(client_id, round_idx, hp=hp, before_step=before_step)
        x, y = down[MODEL], self.ctx.snapshot(self.global_keys)
        scale = 1.0 / (metrics["steps"] * hp.lr)
        c_new = {k: c_i[k] - c[k] + (x[k] - y[k]) * scale for k in keys}
        upload = {DELTA_Y: {k: y[k] - x[k] if torch.is_floating_point(y[k]) else y[k] for k in self.global_keys},
                  DELTA_C: {k: c_new[k] - c_i[k] for k in keys}}
        return Update(client_id, upload, len(self.ctx.train_data(client_id)),
                      {CONTROL: c_new, MODEL: self.ctx.snapshot(self.private_keys)}, metrics)

    def accumulate(self, sums, update, coef):
        sums.add(DELTA_Y, update.upload[DELTA_Y], coef)
        sums.add(DELTA_C, update.upload[DELTA_C], coef)

    def reduce(self, server_state, sums, round_idx):
        if DELTA_Y not in sums:
            return server_state
        dy = sums.get(DELTA_Y, server_state[MODEL])
        dc = sums.get(DELTA_C, server_state[CONTROL])
        # get() gives means (weights 1, divided by |S|); |S| = the number of uploads folded in
        n, m = self.ctx.num_clients, sums.count
        eta_g = self.ctx.server_hparams().server_lr
        x = {k: server_state[MODEL][k] + eta_g * dy[k] if torch.is_floating_point(dy[k]) else dy[k]
             for k in dy}
        c = {k: server_state[CONTROL][k] + (m / n) * dc[k] for k in dc}
        return {**server_state, MODEL: {**server_state[MODEL], **x}, CONTROL: c}
