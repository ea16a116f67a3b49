"""FRAug with its synthetic losses weighted to zero is FedBN, bit for bit.

FRAug = FedBN (local BatchNorm, the rest averaged) + a synthetic loss on the head + a generator and an RTNet trained on
the side (dissertation ch. 2, Sec. 3.3 and Algorithm 1). Under ``--cls_loss weighted`` the classifier's loss is
(1 - rho) L_real + rho L_syn'; with rho = min(0.5, exp(gamma' (r - R))) = exp(-huge) = 0.0 exactly it is L_real
alone, and the synthetic term's gradient is 0 * g = 0. Everything else keeps running: the generator and the RTNet
still take their optimizer steps every local step, the EMA prototypes still update, the stage-2 real embeddings are
still computed in eval mode. So after each round every classifier weight and every BatchNorm statistic must equal a
FedBN run's (same seed, same batches, momentum kept across rounds by both). Any leak from FRAug's extra machinery into
the classifier fails this: a stage-2 gradient reaching theta, the stage-2 forward updating BN running statistics in
train mode, the noise draws shifting the batch order, a different parameter set or order in the classifier's
optimizer, BatchNorms travelling, momentum not carried the same way."""
import torch

from hfpfl.algorithms.base import MODEL
from hfpfl.algorithms.fedbn import FedBNConfig
from hfpfl.algorithms.fraug import FRAugConfig

KW = dict(num_rounds=2, local_steps=3, lr=0.05, momentum=0.5)
#: rho = min(0.5, exp(1000 (r - 10^6))) underflows to 0.0 for r <= 2; lambda_syn = exp(0 (r - R)) = 1, so the RTNet's
#: residual enters its loss at full weight and the RTNet trains
ZERO_RHO = dict(cls_loss="weighted", cls_ratio_gamma=1000.0, schedule_rounds=10 ** 6, syn_gamma=0.0)


def _net_state(sim, cid, prefix=""):
    """Client ``cid``'s classifier after the run: the server's averaged weights with its private BatchNorms on top
    (keys without FRAug's ``net.`` prefix)."""
    private = sim.store.get(cid)[MODEL]
    state = {**{k: v for k, v in sim.server_state[MODEL].items()}, **private}
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def test_fraug_with_zero_synthetic_weight_is_fedbn_exactly(run_sim):
    """Two rounds of 3 local steps, momentum 0.5 kept across rounds, sample-weighted server mean (the small
    federation's client sizes differ, and FedBN's mean is FedAvg's): every client's classifier -- the averaged weights
    and its own BatchNorms, statistics included -- equals FedBN's exactly; the generator and the RTNet did train."""
    cfg = FRAugConfig(d_z=16, plot_embeddings=False, keep_optimizer_state=True, uniform_aggregation=False, **ZERO_RHO)
    fraug, _ = run_sim("fraug", method_config=cfg, output_dir="fraug", run=False, **KW)
    fraug.setup()
    g0 = {k: v.clone() for k, v in fraug.model.state_dict().items() if k.startswith(("generator.", "rtnet."))}
    fraug.run()
    st = fraug.algorithm.stages_for(0, 2)
    assert st.rho == 0.0 and st.lam_syn == 1.0
    logs = [u.metrics for u in fraug.last_updates]
    assert all(m["loss_syn"] > 0 for m in logs)  # the synthetic loss was computed, with weight 0
    gen = fraug.server_state[MODEL]
    assert any(not torch.equal(gen[k], g0[k]) for k in g0 if k.startswith("generator."))
    rt = fraug.store.get(0)[MODEL]
    assert any(not torch.equal(rt[k], g0[k]) for k in g0 if k.startswith("rtnet."))
    fedbn, _ = run_sim("fedbn", method_config=FedBNConfig(keep_optimizer_state=True), output_dir="fedbn", **KW)
    for cid in range(4):
        a, b = _net_state(fraug, cid, "net."), _net_state(fedbn, cid)
        assert set(a) == set(b)
        diff = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
        assert not diff, f"client {cid}: FRAug's classifier left FedBN's: {sorted(diff)[:4]}"
