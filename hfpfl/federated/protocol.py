"""The protocol every method plugs into. It belongs to the engine; methods depend on it, never the reverse.

A round, as the engine runs it (one model instance per process, client states swapped in and out)::

    server_state = algo.init_server_state()                        # once; named parts, e.g. {"model": ..., "control": ...}
    for round r (Simulation.step()):
        weights = algo.aggregation_weights(sampled)                # known before training (FedAvg: n_i)
        for each sampled client i (sharded over processes):
            down   = algo.download(server_state, i)                # parts that travel server -> client (bytes counted)
            update = algo.client_update(i, down, private_i, r)     # local work; update.upload travels client -> server
            algo.accumulate(sums, update, weights[i])              # streaming: O(model) memory, upload dropped
        server_state = algo.reduce(server_state, sums, r)          # sums / total weight, server optimizer (FedOpt)
        # or, for methods that need every upload (KD ensembles, FedBiP synthesis): they declare
        # aggregation = "gather" and override ``aggregate``
        # (server_state, updates, r), which the engine runs once, on the main process, then broadcasts.
    evaluation: algo.load_global(server_state), algo.load_personal(i, server_state, private_i, r)
    new clients: algo.personalize_new_client(i, server_state, data, r)

**State is made of named parts.** Everything that is stored or travels is a ``Parts`` = ``dict[part name,
dict[key, Tensor]]``: the part ``"model"`` holds model state-dict entries; methods add their own parts (SCAFFOLD's
``"control"``, Ditto's ``"personal"``, FedBasis' bases, optimizer state ``"optim"``). Checkpoints and byte accounting
understand parts (bytes are reported per part). All state tensors live on the CPU; the model lives on ``ctx.device``.

**Key roles.** Every model state-dict key is ``global`` (travels and is aggregated), ``private`` (kept per client;
the engine always swaps a client's private model part in before its update and out after, so nothing leaks between
clients) or ``frozen`` (never trained, never sent; the engine checks that frozen tensors do not change).

**The context.** A method sees the engine only through ``self.ctx`` (:class:`MethodContext`): the model, its key
roles, the client's data, per-client hyperparameters, seeded generators, the training loop and evaluation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from ..training import Metric
from .aggregation import WeightedSums, server_optimizer_step
from .comm import Parts
from .context import HParams, MethodContext
from .state import FROZEN, GLOBAL, MODEL, OPTIM, PRIVATE  # noqa: F401  (the protocol's names)


@dataclass
class NoConfig:
    """This method has no hyperparameters of its own."""


@dataclass
class Update:
    """What a client's local work produced."""

    client_id: int
    upload: Parts                          # travels client -> server (bytes counted)
    num_samples: int
    private: Parts | None = None           # new private state; stays on the client
    metrics: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)  # the server's work on this upload alone (``receive``); not sent


class Algorithm:
    """Base class = FedAvg semantics (with the FedOpt server optimizer); methods override only what differs.

    The interface, by moment (every member has FedAvg's default; ``docs/how-to/writing-a-method.md``):

    ===================  ==============================================================================================
    declarations         ``name``, ``Config``, ``aggregation``, ``local_update``, ``personal_model``, ``one_shot``,
                         ``has_global_model``, ``on_non_finite``, ``uses_server_hparams``, ``uses_client_hparams``
    the model            ``build_model``, ``key_role`` (global / private / frozen), ``metric``, ``trainable_parameters``
    start                ``init_server_state``, ``init_private_state``
    server -> client     ``download``, ``client_hparams``
    on the client        ``client_update`` = ``load_client`` -> ``local_train`` with ``local_hooks`` (``regularizer``)
    client -> server     ``receive``, then ``aggregation_weights`` + ``accumulate`` + ``reduce`` ("mean", "stream")
                         or ``aggregate`` ("gather")
    evaluation           ``load_global``, ``load_personal``, ``extra_metrics``
    new clients          ``new_client_keys``, ``personalize_new_client``
    checkpoints          ``state_dict``, ``load_state_dict`` (the method's own server-side state)
    ===================  ==============================================================================================

    Helpers a method calls, not overrides: ``model``, ``global_keys``, ``private_keys``, ``bind_hooks``,
    ``vectorizable``; everything else of the run is reached through ``self.ctx`` (:class:`MethodContext`)."""

    name: ClassVar[str] = "base"
    Config: ClassVar[type] = NoConfig
    one_shot: ClassVar[bool] = False          # one-shot methods run exactly one round
    #: set by ``aggregate`` when the server itself trains the model the run evaluates (the train loop's metrics:
    #: ``steps``, ``examples``): the engine records it in the round's history and the run's budget
    server_training: dict | None = None
    has_global_model: ClassVar[bool] = True
    # What the engine needs to know to choose its path; it follows these declarations, never which methods a class
    # overrides. ``aggregation``: how the round's uploads reach the server --
    #   "mean"   the weighted mean of the "model" part (FedAvg's ``accumulate``): a vectorized chunk's stacked uploads
    #            fold into the sums in one call;
    #   "stream" the method's own ``accumulate`` on each upload (after ``receive``), then ``reduce``: O(model) memory;
    #   "gather" every upload of the round (after ``receive``) to ``aggregate`` at once, on the main process (KD
    #            ensembles, synthesis).
    aggregation: ClassVar[str] = "mean"
    # ``local_update``: "engine" -- a client trains through ``load_client`` -> ``local_train`` with ``local_hooks``
    # (pure functions: the vectorized path batches them); "own" -- the method's ``client_update`` trains its own
    # way, and the engine trains its clients one by one.
    local_update: ClassVar[str] = "engine"
    # ``personal_model``: "loaded" -- a client's personal model is its download plus its private state (the default
    # ``load_personal``), so many clients can be scored in one batched call; "own" -- ``load_personal`` builds it.
    personal_model: ClassVar[str] = "loaded"
    on_non_finite: ClassVar[str] = "error"     # "error": a diverged client stops the run; "skip": the method copes
    # one client update's cost in small-model updates (~0.1-0.3 s), for --num_processes auto (hfpfl.launch.decide)
    client_update_cost: ClassVar[float] = 1.0
    # The run's hyperparameters this method's update reads: a tuner (FedPop) searches only these and refuses a search
    # space naming another. Server: the FedOpt step of ``reduce`` (``server_optimizer_step``); a method whose
    # aggregate/reduce bypasses it declares fewer. Client: the fields of ``HParams`` that ``ctx.train`` turns into
    # the local optimizer and loop; a method that fixes the epochs, the optimizer or rejects a value declares fewer.
    uses_server_hparams: ClassVar[frozenset] = frozenset({"server_lr", "server_momentum", "server_lr_decay"})
    uses_client_hparams: ClassVar[frozenset] = frozenset({"lr", "momentum", "weight_decay", "local_epochs",
                                                          "batch_size", "dropout"})

    def __init__(self, ctx: MethodContext, config):
        self.ctx = ctx
        self.config = config

    # ------------------------------------------------------------------ model and key roles
    def build_model(self) -> nn.Module:
        return self.ctx.build_default_model()

    def key_role(self, key: str, default: str) -> str:
        """Role of a state-dict key. `default` is derived from requires_grad (see Simulation)."""
        return default

    def metric(self) -> Metric:
        """How personal and global models are scored (the task's metric); default: classification accuracy."""
        return Metric()

    @property
    def model(self) -> nn.Module:
        return self.ctx.model

    @property
    def global_keys(self) -> list[str]:
        return self.ctx.keys(GLOBAL)

    @property
    def private_keys(self) -> list[str]:
        return self.ctx.keys(PRIVATE)

    def trainable_parameters(self, keys=None) -> list[nn.Parameter]:
        """Parameters among `keys` (default: global + private) that may be trained."""
        allowed = set(keys) if keys is not None else set(self.global_keys) | set(self.private_keys)
        return [p for n, p in self.model.named_parameters() if n in allowed and p.requires_grad]

    # ------------------------------------------------------------------ hyperparameters
    def client_hparams(self, client_id: int, round_idx: int, hp: HParams) -> HParams:
        """A client's hyperparameters this round (default: unchanged)."""
        return hp

    # ------------------------------------------------------------------ server side
    def init_server_state(self) -> Parts:
        return {MODEL: self.ctx.snapshot(self.global_keys)}

    def init_private_state(self, client_id: int) -> Parts:
        """Every client starts from the same initial private values (as if the server sent the init once)."""
        return {MODEL: {k: v.clone() for k, v in self.ctx.initial_private.items()}}

    def download(self, server_state: Parts, client_id: int) -> Parts:
        return {MODEL: {k: server_state[MODEL][k] for k in self.global_keys}}

    def aggregation_weights(self, client_ids: list[int]) -> dict[int, float]:
        """Each sampled client's aggregation weight, known before training (FedAvg: its number of samples)."""
        return {c: float(len(self.ctx.train_data(c))) for c in client_ids}

    def accumulate(self, sums: WeightedSums, update: Update, coef: float) -> None:
        """Fold one upload into the running sums (``coef`` = its aggregation weight; ``sums.get`` divides by the
        round's total weight, so ``reduce`` reads weighted means). Where a diverged client stops the run
        (``on_non_finite = "error"``), the sums check the upload for NaN and infinities as they fold it (``source``),
        so the engine does not read it a second time for that."""
        sums.add(MODEL, update.upload[MODEL], coef,
                 source=update.client_id if self.on_non_finite == "error" else None)

    def reduce(self, server_state: Parts, sums: WeightedSums, round_idx: int) -> Parts:
        """The new server state from the round's sums: the weighted mean, through the server optimizer."""
        if MODEL not in sums:
            return server_state
        mean = sums.get(MODEL, server_state[MODEL])
        params = {n for n, _ in self.model.named_parameters()}
        return server_optimizer_step(server_state, mean, self.ctx.server_hparams(), round_idx, params)

    def receive(self, update: Update, round_idx: int) -> None:
        """Server work on one upload alone, before the round's aggregation (default: none). The engine calls it on
        the process that holds the upload, right after the client's update, so with N processes this work is
        spread N ways (each upload is received once, wherever it lands). Store results in ``update.received``: they
        travel with the update to ``aggregate`` (or ``accumulate``) and are not counted as communication. Read only
        what a server has: the upload, the method's config and public models, ``ctx.generator(r, i, tag)`` for
        randomness (seeded per client, so the result does not depend on the process). FedBiP synthesises one
        client's images here."""

    def aggregate(self, server_state: Parts, updates: list[Update], round_idx: int) -> Parts:
        """All of a round's uploads at once (``aggregation = "gather"``). The default streams them through
        accumulate/reduce; a method that needs every upload together (KD ensembles, synthesis) overrides this and
        declares ``aggregation = "gather"``."""
        if not updates:
            return server_state
        weights = self.aggregation_weights([u.client_id for u in updates])
        total = sum(weights.values())
        if total <= 0:
            raise ValueError("aggregation weights sum to zero (every sampled client has no data)")
        sums = WeightedSums(denominator=total)
        for u in updates:
            self.accumulate(sums, u, weights[u.client_id])
            sums.count += 1
        return self.reduce(server_state, sums, round_idx)

    # ------------------------------------------------------------------ client side
    def load_client(self, down: Parts, private: Parts | None) -> None:
        self.ctx.load(down.get(MODEL, {}))
        if private and private.get(MODEL):
            self.ctx.load(private[MODEL])

    def client_update(self, client_id: int, down: Parts, private: Parts | None, round_idx: int) -> Update:
        self.load_client(down, private)
        metrics = self.local_train(client_id, round_idx, **self.bind_hooks(client_id, down, private))
        return Update(client_id, upload={MODEL: self.ctx.snapshot(self.global_keys)},
                      num_samples=len(self.ctx.train_data(client_id)),
                      private={MODEL: self.ctx.snapshot(self.private_keys)}, metrics=metrics)

    def local_hooks(self, client_id: int, down: Parts, private: Parts | None) -> dict:
        """Extra terms of the local loss, as pure functions, so that the sequential and the vectorized path run the
        same code: ``{"regularizer": fn(params, anchor) -> loss}``, where ``params`` are the client's trainable
        parameters by name and ``anchor`` its download's ``"model"`` part on the model's device (FedProx's proximal
        term). FedAvg: none. Any other key is passed to ``ctx.train`` as is, and the engine then trains the clients
        one by one (only a regularizer has a vectorized form)."""
        return {}

    def bind_hooks(self, client_id: int, down: Parts, private: Parts | None) -> dict:
        """:meth:`local_hooks` as ``ctx.train`` takes them: the regularizer bound to this client's download,
        ``regularizer(model)``."""
        hooks = dict(self.local_hooks(client_id, down, private))
        reg = hooks.get("regularizer")
        if reg is not None:
            anchor = {k: v.detach().to(self.ctx.device, copy=True) for k, v in down.get(MODEL, {}).items()}
            hooks["regularizer"] = lambda model: reg(
                {n: p for n, p in model.named_parameters() if p.requires_grad}, anchor)
        return hooks

    def local_train(self, client_id: int, round_idx: int, **kwargs) -> dict:
        """The engine's training loop on this client's data (see :meth:`MethodContext.train`)."""
        return self.ctx.train(client_id, round_idx, **kwargs)

    def vectorizable(self) -> bool:
        """Whether this run's local updates take the engine's path (``load_client`` → ``local_train`` with
        :meth:`local_hooks`, fresh optimizer), so ``--vectorize`` may train many clients in one batched call.
        Default: ``local_update == "engine"``. A method whose own update only acts under an option (FedBN's
        ``keep_optimizer_state``) answers for that option here."""
        return self.local_update == "engine"

    # ------------------------------------------------------------------ evaluation
    def load_global(self, server_state: Parts) -> nn.Module | None:
        """Put the global model in `self.model` and return it; None if the method has no global model.
        (The engine has already loaded the initial private values, e.g. a frozen backbone's own BN statistics.)"""
        if not self.has_global_model:
            return None
        self.ctx.load({k: server_state[MODEL][k] for k in self.global_keys})
        return self.model

    def load_personal(self, client_id: int, server_state: Parts, private: Parts | None, round_idx: int) -> nn.Module:
        self.load_client(self.download(server_state, client_id), private or self.init_private_state(client_id))
        return self.model

    def extra_metrics(self, round_idx: int, server_state: Parts) -> dict:
        """More scalar metrics at each evaluation (e.g. PerAda's accuracy on corrupted test sets); none by default."""
        return {}

    def new_client_keys(self) -> list[str]:
        """What a new client (never seen in training) tunes; default: everything trainable."""
        return self.global_keys + self.private_keys

    def personalize_new_client(self, client_id: int, server_state: Parts, data, round_idx: int) -> nn.Module:
        """Default new-client protocol: start from the global state and fine-tune on the client's train split."""
        self.load_client(self.download(server_state, client_id), self.init_private_state(client_id))
        epochs = self.ctx.run.new_client_epochs
        if epochs > 0:
            self.local_train(client_id, round_idx, params=self.trainable_parameters(self.new_client_keys()),
                             epochs=epochs, tag="new-client", data=data)
        return self.model

    # ------------------------------------------------------------------ state beyond the parts (rarely needed)
    def state_dict(self) -> dict:
        """JSON-able method state that is not tensors (kept in checkpoints and Simulation.state_dict)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
