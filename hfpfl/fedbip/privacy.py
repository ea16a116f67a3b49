"""Privacy measures for FedBiP and any other method of the engine (paper §5.5-5.6, Table 4).

* Membership-inference gap (Yeom et al. 2018; Salem et al. 2018), as the paper's Table 4: the difference between the final
  model's average cross-entropy loss (and average prediction entropy) on *members* (the clients' real train images)
  and on *non-members* (the clients' real test images). Smaller is better. Each client is evaluated with the model
  the method gives it, built as the run's evaluation builds it (``ctx.personal_models``), so the same function
  measures FedBiP, FedAvg and Local-only.
  FedBiP's classifier never saw a member image; FedAvg's trained on them.
* Nearest-neighbour distance from every synthetic image to the closest real *train* image of the client whose upload
  produced it (RMS pixel distance in [-1, 1], at the classifier resolution): mean and min. As a scale reference, the
  same distance from each of the client's real *test* images to its train images (a fresh real sample).
  A synthetic image at distance ~0 would be a copy of a client image.
"""
from __future__ import annotations

import numpy as np
import torch

from ..training import TensorData, iterate_batches


@torch.no_grad()
def loss_and_entropy(model, data: TensorData, batch_size: int = 256, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample cross-entropy loss and prediction entropy (nats)."""
    was = model.training
    model.eval()
    losses, ents = [], []
    for b in iterate_batches(data, batch_size, shuffle=False, last="keep"):
        logits = model(pixel_values=b["pixel_values"].to(device)).logits.float()
        logp = torch.log_softmax(logits, -1)
        losses.append(torch.nn.functional.nll_loss(logp, b["labels"].to(device), reduction="none").cpu())
        ents.append(-(logp.exp() * logp).sum(-1).cpu())
    model.train(was)
    return torch.cat(losses), torch.cat(ents)


def mia_gap_from_stats(member_loss, member_ent, nonmember_loss, nonmember_ent) -> dict:
    ml, me, nl, ne = (float(t.mean()) for t in (member_loss, member_ent, nonmember_loss, nonmember_ent))
    return {"mia_loss_gap": abs(ml - nl), "mia_entropy_gap": abs(me - ne), "member_loss": ml, "nonmember_loss": nl,
            "member_entropy": me, "nonmember_entropy": ne}


def membership_inference_gap(algo, server_state, round_idx: int) -> dict:
    """|mean member - mean non-member| of loss and entropy over all clients (sample-pooled), each client with the
    model the method ``algo`` gives it. Members: clients' train splits; non-members: their test splits.

    Collective: every process of a run calls it. Each scores the clients it holds (a client's private state, e.g.
    Local-only's model, lives only on its owner: scored elsewhere, it would be the untrained initial state) and the
    per-sample values are gathered in client order, so N processes give one process's numbers."""

    sim = algo.ctx
    mine = []
    scored = [cid for cid in sim.owned(range(sim.num_clients)) if len(sim.client(cid).test)]
    for cid, model in sim.personal_models(scored, server_state, round_idx):
        ml, me = loss_and_entropy(model, sim.train_data(cid), sim.run.eval_batch_size, sim.device)
        nl, ne = loss_and_entropy(model, sim.test_data(cid), sim.run.eval_batch_size, sim.device)
        mine.append((cid, (ml, me, nl, ne)))
    rows = sorted(sim.gather(mine), key=lambda r: r[0])
    if not rows:
        return {}
    return mia_gap_from_stats(*(torch.cat([r[1][i] for r in rows]) for i in range(4)))


def nearest_neighbor_distances(queries: torch.Tensor, references: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """For each query image the RMS pixel distance to its nearest reference image (same shape per image)."""
    q = queries.reshape(len(queries), -1).double()
    r = references.reshape(len(references), -1).double()
    out = []
    r2 = (r * r).sum(1)
    for i in range(0, len(q), chunk):
        qi = q[i : i + chunk]
        d2 = (qi * qi).sum(1, keepdim=True) + r2[None] - 2 * qi @ r.T
        out.append(d2.clamp_min(0).min(1).values)
    return (torch.cat(out) / q.shape[1]).sqrt().float()


def synthetic_nearest_neighbors(sim, synthetic: dict) -> dict:
    """Distance of every synthetic image to the nearest train image of its source client (mean / min), and the
    real-test-to-train reference distance of the same clients."""
    syn_d, ref_d = [], []
    for cid in sorted(set(synthetic["clients"].tolist())):
        train = sim.train_data(cid).pixel_values
        syn = synthetic["images"][synthetic["clients"] == cid]
        if syn.shape[1:] != train.shape[1:]:
            raise ValueError(f"synthetic images {tuple(syn.shape[1:])} and client {cid}'s images "
                             f"{tuple(train.shape[1:])} differ in shape")
        syn_d.append(nearest_neighbor_distances(syn, train))
        if len(sim.client(cid).test):
            ref_d.append(nearest_neighbor_distances(sim.test_data(cid).pixel_values, train))
    syn_all = torch.cat(syn_d)
    out = {"syn_nn_dist_mean": float(syn_all.mean()), "syn_nn_dist_min": float(syn_all.min())}
    if ref_d:
        out["real_test_nn_dist_mean"] = float(np.mean(torch.cat(ref_d).numpy()))
    return out
