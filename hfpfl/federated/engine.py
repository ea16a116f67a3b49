"""The simulation engine: one model instance per process, client states swapped in and out, methods as plug-ins.

``Simulation(run_args, data_args).run()`` runs a whole experiment; ``step()`` runs one round (a driver such as FedPop
interleaves several simulations and may give each round its own per-client and server hyperparameters);
``state_dict()`` / ``load_state_dict()`` hold everything needed to continue bit for bit.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn

from ..runtime import configure_determinism
from ..training import TensorData
from . import checkpoint as ckpt
from . import results, seeding
from .callbacks import Callback, default_callbacks
from .comm import CommLedger
from .context import HParams, MethodContext, ServerHParams
from .distributed import Ownership, barrier
from .evaluation import Evaluator
from .protocol import Algorithm, Update
from .registry import get_algorithm
from .roles import FrozenCheck, assign_roles
from .rounds import RoundRunner
from .splits import SplitCache
from .state import FROZEN, PRIVATE, ClientStateStore, snapshot

logger = logging.getLogger("hfpfl")

# run settings that do not change what a run computes (they may differ on resume)
_NOT_FINGERPRINTED = {"output_dir", "overwrite_output_dir", "resume_from_checkpoint", "num_rounds", "progress",
                      "report_to", "num_threads", "num_processes", "checkpoint_every", "keep_checkpoints",
                      "eval_clients", "vectorize", "vector_chunk_mb", "channels_last", "data_cache_mb", "max_state_mb"}


class Simulation:
    """Runs one federated experiment. ``Simulation(run_args, data_args).run()`` -> results dict.

    It builds the data, the method (``self.algorithm``) and its one model, assigns each state key a role
    (:mod:`.roles`), and orchestrates: ``setup()`` (fresh or resumed), ``step()`` per round (clients sampled, their
    updates run by :class:`~.rounds.RoundRunner`, sequentially or vectorized as the method declares, evaluation by
    :class:`~.evaluation.Evaluator`, the callbacks), ``finish()``. The method reads the run only through its
    :class:`~.context.MethodContext` (``self.ctx``); client data through :class:`~.splits.SplitCache`, client
    states through :class:`~.state.ClientStateStore`, seeds through :mod:`.seeding`.

    ``fed_data`` may be passed in (already built) to share it between simulations (FedPop, benchmarks).
    ``keep_uploads=True`` keeps the last round's uploads in ``last_updates`` (tests, debugging); by default uploads
    are folded into running sums as they arrive and dropped (O(model) memory for any number of clients).
    ``recipe_settings`` are a recipe's own options that shape ``fed_data`` (e.g. FedPCE's ``--levels``): they join
    the resume fingerprint, so a checkpoint is never continued on differently built data.
    ``callbacks`` run after :func:`~hfpfl.federated.callbacks.default_callbacks` (the run's files and log lines,
    checkpoints, trackers, progress bar) at each moment of the run; ``sim.callbacks`` is the whole list.
    """

    def __init__(self, run_args, data_args=None, method_config=None, *, fed_data=None,
                 accelerator: Accelerator | None = None, keep_uploads: bool = False, recipe_settings: dict | None = None,
                 callbacks: list[Callback] | None = None):
        if not run_args.output_dir:  # default: outputs/<method>-<timestamp>, the same on every process
            from ..runtime import resolve_output_dir
            run_args = dataclasses.replace(run_args, output_dir=resolve_output_dir(None, run_args.method))
        self.args = run_args
        self.data_args = data_args
        self.keep_uploads = keep_uploads
        self.recipe_settings = dict(recipe_settings or {})
        self.callbacks: list[Callback] = [*default_callbacks(), *(callbacks or [])]
        log_with = None if run_args.report_to == "none" else run_args.report_to
        self.accelerator = accelerator or Accelerator(log_with=log_with, project_dir=run_args.output_dir)
        # after the accelerator: accelerate's multi-CPU state sets torch's pool to physical cores / processes when
        # OMP_NUM_THREADS is unset (forked workers), and other thread counts change float results in the last bits
        torch.set_num_threads(max(1, run_args.num_threads))
        self.device = self.accelerator.device
        configure_determinism(self.device, run_args.deterministic)
        self.output_dir = Path(run_args.output_dir)
        self._prepare_output_dir()

        if fed_data is None:
            from ..data import build_federated_dataset
            fed_data = build_federated_dataset(data_args, seed=run_args.seed)
        self.data = fed_data
        self.num_clients = len(fed_data.clients)
        if self.num_clients == 0:
            raise ValueError("the federated dataset has no clients")
        if run_args.clients_per_round is not None and run_args.clients_per_round > self.num_clients:
            raise ValueError(f"--clients_per_round {run_args.clients_per_round} is more than the {self.num_clients} "
                             f"training clients; pass --clients_per_round {self.num_clients} or less (or raise "
                             "--num_clients)")
        self.ownership = self._build_ownership()

        algo_cls = get_algorithm(run_args.method)
        method_config = method_config if method_config is not None else algo_cls.Config()
        from ..options import validate
        validate(method_config)   # a config built in Python meets the same declared checks as a parsed one
        self.ctx = MethodContext(self)
        self.algorithm: Algorithm = algo_cls(self.ctx, method_config)
        if algo_cls.one_shot and run_args.num_rounds != 1:
            logger.warning("%s is one-shot: running exactly 1 round (asked for %d)", algo_cls.name, run_args.num_rounds)
            self.args = dataclasses.replace(run_args, num_rounds=1)

        set_seed(run_args.seed)
        self.default_model_built, self._default_model = False, None
        self.model: nn.Module = self.algorithm.build_model().to(self.device)
        #: the run trains --model exactly as built from the options (not a model the method built around or instead
        #: of it): what the run header says
        self.model_is_default = self.model is self._default_model
        self.model_state = self.model.state_dict()  # entries share storage with the model: swap by copy_
        self.keys_by_role = assign_roles(self.model, self.model_state, self.algorithm)
        self.initial_private = snapshot(self.model_state, self.keys_by_role[PRIVATE])
        self.frozen = FrozenCheck(self.model, self.model_state, self.keys_by_role[FROZEN], self.algorithm)
        cap = getattr(run_args, "max_state_mb", 0)
        self.store = ClientStateStore(max_bytes=int(cap * 2**20) if cap else None,
                                      spill_dir=self.output_dir / "client_states" /
                                      f"rank{self.accelerator.process_index}")
        self.ledger = CommLedger()
        self.history: list[dict] = []
        self.round_seconds = 0.0              # how long the last round took, its evaluation included
        self.splits = SplitCache(getattr(run_args, "data_cache_mb", 0))
        self._load_memo: dict | None = None   # set while evaluating: skips re-loading unchanged tensors
        self._elapsed_before = 0.0
        self.round = 0                        # the last completed round
        self.server_state: dict | None = None
        self.final_eval: dict | None = None
        self._client_hp_overrides: dict = {}
        self._seed_memo: dict[tuple, int] = {}  # prefetch_seeds: one round's client seeds, computed together
        self._caches: dict[str, dict] = {}   # per-run caches of methods (ctx.cache) and of the vectorized path
        self._stacked_data: dict = {}        # the vectorized path's stacked client splits (vectorized.stacked_data)
        self._grad_layouts: dict | None = None   # each gradient's memory order, once probed (vectorized.grad_layouts)
        self._server_hp = ServerHParams.from_args(run_args)
        self.last_updates: list[Update] = []
        self._vector_failed = False   # a vectorized chunk failed once: the rest of the run goes client by client
        self.rounds = RoundRunner(self)
        self.evaluator = Evaluator(self)

    # ------------------------------------------------------------------ setup helpers
    def _prepare_output_dir(self) -> None:
        from ..runtime import prepare_output_dir  # the one output-folder rule of every entry point
        prepare_output_dir(self.output_dir, overwrite=self.args.overwrite_output_dir,
                           resume=bool(self.args.resume_from_checkpoint),
                           main_process=self.accelerator.is_main_process)
        barrier(self.accelerator)

    def _build_ownership(self) -> Ownership:
        """Which process owns each client for the whole run (training and new clients balanced separately), from
        the split sizes every process has: cost = 3 x train examples (forward + backward) + test examples."""
        acc = self.accelerator
        everyone = list(self.data.clients) + list(self.data.new_clients)
        costs = [3 * len(c.train) + (len(c.test) if c.test is not None else 0) for c in everyone]
        n = self.num_clients
        return Ownership(costs, acc.num_processes, acc.process_index,
                         groups=[range(n), range(n, len(everyone))])

    def process_train_examples(self, client_ids=None) -> list[int]:
        """Training examples per process over ``client_ids`` (default: every client): how balanced the owners are."""
        ids = range(self.num_clients) if client_ids is None else client_ids
        return [int(x) for x in self.ownership.share(ids, [len(c.train) for c in self.data.clients])]

    def cache(self, name: str) -> dict:
        """A per-run cache by name (a method's derived data: the KD pool, corrupted test copies), dropped with the
        simulation."""
        return self._caches.setdefault(name, {})

    def build_default_model(self) -> nn.Module:
        from ..models import build_run_model
        from ..runtime import preserved_rng
        self.default_model_built = True  # the run header names --model only when the model came from it
        with preserved_rng():  # pretraining a stand-in on first use must not shift this run's random streams
            self._default_model = build_run_model(
                self.args.model, self.args.adapter, num_labels=self.data.num_labels, image_size=self.data.image_size,
                num_channels=self.data.num_channels, lora_r=self.args.lora_r)
        return self._default_model

    # ------------------------------------------------------------------ data, seeds, hyperparameters
    def _tensor_data(self, ds) -> TensorData:
        return self.splits.tensors(ds)

    def seed_torch(self, seed: int) -> None:
        """``torch.manual_seed`` for this process's device. On the CPU only the CPU generator is seeded: the
        same numbers, without the CUDA lazy-seeding bookkeeping that costs milliseconds per call."""
        if self.device.type == "cpu":
            torch.default_generator.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def client(self, client_id: int):
        if client_id < self.num_clients:
            return self.data.clients[client_id]
        return self.data.new_clients[client_id - self.num_clients]

    def train_data(self, client_id: int) -> TensorData:
        c = self.client(client_id)
        if len(c.train) == 0:
            raise ValueError(f"client {client_id} has no training data; use fewer clients or a larger min_partition_size")
        return self._tensor_data(c.train)

    def val_data(self, client_id: int) -> TensorData:
        c = self.client(client_id)
        if c.val is None or len(c.val) == 0:
            raise ValueError(f"client {client_id} has no validation split; pass --val_fraction (e.g. 0.1)")
        return self._tensor_data(c.val)

    def test_data(self, client_id: int) -> TensorData:
        return self._tensor_data(self.client(client_id).test)

    def global_test_data(self) -> TensorData:
        return self._tensor_data(self.data.global_test)

    def public_data(self) -> TensorData:
        if self.data.public is None or len(self.data.public) == 0:
            raise ValueError("this federated dataset has no public pool")
        return self._tensor_data(self.data.public)

    def seed_for(self, round_idx: int, client_id: int, tag: str = "") -> int:
        seed = self._seed_memo.get((self.args.seed, round_idx, client_id, tag))
        return seed if seed is not None else seeding.seed_for(self.args.seed, round_idx, client_id, tag)

    def prefetch_seeds(self, round_idx: int, client_ids, tags) -> None:
        """Compute the seeds of these clients' streams (``tags``) at once and keep them until the next prefetch:
        the one-by-one path asks for two a client, ~40 us each when computed alone (:func:`seeding.seeds_for`)."""
        ids = list(client_ids)
        self._seed_memo = {(self.args.seed, round_idx, c, t): s for t in tags
                           for c, s in zip(ids, self.seeds_for(round_idx, ids, t))}

    def seeds_for(self, round_idx: int, client_ids, tag: str = "") -> list[int]:
        """``[seed_for(round_idx, c, tag) for c in client_ids]``, computed for all clients at once."""
        return seeding.seeds_for(self.args.seed, round_idx, client_ids, tag)

    def generator(self, round_idx: int, client_id: int, tag: str = "") -> torch.Generator:
        return torch.Generator().manual_seed(self.seed_for(round_idx, client_id, tag))

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        return self.ctx.make_optimizer(params)

    def client_hparams(self, client_id: int) -> HParams:
        """This client's hyperparameters in the current round: run arguments < step(client_hparams=...) < method."""
        hp = HParams.from_args(self.args)
        if getattr(self.args, "lr_milestones", None):   # the run's step schedule of --lr (federated/lr_schedule.py)
            from .lr_schedule import scheduled_lr
            hp = hp.replace(lr=scheduled_lr(hp.lr, self.round + 1, self.args))
        over = self._client_hp_overrides
        over = over(client_id) if callable(over) else over.get(client_id, {})
        if over:
            hp = hp.replace(**over)
        return self.algorithm.client_hparams(client_id, self.round + 1, hp)

    def server_hparams(self) -> ServerHParams:
        return self._server_hp

    def sample_clients(self, round_idx: int) -> list[int]:
        n = self.num_clients
        m = self.args.clients_per_round or max(1, int(round(self.args.client_fraction * n)))
        m = min(m, n)
        rng = np.random.default_rng([self.args.seed, round_idx])
        return sorted(int(c) for c in rng.choice(n, size=m, replace=False))

    # ------------------------------------------------------------------ one round
    def run_round(self, round_idx: int, server_state: dict) -> tuple[dict, dict]:
        """One round from ``server_state``: (the new server state, the round's metrics)."""
        return self.rounds.run(round_idx, server_state)

    # ------------------------------------------------------------------ evaluation
    def eval_client_ids(self, round_idx: int, final: bool = False) -> list[int]:
        """The clients scored at this evaluation (all at the final one, else ``--eval_clients`` of them)."""
        return self.evaluator.client_ids(round_idx, final)

    def evaluate(self, round_idx: int, server_state: dict, final: bool = False) -> dict:
        """The global model's and every scored client's personal model's metrics (and new clients' at the end)."""
        return self.evaluator.evaluate(round_idx, server_state, final)

    # ------------------------------------------------------------------ whole state (FedPop, checkpoints)
    def state_dict(self) -> dict:
        """Everything needed to continue this simulation bit for bit (this process's clients): server state,
        client store (private parts, optimizer states), ledger, history, round, the method's own state, RNG."""
        return {"round": self.round, "server_state": {p: dict(d) for p, d in (self.server_state or {}).items()},
                "store": self.store.flatten(), "ledger": self.ledger.to_json(), "history": list(self.history),
                "algorithm": self.algorithm.state_dict(), "torch_rng": torch.get_rng_state(),
                "server_hparams": dataclasses.asdict(self._server_hp), "elapsed": self.elapsed()}

    def load_state_dict(self, state: dict) -> None:
        expected = self.algorithm.init_server_state()
        got = state["server_state"]
        for p in set(expected) | set(got):
            if p == "server_opt":
                continue
            mismatch = set(expected.get(p, {})) ^ set(got.get(p, {}))
            if mismatch:
                raise ValueError(f"state does not match this model: server state part {p!r} differs in "
                                 f"{len(mismatch)} keys (e.g. {sorted(mismatch)[0]!r})")
        self.round = int(state["round"])
        self.server_state = {p: {k: v.clone() for k, v in d.items()} for p, d in got.items()}
        self.store.clear()
        self.store.load_flat(state["store"])
        self.ledger = CommLedger.from_json(state["ledger"])
        self.history = list(state["history"])
        self.algorithm.load_state_dict(state.get("algorithm", {}))
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])
        if "server_hparams" in state:
            self._server_hp = ServerHParams(**state["server_hparams"])
        self._elapsed_before = float(state.get("elapsed", 0.0))
        self._start = time.perf_counter()

    # ------------------------------------------------------------------ checkpoints
    def fingerprint(self) -> dict:
        """What a run computes: run, data and method settings (not where it writes or how long it runs)."""
        def plain(dc):
            return {k: v for k, v in (dataclasses.asdict(dc) if dataclasses.is_dataclass(dc) else {}).items()}
        run = {k: v for k, v in plain(self.args).items() if k not in _NOT_FINGERPRINTED}
        if run.get("last_batch") == "merge":  # the rule before the option existed: earlier checkpoints still match
            del run["last_batch"]
        fp = {"run": run, "data": plain(self.data_args), "method": plain(self.algorithm.config),
              "num_clients": self.num_clients}
        if self.recipe_settings:  # only when given, so checkpoints written without them still match
            fp["recipe"] = self.recipe_settings
        return fp

    def save_checkpoint(self, round_idx: int, server_state: dict, elapsed: float) -> None:
        ckpt.save_round(self, round_idx, server_state, elapsed)

    def load_checkpoint(self, spec: str) -> None:
        ckpt.resume(self, spec)

    # ------------------------------------------------------------------ the run
    def elapsed(self) -> float:
        """Seconds this run has trained, over every session that resumed it."""
        return self._elapsed_before + time.perf_counter() - getattr(self, "_start", time.perf_counter())

    @property
    def each_client(self) -> bool:
        """A callback declared that it sees every client's upload as it is produced: train clients one by one."""
        return any(cb.needs_each_client for cb in self.callbacks)

    def setup(self) -> None:
        """Initial server state, or the state of ``--resume_from_checkpoint``; then the callbacks' start. Idempotent."""
        if self.server_state is not None:
            return
        self._start = time.perf_counter()
        if self.args.resume_from_checkpoint:
            self.load_checkpoint(self.args.resume_from_checkpoint)
            logger.info("resumed from round %d", self.round)
        else:
            self.server_state = self.algorithm.init_server_state()
        for cb in self.callbacks:
            cb.on_train_begin(self)

    def step(self, client_hparams=None, server_hparams: dict | None = None) -> dict:
        """Run the next round (with evaluation as configured, then the callbacks' ``after_round``); returns its
        metrics.

        ``client_hparams``: ``{client_id: {"lr": ..., "local_epochs": ...}}`` or a function of the client id
        (FedPop-L gives every active client its own vector); ``server_hparams``: ``{"server_lr": ...,
        "server_momentum": ...}`` from this round on."""
        self.setup()
        args = self.args
        r = self.round + 1
        self._client_hp_overrides = client_hparams or {}
        if server_hparams:
            self._server_hp = dataclasses.replace(self._server_hp, **server_hparams)
        round_start = time.perf_counter()
        try:
            self.server_state, metrics = self.run_round(r, self.server_state)
        finally:
            self._client_hp_overrides = {}
        self.round = r
        last = r == args.num_rounds
        if r % args.eval_every == 0 or last:
            ev = self.evaluate(r, self.server_state, final=last)
            metrics.update({k: v for k, v in ev.items() if not isinstance(v, dict)})
            metrics["per_client"] = ev.get("per_client")
            if last:
                self.final_eval = ev
        self.history.append(metrics)
        self.round_seconds = time.perf_counter() - round_start
        for cb in self.callbacks:
            cb.after_round(self, r, metrics)
        return metrics

    def run(self) -> dict:
        self.setup()
        while self.round < self.args.num_rounds:
            self.step()
        return self.finish()

    def finish(self) -> dict:
        """Final evaluation (if the last round did not have one), the run's results; then the callbacks' end
        (results.json and plots by default)."""
        if self.final_eval is None:  # resumed a finished run, or stepped externally: evaluate the final state
            self.final_eval = self.evaluate(self.round, self.server_state, final=True)
        out = results.run_results(self, self.final_eval, self.elapsed())
        for cb in self.callbacks:
            cb.on_train_end(self, out)
        return out

    def parameter_counts(self) -> dict:
        return results.parameter_counts(self)

    def budget(self) -> dict:
        """Training spent so far (optimizer steps, examples) in total and per trained model, from the round history."""
        return results.budget(self)

