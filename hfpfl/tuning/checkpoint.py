"""The population checkpoint (``--resume``): ``population.pt`` holds the tuner's counters, its generator, the events,
the vectors tried and every member (its fields and its simulation's state), with a fingerprint of the settings; a
run continues from it only under the same settings."""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

logger = logging.getLogger("hfpfl")


class PopulationCheckpoint:
    """Save / load of a :class:`~hfpfl.tuning.base.Tuner`'s population (a part of the tuner, not used alone)."""

    def _state(self) -> dict:
        return {"round": self.round, "rng": self.rng.bit_generator.state, "events": self.events,
                "tried": sorted(self.tried), "loc_calls": self.loc_calls, "rounds_used": self.rounds_used,
                "members": [{**m.meta(), "sim": m.sim.state_dict()} for m in self.members],
                "fingerprint": self.fingerprint()}

    def fingerprint(self) -> dict:
        t = {k: v for k, v in dataclasses.asdict(self.t).items() if k != "resume"}
        run = {k: v for k, v in dataclasses.asdict(self.run_args).items()
               if k not in ("output_dir", "overwrite_output_dir", "progress", "num_threads", "report_to")}
        return {"tuner": t, "run": run, "space": self.space.to_dict()}

    def save(self) -> None:
        """Population state, written atomically (tmp file + os.replace) after every generation / stage."""
        if not self.accelerator.is_main_process:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "population.pt.tmp"
        torch.save(self._state(), tmp)
        os.replace(tmp, self.out / "population.pt")

    def load(self) -> bool:
        path = self.out / "population.pt"
        if not path.exists():
            return False
        state = torch.load(path, weights_only=False)
        if state["fingerprint"] != self.fingerprint():
            raise ValueError(f"{path}: the saved population was run with other settings; use another --output_dir")
        self.round, self.events = int(state["round"]), list(state["events"])
        self.rng.bit_generator.state = state["rng"]
        self.tried = {_tuplify(x) for x in state["tried"]}
        self.loc_calls, self.rounds_used = int(state["loc_calls"]), int(state["rounds_used"])
        for m, saved in zip(self.members, state["members"]):
            for k, v in saved.items():
                if k != "sim":
                    setattr(m, k, v)
            m.sim.load_state_dict(saved["sim"])
            m.scores = {}
            self._apply_method_hparams(m)
        logger.info("resumed the population at %s %d", self.resume_unit, self.round)
        return True


def _tuplify(x):
    if isinstance(x, (list, tuple)):
        return tuple(_tuplify(v) for v in x)
    return x
