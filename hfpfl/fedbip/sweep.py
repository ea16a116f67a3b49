"""How noisy should the clients' instance latents be? A sweep of ``--noise_timestep`` read without client test data.

The paper noises the instance latents to the maximum timestep T. On SD v1's 64 x 64 latents enough of a client's style
survives T to lift instance-only over prompt-only (paper Table 3); on the tiny LDM's 8 x 8 latents much less does
(CHANGELOG.md). This sweep measures, for each noising timestep of the sampler's schedule (clients noise there and
the sampler starts there), what a row's synthetic set (FedBiP-L's by default: what the method hands the server;
instance-only: the level alone) carries of the client and how close it comes to the client's images:

* **style**: the share of each client's synthetic images that the style judge (a domain classifier
  trained on the domains' public splits, :func:`hfpfl.fedbip.quality.train_style_judge`) assigns to the client's
  domain, mean over clients;
* **closeness**: the mean RMS pixel distance of each synthetic image to the nearest train image of its client,
  against the **floor** the client's own train images set: each one's distance to the nearest *other* train image
  (leave-one-out; on the main setting it equals the clients' real test images' distance to the train set, 0.32, but
  needs no test split).

:func:`choose_noise_timestep` picks the timestep with the most style whose synthetic images stay, on average, at
least as far from the client's train images as the train images are from each other. Accuracies are recorded
beside, never read by the choice.
"""

from __future__ import annotations

import torch

from .privacy import nearest_neighbor_distances


def leave_one_out_distances(images: torch.Tensor) -> torch.Tensor:
    """For each image the RMS pixel distance to the nearest *other* image of the same set (the set's own spacing:
    how far an unseen image of the same client typically lies from the rest)."""
    n = len(images)
    if n < 2:
        raise ValueError(f"leave-one-out distances need at least 2 images, got {n}")
    out = [nearest_neighbor_distances(images[i : i + 1], torch.cat([images[:i], images[i + 1 :]]))[0]
           for i in range(n)]
    return torch.stack(out)


def train_spacing(fed) -> float:
    """Mean over every client's train images of :func:`leave_one_out_distances` (the closeness floor)."""
    ds = []
    for c in fed.clients:
        x = torch.stack(list(c.train.with_format("torch")["pixel_values"])).float()
        ds.append(leave_one_out_distances(x))
    return float(torch.cat(ds).mean())


# the options the sweep sets itself for every run: passing them through would silently change what is swept
SWEEP_OWNED_OPTIONS = ("--noise_timestep", "--seeds", "--variants", "--compare")


def check_sweepable(fed, extra: list[str]) -> None:
    """ValueError (naming the fix) when the sweep cannot read what it chooses by: clients whose domains the style
    judge does not know (it knows :data:`~hfpfl.fedbip.quality.STYLE_DOMAINS`), or an option the sweep sets itself."""
    from .quality import STYLE_DOMAINS

    owned = [o for o in extra if o.split("=")[0] in SWEEP_OWNED_OPTIONS]
    if owned:
        raise ValueError(f"{owned[0].split('=')[0]} is set by the sweep for every run; drop it (--timesteps and "
                         f"--variant choose what is swept, --seed the seed)")
    domains = sorted({str(c.domain) for c in fed.clients})
    if not any(d in STYLE_DOMAINS for d in domains):
        raise ValueError(f"the sweep chooses by the style judge, which knows the domains {', '.join(STYLE_DOMAINS)}; "
                         f"these clients hold {', '.join(domains)}: pass --dataset digits-nomnist (or digits), or "
                         f"choose --noise_timestep by hand")


def choose_noise_timestep(rows: list[dict], floor: float) -> dict | None:
    """The row (one per timestep: ``timestep``, ``style``, ``nn_dist``) with the most style among those whose
    ``nn_dist`` >= ``floor``; ties go to the higher timestep (more noise, nearer the paper's T). None when no row keeps the
    floor."""
    kept = [r for r in rows if r["nn_dist"] >= floor]
    if not kept:
        return None
    return max(kept, key=lambda r: (r["style"], r["timestep"]))


def plot_sweep(rows: list[dict], floor: float, path, chosen: int | None = None, variant: str = "FedBiP-L") -> str:
    """Style share and closeness against the noising timestep (one figure, two axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(rows, key=lambda r: r["timestep"])
    t = [r["timestep"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(t, [r["style"] for r in rows], "o-", color="tab:blue", label="style share (domain judge)")
    if all(r.get("class_fidelity") is not None for r in rows):  # an LDM without a quality judge has none
        ax.plot(t, [r["class_fidelity"] for r in rows], "s--", color="tab:green",
                label="class fidelity (class judge)")
    ax.set_xlabel("noising timestep (sampler starts there; the paper: T = the top)")
    ax.set_ylabel("share of synthetic images")
    ax.set_ylim(0, 1)
    ax2 = ax.twinx()
    ax2.plot(t, [r["nn_dist"] for r in rows], "^-", color="tab:red", label="distance to nearest train image")
    ax2.axhline(floor, color="tab:red", ls=":", label="train images' own spacing (floor)")
    ax2.set_ylabel("RMS pixel distance", color="tab:red")
    if chosen is not None:
        ax.axvline(chosen, color="grey", ls="-.", lw=1)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="lower left")
    ax.set_title(f"{variant}'s synthetic images vs how far clients noise their latents", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
