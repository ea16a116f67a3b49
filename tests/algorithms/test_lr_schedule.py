"""--lr_milestones / --lr_gamma: the clients' step lr schedule of the parallel-adapters paper (Elvebakken et al.,
section IV-A: "a learning rate of 0.1 and decrease this to 0.01 at round 30"), against hand values on the 4-number toy
federation of test_baseline_pins (full-batch SGD, one step per round, 2 : 3 sample-weighted FedAvg)."""
import pytest

from hfpfl.config import RunArguments
from hfpfl.federated.lr_schedule import milestones, scheduled_lr

from test_baseline_pins import FEDAVG1, P, close, grads, make_sim, state


def test_scheduled_lr_by_hand():
    """lr 0.1, milestones 3 and 5, gamma 0.5: rounds 1-2 at 0.1, 3-4 at 0.05, 5 on at 0.025; unset: always 0.1."""
    run = RunArguments(lr_milestones="3,5", lr_gamma=0.5)
    assert [scheduled_lr(0.1, r, run) for r in range(1, 7)] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    assert [scheduled_lr(0.1, r, RunArguments()) for r in (1, 30, 100)] == [0.1, 0.1, 0.1]
    assert milestones(None) == () and milestones("30") == (30,) and milestones("30, 40") == (30, 40)


@pytest.mark.parametrize("vectorize", ["off", "on"])
def test_fedavg_second_round_trains_at_the_decayed_lr(tmp_path, vectorize):
    """--lr 0.1 --lr_milestones 2 --lr_gamma 0.5: round 1 is FEDAVG1 (lr 0.1, hand values of test_baseline_pins);
    in round 2 each client steps from FEDAVG1 at lr 0.05 -- p - 0.05 * grad(p) with the toy's gradient formulas -- and
    the server takes the 2 : 3 mean. The client hyperparameters say 0.05 from round 2 on."""
    sim = make_sim(tmp_path, "fedavg", vectorize=vectorize, lr_milestones="2", lr_gamma=0.5)
    assert sim.client_hparams(0).lr == pytest.approx(0.1)
    sim.step()
    close(sim.server_state["model"], state(P(FEDAVG1)))
    assert sim.client_hparams(0).lr == pytest.approx(0.05)
    sim.step()
    p = P(FEDAVG1)
    ups = [{k: p[k] - 0.05 * grads(p, c)[k] for k in p} for c in (0, 1)]
    mean = {k: (2 * ups[0][k] + 3 * ups[1][k]) / 5 for k in p}
    close(sim.server_state["model"], state(mean))
    # the same round at the undecayed lr lands elsewhere (the hand check above tells the two apart)
    other = {k: (2 * (p[k] - 0.1 * grads(p, 0)[k]) + 3 * (p[k] - 0.1 * grads(p, 1)[k])) / 5 for k in p}
    assert float(max((mean[k] - other[k]).abs().max() for k in p)) > 1e-2


def test_options_are_checked():
    """Milestones are whole rounds >= 1; gamma in (0, 1]; one line naming the option."""
    with pytest.raises(ValueError, match=r"^--lr_milestones must be one or more comma-separated whole numbers"):
        RunArguments(lr_milestones="0")
    with pytest.raises(ValueError, match=r"^--lr_gamma must be in \(0, 1\], got 1.5$"):
        RunArguments(lr_gamma=1.5)
