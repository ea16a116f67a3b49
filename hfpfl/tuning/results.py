"""The end of a tuning run (dissertation ch. 4): the final pick is the member with the lowest validation loss of its
final model(s) over all clients' val splits (A7.9: never the test split); its Loc(beta^0) fine-tuned test accuracy
(A2.10) is reported, not used. Writes config.yaml, search_space.yaml, results.json and the population's figures."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ..federated.context import HParams, NonFiniteError
from ..federated.state import MODEL
from . import search_space as ss


class PopulationResults:
    """The final evaluation and results of a :class:`~hfpfl.tuning.base.Tuner` (a part of the tuner, not used
    alone)."""

    def member_val_loss(self, m) -> float:
        """Sample-weighted validation loss of the member's final model(s) over every client's val split (each
        client's personal model where the method has one, the global model otherwise)."""
        sim, tot, n = m.sim, 0.0, 0
        for cid, model in sim.evaluator.personal_models(range(len(self.fed_data.clients)), sim.server_state,
                                                          sim.round):
            res = sim.ctx.evaluate(model, sim.ctx.val_data(cid))
            tot += res["loss"] * res["num_samples"]
            n += res["num_samples"]
        return tot / max(1, n)

    def finetuned_accuracy(self, m) -> float:
        """A2.10: the final model fine-tuned on each client with Loc(beta^0), evaluated on its test split."""
        sim = m.sim
        hp = HParams.from_args(sim.args).replace(**ss.to_values(m.beta0, self.space.client))
        accs = []
        for cid in range(len(self.fed_data.clients)):
            private = sim.store.get(cid)
            sim.ctx.load((private or {}).get(MODEL) or sim.initial_private)
            sim.algorithm.load_personal(cid, sim.server_state, private, sim.round)
            if self.t.final_finetune_epochs > 0:
                sim.ctx.train(cid, sim.round + 1, hp=hp, epochs=self.t.final_finetune_epochs, tag="fedpop-finetune")
            accs.append(sim.ctx.evaluate(sim.model, sim.ctx.test_data(cid))["accuracy"])
        return float(np.mean(accs))

    def finish(self, wall: float) -> dict:
        rows = []
        for m in self.members:
            if not m.alive or m.diverged:
                rows.append({"member": m.idx, "alive": False, "diverged": m.diverged, "rounds": m.rounds,
                             "curve": m.curve,
                             "alpha": ss.to_values(m.alpha, self.space.server),
                             "beta0": ss.to_values(m.beta0, self.space.client),
                             "method": ss.to_values(m.mhp, self.space.method)})
                continue
            val = self.member_val_loss(m)
            res = m.sim.finish()
            rows.append({"member": m.idx, "alive": True, "rounds": m.rounds, "val_loss": val,
                         "global_accuracy": res["final"].get("global_accuracy"),
                         "personal_accuracy": res["final"].get("personal_accuracy"),
                         "alpha": ss.to_values(m.alpha, self.space.server),
                         "beta0": ss.to_values(m.beta0, self.space.client),
                         "method": ss.to_values(m.mhp, self.space.method), "curve": m.curve})
        alive = [r for r in rows if r["alive"]]
        if not alive:
            raise NonFiniteError("every member of the population diverged; narrow the search space (lower lr)")
        best = min(alive, key=lambda r: (r["val_loss"], r["member"]))
        best_m = next(m for m in self.members if m.idx == best["member"])
        best = {**best, "finetuned_accuracy": self.finetuned_accuracy(best_m), **self.best_extras(best_m)}
        alphas = {a for a, _ in self.tried}
        results = {
            "tuner": self.t.tuner, "method": self.run_args.method, "seed": self.run_args.seed,
            "budget": {"R_t": self.budget, "rounds_used": self.rounds_used, "loc_calls": self.loc_calls,
                       "R_c": self.R_c, "T_g": self.T_g, "K": self.K,
                       "members": len(self.members), "retraining_rounds": 0},
            "tried": {"alpha": len(alphas), "beta": len({b for _, b in self.tried}), "pairs": len(self.tried)},
            "best_member": best, "members": rows, "events": self.events, "wall_time_s": wall,
        }
        if self.accelerator.is_main_process:
            from ..tracking import atomic_write_text, write_config
            write_config(self.out, tuner=self.t, run=self.run_args, data=self.data_args, method=self.method_config)
            (self.out / "search_space.yaml").write_text(__import__("yaml").safe_dump(self.space.to_dict()))
            atomic_write_text(self.out / "results.json", json.dumps(results, indent=2, default=str))
            plot_population(self.out, self.members, self.events, title=f"{self.t.tuner} on {self.run_args.method}")
        if self.tracker is not None and self._trackers_started:
            self.tracker.end_training()
        return results


def plot_population(out: Path, members: list, events: list[dict], title: str = "") -> None:
    """curves.png: per-member mean local validation loss per round (x marks exploits); hparams.png: alpha and beta^0
    of every member over rounds."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - plots are optional
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in members:
        if m.curve:
            xs, ys = zip(*m.curve)
            ax.plot(xs, ys, label=f"m{m.idx}", lw=1)
    for e in events:
        if e.get("kind") == "exploit":
            ax.axvline(e["round"], color="gray", lw=0.3)
    ax.set_xlabel("round")
    ax.set_ylabel("mean val loss of local models")
    ax.set_yscale("log")
    ax.set_title(title)
    if len(members) <= 12:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)
    names = []
    for m in members:
        for t in m.trajectory[:1]:
            names = [("alpha", k) for k in t["alpha"]] + [("beta0", k) for k in t["beta0"]] + \
                [("method", k) for k in t.get("method", {})]
        if names:
            break
    if not names:
        return
    cols = 3
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.6 * rows), squeeze=False)
    for ax, (part, k) in zip(axes.flat, names):
        for m in members:
            if m.trajectory:
                ax.plot([t["round"] for t in m.trajectory], [t[part][k] for t in m.trajectory], lw=1)
        ax.set_title(f"{part}.{k}", fontsize=8)
        if k in ("lr", "server_lr", "weight_decay"):
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "hparams.png", dpi=110)
    plt.close(fig)
