"""SCAFFOLD (Karimireddy et al. 2020), option II control variates.

Server state: model x and global control c. Client keeps c_i (private). Local step: g <- g - c_i + c.
After K local steps with learning rate eta: c_i+ = c_i - c + (x - y_i) / (K eta).
Upload (delta y_i, delta c_i); server: x += eta_g * mean(delta y), c += |S|/N * mean(delta c).
Control variates are defined for plain SGD; use --momentum 0 for the paper's setting.
"""
from dataclasses import dataclass, field

import torch

from ..federated.state import snapshot
from .base import Algorithm, Update, register

CONTROL, DELTA_Y, DELTA_C = "control::", "delta_y::", "delta_c::"


@dataclass
class ScaffoldConfig:
    server_lr: float = field(default=1.0, metadata={"help": "SCAFFOLD global step size eta_g."})


@register
class Scaffold(Algorithm):
    name = "scaffold"
    Config = ScaffoldConfig

    def _param_keys(self):
        params = dict(self.model.named_parameters())
        return [k for k in self.global_keys if k in params and params[k].requires_grad]

    def init_server_state(self):
        state = super().init_server_state()
        state.update({CONTROL + k: torch.zeros_like(state[k]) for k in self._param_keys()})
        return state

    def init_private_state(self, client_id):
        return {}

    def download(self, server_state, client_id):
        return dict(server_state)  # model and global control c both travel down

    def client_update(self, client_id, down, private, round_idx):
        keys = self._param_keys()
        c = {k: down[CONTROL + k] for k in keys}
        c_i = {k: private[CONTROL + k] for k in keys} if private else {k: torch.zeros_like(c[k]) for k in keys}
        self.load_client(down, None)
        params = dict(self.model.named_parameters())
        correction = {k: c[k] - c_i[k] for k in keys}

        def before_step(model):
            for k in keys:
                if params[k].grad is not None:
                    params[k].grad.add_(correction[k])

        metrics = self.local_train(client_id, round_idx, before_step=before_step)
        y = snapshot(self.sim.model_state, self.global_keys)
        scale = 1.0 / (metrics["steps"] * self.sim.args.lr)
        c_new = {k: c_i[k] - c[k] + (down[k] - y[k]) * scale for k in keys}
        upload = {DELTA_Y + k: y[k] - down[k] if torch.is_floating_point(y[k]) else y[k] for k in self.global_keys}
        upload.update({DELTA_C + k: c_new[k] - c_i[k] for k in keys})
        return Update(client_id, upload, len(self.sim.train_data(client_id)),
                      {CONTROL + k: v for k, v in c_new.items()}, metrics)

    def aggregate(self, server_state, updates, round_idx):
        if not updates:
            return server_state
        n, m = self.sim.num_clients, len(updates)
        state = dict(server_state)
        for k in self.global_keys:
            vals = [u.upload[DELTA_Y + k] for u in updates]
            if torch.is_floating_point(vals[0]):
                state[k] = server_state[k] + self.config.server_lr * torch.stack(vals).mean(0)
            else:
                state[k] = torch.stack(vals).max(0).values
        for k in self._param_keys():
            state[CONTROL + k] = server_state[CONTROL + k] + (m / n) * torch.stack(
                [u.upload[DELTA_C + k] for u in updates]).mean(0)
        return state

    def load_client(self, down, private):
        super().load_client({k: down[k] for k in self.global_keys}, None)  # control variates are not weights
