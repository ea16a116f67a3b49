"""What happens around a simulation's rounds, as callbacks (after pfl-research's ``TrainingProcessCallback``): the
run's files and log lines, checkpoints, accelerate's trackers, a progress bar -- and whatever a driver adds (a tuner
scoring each client's upload, a study's extra metric).

A :class:`Callback` overrides any of four moments; :class:`~hfpfl.federated.engine.Simulation` calls them in list
order. ``Simulation(..., callbacks=[...])`` runs :func:`default_callbacks` first, then the given ones; ``sim.callbacks``
is the list itself.
"""
from __future__ import annotations

import dataclasses

from .. import tracking


class Callback:
    """Override what you need; every moment does nothing by default.

    ``needs_each_client``: declare True when :meth:`after_client_update` must see every client's own upload as it
    is produced; the simulation then trains clients one by one (no vectorized chunks, whose uploads arrive stacked)."""

    needs_each_client: bool = False

    def on_train_begin(self, sim) -> None:
        """Once, when the simulation starts (after a resume loaded its checkpoint), before its first round."""

    def after_client_update(self, sim, client_id: int, update) -> None:
        """Right after client ``client_id``'s local update, before aggregation: ``update`` as the server receives it
        (upload on the CPU, private state already stored). Runs on the process that trained the client; only the
        callbacks that declare ``needs_each_client`` are called."""

    def after_round(self, sim, round_idx: int, metrics: dict) -> None:
        """After round ``round_idx`` and its evaluation (when it had one): ``metrics`` is the round's history row."""

    def on_train_end(self, sim, results: dict) -> None:
        """Once, when :meth:`~hfpfl.federated.engine.Simulation.finish` has the run's results (``results.json``'s
        content)."""


class RunLog(Callback):
    """The run's own files and lines: ``config.yaml`` (a resumed run keeps its own, unless ``--num_rounds`` grew),
    the run header, one line per round, ``results.json`` and the plots."""

    def on_train_begin(self, sim) -> None:
        args = sim.args
        if sim.default_model_built:
            from ..config import warn_random_backbone
            warn_random_backbone(args)
        if sim.accelerator.is_main_process and (
                not args.resume_from_checkpoint or not (sim.output_dir / "config.yaml").exists()
                or args.num_rounds != _saved_rounds(sim.output_dir)):
            recipe = {"recipe": sim.recipe_settings} if sim.recipe_settings else {}  # a recipe's own options
            tracking.write_config(sim.output_dir, run=args, data=sim.data_args, method=sim.algorithm.config,
                                  **recipe)
        tracking.log_run_header(sim)

    def after_round(self, sim, round_idx: int, metrics: dict) -> None:
        tracking.log_round(sim, metrics, sim.round_seconds)

    def on_train_end(self, sim, results: dict) -> None:
        if sim.accelerator.is_main_process:
            tracking.write_results(sim.output_dir, results)
            tracking.plot_run(sim, sim.final_eval)


class Trackers(Callback):
    """accelerate's experiment trackers (``--report_to``): the run's scalar options, each round's scalar metrics."""

    def on_train_begin(self, sim) -> None:
        acc = sim.accelerator
        if acc.log_with:
            acc.init_trackers("hfpfl", config={k: v for k, v in dataclasses.asdict(sim.args).items()
                                                if isinstance(v, (int, float, str, bool))})

    def after_round(self, sim, round_idx: int, metrics: dict) -> None:
        acc = sim.accelerator
        if acc.log_with:
            acc.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=round_idx)

    def on_train_end(self, sim, results: dict) -> None:
        if sim.accelerator.log_with:
            sim.accelerator.end_training()


class Checkpoints(Callback):
    """A checkpoint every ``--checkpoint_every`` rounds and after the last one (0: none)."""

    def after_round(self, sim, round_idx: int, metrics: dict) -> None:
        every = sim.args.checkpoint_every
        if every and (round_idx % every == 0 or round_idx == sim.args.num_rounds):
            sim.save_checkpoint(round_idx, sim.server_state, sim.elapsed())


class MetricsFile(Callback):
    """``metrics.jsonl``, one line per round, appended as rounds finish. A history the file does not hold yet (a
    fresh run, or one a resume loaded: another list) is written whole, so a resumed run drops any line a crash left
    after its checkpoint."""

    def __init__(self):
        self._history, self._written = None, 0

    def after_round(self, sim, round_idx: int, metrics: dict) -> None:
        if not sim.accelerator.is_main_process:
            return
        if self._history is not sim.history:
            self._history, self._written = sim.history, 0
        self._written = tracking.write_history(sim.output_dir, sim.history, self._written)


class ProgressBar(Callback):
    """A tqdm bar over the rounds, on a terminal only (``--progress``), on the local main process."""

    def __init__(self):
        self.bar = None

    def on_train_begin(self, sim) -> None:
        args = sim.args
        if tracking.show_progress_bars(args.progress) and sim.accelerator.is_local_main_process:
            from tqdm.auto import tqdm
            self.bar = tqdm(desc=f"{args.method} rounds", initial=sim.round, total=args.num_rounds)

    def after_round(self, sim, round_idx: int, metrics: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items()
                                  if k.endswith("accuracy") and isinstance(v, float)})
            if round_idx >= sim.args.num_rounds:
                self.on_train_end(sim, {})

    def on_train_end(self, sim, results: dict) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def default_callbacks() -> list[Callback]:
    """What every simulation does around its rounds unless a caller removes it from ``sim.callbacks``. The order is
    the order of the files: the round's line and trackers, then its checkpoint, then its ``metrics.jsonl`` line."""
    return [RunLog(), Trackers(), ProgressBar(), Checkpoints(), MetricsFile()]


def _saved_rounds(output_dir):
    import yaml
    try:
        cfg = yaml.safe_load((output_dir / "config.yaml").read_text()) or {}
    except Exception:  # noqa: BLE001 - an unreadable config is rewritten
        return None
    return (cfg.get("run") or {}).get("num_rounds", cfg.get("num_rounds"))
