"""FedPCE's *Class imbalance* group (FedPCE paper section 4.2, "Simulating non-IID data"):

    "If there are 2M Class imbalance clients, we choose M values of alpha (logarithmically spaced between 0.1 and 10)
    and divide the entire set of images for these clients into M subsets uniformly. Each alpha is paired with one
    subset, and the images of that subset are distributed using the Dirichlet distribution with the corresponding
    alpha."

Read as NIID-Bench's Dirichlet label split over the pair of clients: for each class of a subset, proportions
p ~ Dir(alpha, alpha) and the class's shuffled images cut at floor(cumsum(p) * n_class). Client pair s = (2s, 2s + 1)
gets alpha_s; the group's clients must be even in number (the paper: "ensuring an even number of Class imbalance
clients"). A pair whose smaller client gets fewer than ``min_size`` images is drawn again (NIID-Bench redraws until
every client has at least 10).
"""
from __future__ import annotations

import numpy as np


def imbalance_alphas(num_clients: int) -> list[float]:
    """Each client's alpha: M = num_clients / 2 values logspace(0.1, 10), client j gets value j // 2."""
    if num_clients < 2 or num_clients % 2:
        raise ValueError(f"the class-imbalance group pairs its clients (FedPCE section 4.2): it needs an even number "
                         f"of clients, got {num_clients}; make each group's clients even (recipes: (--num_clients + "
                         f"--num_new_clients) / the number of --groups)")
    m = num_clients // 2
    alphas = np.logspace(-1.0, 1.0, m) if m > 1 else np.array([0.1])
    return [float(alphas[j // 2]) for j in range(num_clients)]


def cut_by_proportions(n: int, proportions) -> list[int]:
    """How many of ``n`` items each part gets when the items are cut at floor(cumsum(p) * n) (NIID-Bench)."""
    bounds = [0] + [int(np.floor(c * n)) for c in np.cumsum(proportions)[:-1]] + [n]
    return [bounds[i + 1] - bounds[i] for i in range(len(proportions))]


def class_imbalance_split(labels, num_clients: int, seed: int = 0, min_size: int = 4) -> list[np.ndarray]:
    """Indices into ``labels`` for each of ``num_clients`` clients (see the module docstring): a uniform split into
    num_clients / 2 subsets, each subset's classes cut between its two clients by Dir(alpha_s, alpha_s)."""
    labels = np.asarray(labels)
    alphas = imbalance_alphas(num_clients)
    rng = np.random.default_rng([int(seed), 41])
    subsets = np.array_split(rng.permutation(len(labels)), num_clients // 2)
    out: list[np.ndarray] = []
    for s, idx in enumerate(subsets):
        alpha = alphas[2 * s]
        for _ in range(1000):
            parts = [[], []]
            for k in np.unique(labels[idx]):
                members = rng.permutation(idx[labels[idx] == k])
                counts = cut_by_proportions(len(members), rng.dirichlet([alpha, alpha]))
                parts[0].append(members[:counts[0]])
                parts[1].append(members[counts[0]:])
            parts = [np.sort(np.concatenate(p)) for p in parts]
            if min(len(p) for p in parts) >= min_size:
                break
        else:
            raise ValueError(f"class imbalance: a client pair of {len(idx)} images cannot give each client "
                             f"{min_size}; raise max_per_domain")
        out.extend(parts)
    return out
