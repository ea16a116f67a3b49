"""FRAug's stage-1 classifier loss under each ``--cls_loss``, by plain arithmetic on a stub model whose every number
is known: the paper's plain sum L_cls = L_real + L_syn (dissertation ch. 2, Sec. 3.3.2, Eq. 1-2; the default) and the
authors' code's weighting (1 - rho) L_real + rho * mean(synthetic paths), rho = min(0.5, exp(gamma' (r - R)))
(users/user_FRAug.py: ``L_ratio``, ``use_homo_label_aug=2`` halves the two paths' sum).

The stub: 2 classes, embedding = the input itself, head h = identity (logits = u), generator output ignored, RTNet
residual = [0, 1] for every row, lambda_syn = 1, lambda_c = 0 (the prototypes stay zero), B_syn = 2 (c = [0, 1]).
Batch x = [[1, 0], [0, 1]], y = [0, 1]. CE of logits (a, b) for label 0 is ln(1 + e^(b - a)), for label 1
ln(1 + e^(a - b)), so:
  L_real = mean(ln(1 + e^-1), ln(1 + e^-1))                      = ln(1 + e^-1)
  path 1 = u_hat = u + [0, 1] = [[1, 1], [0, 2]]:   mean(ln 2, ln(1 + e^-2))
  path 2 = u_hat_c = 0 + [0, 1] = [[0, 1], [0, 1]] with c = [0, 1]: mean(ln(1 + e), ln(1 + e^-1))
"""
import math

import pytest
import torch
from torch import nn

from hfpfl.algorithms.fraug import FRAugConfig, FRAugStages, cls_ratio

E = math.e
L_REAL = math.log(1 + 1 / E)
PATH1 = (math.log(2) + math.log(1 + E ** -2)) / 2
PATH2 = (math.log(1 + E) + math.log(1 + 1 / E)) / 2


class _Residual(nn.Module):
    def forward(self, v, labels):
        return torch.tensor([0.0, 1.0]).expand(len(v), 2)


class _StubModel(nn.Module):
    """What FRAugStages.loss_cls reads: embed, head, prototypes, num_labels, generator, rtnet."""

    def __init__(self):
        super().__init__()
        self.num_labels = 2
        self.lin = nn.Linear(2, 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.eye(2))
            self.lin.bias.zero_()
        self.register_buffer("prototypes", torch.zeros(2, 2))
        self.generator = lambda z, labels: torch.zeros(len(z), 2)
        self.rtnet = _Residual()

    def embed(self, x):
        return x * 1.0

    def head(self, u):
        return self.lin(u)


def _loss(rho=0.5, **cfg_kw):
    st = FRAugStages(_StubModel(), FRAugConfig(d_z=3, syn_batch_size=2, **cfg_kw), lam_syn=1.0, lam_c=0.0,
                     noise=torch.Generator().manual_seed(0), rho=rho)
    batch = {"pixel_values": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "labels": torch.tensor([0, 1])}
    return float(st.loss_cls(None, batch).detach()), st


@pytest.mark.parametrize("use_ema", [True, False])
def test_default_is_the_papers_plain_sum(use_ema):
    """Eq. 1-2 (default --cls_loss sum): L_real + path 1 (+ path 2 with the EMA path); rho has no effect."""
    expected = L_REAL + PATH1 + (PATH2 if use_ema else 0.0)
    assert FRAugConfig().cls_loss == "sum"
    for rho in (0.5, 0.2):
        loss, st = _loss(rho=rho, use_ema=use_ema)
        assert loss == pytest.approx(expected, rel=1e-6)
        assert st.log["loss_cls"][-1] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("use_ema", [True, False])
def test_weighted_is_the_authors_code(use_ema):
    """--cls_loss weighted, rho = 0.2: 0.8 L_real + 0.2 (path 1 + path 2) / 2; without the EMA path (the code's
    use_homo_label_aug=0) the one path is not halved: 0.8 L_real + 0.2 path 1. The logged L_real / L_syn stay the
    unweighted terms."""
    expected = 0.8 * L_REAL + 0.2 * ((PATH1 + PATH2) / 2 if use_ema else PATH1)
    loss, st = _loss(rho=0.2, cls_loss="weighted", use_ema=use_ema)
    assert loss == pytest.approx(expected, rel=1e-6)
    assert st.log["loss_real"][-1] == pytest.approx(L_REAL, rel=1e-6)
    assert st.log["loss_syn"][-1] == pytest.approx(PATH1 + (PATH2 if use_ema else 0.0), rel=1e-6)


def test_weighted_loss_gradient_is_the_weighted_sum_of_the_terms():
    """The weighting acts on what trains: d loss / d bias of the head = 0.8 dL_real + 0.2 (dpath1 + dpath2) / 2.
    Per row, dCE/dbias = softmax(logits) - onehot(y); the rows' logits are those of the module docstring."""
    def dce(logits, y):
        p1 = 1 / (1 + math.exp(logits[0] - logits[1]))        # softmax prob of class 1
        return [(1 - p1) - (y == 0), p1 - (y == 1)]

    def mean_d(rows):
        return [sum(d[k] for d in rows) / len(rows) for k in range(2)]
    real = mean_d([dce((1, 0), 0), dce((0, 1), 1)])
    p1 = mean_d([dce((1, 1), 0), dce((0, 2), 1)])
    p2 = mean_d([dce((0, 1), 0), dce((0, 1), 1)])
    expected = [0.8 * real[k] + 0.2 * (p1[k] + p2[k]) / 2 for k in range(2)]
    st = FRAugStages(_StubModel(), FRAugConfig(d_z=3, syn_batch_size=2, cls_loss="weighted"), lam_syn=1.0,
                     lam_c=0.0, noise=torch.Generator().manual_seed(0), rho=0.2)
    batch = {"pixel_values": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "labels": torch.tensor([0, 1])}
    st.loss_cls(None, batch).backward()
    assert st.m.lin.bias.grad.tolist() == pytest.approx(expected, abs=1e-6)


def test_cls_ratio_schedule_by_hand():
    """rho = min(0.5, exp(gamma (r - R))): r = 100, R = 200, gamma = 0.01 -> e^-1 = 0.3679; r = 190 -> e^-0.1 =
    0.905, capped at 0.5; the code's Digits gamma 0.002 over R = 200 gives e^-0.4 = 0.670 at r = 0: 0.5 throughout."""
    assert cls_ratio(100, 200, 0.01) == pytest.approx(math.exp(-1))
    assert cls_ratio(190, 200, 0.01) == 0.5
    assert cls_ratio(0, 200, 0.002) == 0.5
    assert cls_ratio(10, 400, 0.01) == pytest.approx(math.exp(-3.9))


def test_each_round_builds_its_stages_with_that_rounds_rho(run_sim):
    """Through the algorithm: R = 40, round 10: rho = min(0.5, e^{0.05 (10 - 40)}) = e^{-1.5} with
    --cls_ratio_gamma 0.05; left unset it is --syn_gamma's: --syn_gamma 0.04 -> e^{0.04 (10 - 40)} = e^{-1.2}; --schedule_rounds 100 (R) -> e^{-3.6}."""
    cfg = FRAugConfig(d_z=16, plot_embeddings=False, cls_loss="weighted", cls_ratio_gamma=0.05)
    sim, _ = run_sim("fraug", run=False, num_rounds=40, method_config=cfg)
    assert sim.algorithm.stages_for(0, 10).rho == pytest.approx(math.exp(-1.5))
    sim.algorithm.config.cls_ratio_gamma, sim.algorithm.config.syn_gamma = None, 0.04
    assert sim.algorithm.stages_for(0, 10).rho == pytest.approx(math.exp(-1.2))
    sim.algorithm.config.schedule_rounds = 100        # R is the schedules' R: e^{0.04 (10 - 100)} = e^{-3.6}
    assert sim.algorithm.stages_for(0, 10).rho == pytest.approx(math.exp(-3.6))


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="--cls_loss"):
        FRAugConfig(cls_loss="mean")
    with pytest.raises(ValueError, match="--cls_ratio_gamma"):
        FRAugConfig(cls_ratio_gamma=-0.1)
