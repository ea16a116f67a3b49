"""Optimizers on stacked client tensors: torch's SGD (momentum, weight decay), Adam and AdamW update rules written
out on ``[clients, *shape]`` parameters and state, so each client steps as its own optimizer would."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..context import HParams


@dataclass
class StackedOptimizer:
    hp: HParams
    state: dict  # name -> {field: stacked tensor}

    def step(self, params: dict, grads: dict, idx, step: int) -> None:
        """Update ``params[k][idx]`` in place, as torch's SGD / Adam / AdamW would for each client."""
        hp = self.hp
        if hp.optimizer == "sgd" and not (hp.weight_decay or hp.momentum) and idx is None:
            # plain SGD, every client stepping: one fused call for all tensors (torch's foreach SGD does the same)
            torch._foreach_add_([params[k] for k in grads], list(grads.values()), alpha=-hp.lr)
            return
        for k, g in grads.items():
            p = params[k] if idx is None else params[k][idx]
            st = self.state.setdefault(k, {})
            if hp.optimizer == "sgd":
                if hp.weight_decay:
                    g = g.add(p, alpha=hp.weight_decay)
                if hp.momentum:
                    if "momentum_buffer" not in st:
                        st["momentum_buffer"] = torch.zeros_like(params[k])
                        st["_started"] = torch.zeros(len(params[k]), dtype=torch.bool, device=p.device)
                    buf_all, started = st["momentum_buffer"], st["_started"]
                    buf = buf_all if idx is None else buf_all[idx]
                    first = ~(started if idx is None else started[idx])
                    shape = (-1,) + (1,) * (g.dim() - 1)
                    # first step: buf = g (torch.clone(grad)); later: buf = momentum * buf + g
                    buf = torch.where(first.view(shape), g, buf.mul(hp.momentum).add(g))
                    if idx is None:
                        buf_all.copy_(buf)
                        started.fill_(True)
                    else:
                        buf_all[idx] = buf
                        started[idx] = True
                    g = buf
                if idx is None:  # every client steps: in place (the same values, no copy of the stack)
                    params[k].add_(g, alpha=-hp.lr)
                    continue
                p = p.add(g, alpha=-hp.lr)
            else:  # adam / adamw (torch's non-amsgrad update, betas (0.9, 0.999), eps 1e-8)
                beta1, beta2, eps = 0.9, 0.999, 1e-8
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(params[k])
                    st["exp_avg_sq"] = torch.zeros_like(params[k])
                m = st["exp_avg"] if idx is None else st["exp_avg"][idx]
                v = st["exp_avg_sq"] if idx is None else st["exp_avg_sq"][idx]
                if hp.weight_decay:
                    if hp.optimizer == "adamw":
                        p = p.mul(1 - hp.lr * hp.weight_decay)
                    else:
                        g = g.add(p, alpha=hp.weight_decay)
                m = m.lerp(g, 1 - beta1)
                v = v.mul(beta2).addcmul(g, g, value=1 - beta2)
                bc1 = 1 - beta1 ** step
                bc2_sqrt = (1 - beta2 ** step) ** 0.5
                denom = (v.sqrt() / bc2_sqrt).add_(eps)
                p = p.addcdiv(m, denom, value=-(hp.lr / bc1))
                if idx is None:
                    st["exp_avg"].copy_(m)
                    st["exp_avg_sq"].copy_(v)
                else:
                    st["exp_avg"][idx] = m
                    st["exp_avg_sq"][idx] = v
            if idx is None:
                params[k].copy_(p)
            else:
                params[k][idx] = p
