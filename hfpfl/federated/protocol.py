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

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar

import torch
from torch import nn

from ..training import Metric, TensorData, channels_last_pays, conv_channels_last, default_loss, evaluate, load_optimizer_state, \
    make_optimizer, optimizer_state_tensors, train_local
from .comm import Parts, TensorDict
from .state import load_into, snapshot

if TYPE_CHECKING:
    from .engine import Simulation

GLOBAL, PRIVATE, FROZEN = "global", "private", "frozen"
MODEL = "model"          # the part holding model state-dict entries
OPTIM = "optim"          # the private part holding a client's persistent optimizer state


class NonFiniteError(ValueError):
    """Training diverged: weights or losses became NaN/inf."""


def step_size_hint(args, config, lr=None, server: bool = False) -> str:
    """What a divergence message tells the user to change: every option that sets a step size of what was trained,
    with its value -- ``--lr`` (``lr``: the client's own where it differs), the options the method config declares
    in ``STEP_SIZES`` (``{"option": "lower" | "raise"}``: e.g. fedbasis' ``--lr_coef`` and ``--temperature``) and,
    for the server's state, ``--server_lr``."""
    lower = [f"--lr (now {args.lr if lr is None else lr})"]
    higher = []
    for name, way in (getattr(config, "STEP_SIZES", None) or {}).items():
        (higher if way == "raise" else lower).append(f"--{name} (now {getattr(config, name)})")
    if server:
        lower.append(f"--server_lr (now {args.server_lr})")

    def either(items):
        return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]
    return "lower " + either(lower) + (", or raise " + either(higher) if higher else "")


def _sum_dtype(t: torch.Tensor):
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a floating tensor is finite: its sum in its own precision is finite only if every
    value is (NaN and inf propagate), which is one fast pass; only a sum that overflowed is checked value by value."""
    return bool(t.sum(dtype=_sum_dtype(t)).isfinite()) or bool(torch.isfinite(t).all())


def finite_rows(t: torch.Tensor) -> torch.Tensor:
    """:func:`all_finite` of every row of a ``[rows, ...]`` tensor (a vectorized chunk's clients), as a bool tensor."""
    dims = tuple(range(1, t.dim()))  # summed in place whatever the layout (a reshape would copy a strided stack)
    ok = (t.sum(dims, dtype=_sum_dtype(t)) if dims else t).isfinite()
    if not bool(ok.all()):
        ok = torch.isfinite(t).flatten(1).all(1) if dims else torch.isfinite(t)
    return ok


@dataclass
class NoConfig:
    """This method has no hyperparameters of its own."""


@dataclass(frozen=True)
class HParams:
    """A client's training hyperparameters for one round. Defaults come from the run arguments; a method
    (``Algorithm.client_hparams``) or a driver such as FedPop (``Simulation.step(client_hparams=...)``) can give each
    client its own."""

    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    optimizer: str = "sgd"
    local_epochs: int = 1
    local_steps: int | None = None
    batch_size: int = 32
    dropout: float | None = None   # None: the model's own dropout rates

    @classmethod
    def from_args(cls, args) -> "HParams":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def replace(self, **changes) -> "HParams":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown client hyperparameter(s) {sorted(unknown)}; known: "
                             f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ServerHParams:
    """The server optimizer (FedOpt, Reddi et al. 2021): pseudo-gradient d = x - mean(uploads); m <- momentum * m + d;
    x <- x - lr_t * m with lr_t = server_lr * server_lr_decay^(round - 1). server_lr = 1, momentum = 0 is FedAvg."""

    server_lr: float = 1.0
    server_momentum: float = 0.0
    server_lr_decay: float = 1.0

    @classmethod
    def from_args(cls, args) -> "ServerHParams":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


@dataclass
class Update:
    """What a client's local work produced."""

    client_id: int
    upload: Parts                          # travels client -> server (bytes counted)
    num_samples: int
    private: Parts | None = None           # new private state; stays on the client
    metrics: dict = field(default_factory=dict)
    received: dict = field(default_factory=dict)  # the server's work on this upload alone (``receive``); not sent


@contextlib.contextmanager
def dropout_rate(model: nn.Module, p: float | None):
    """Temporarily set every nn.Dropout's rate (per-client dropout, tuned by FedPop)."""
    if p is None:
        yield
        return
    mods = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    old = [m.p for m in mods]
    for m in mods:
        m.p = p
    try:
        yield
    finally:
        for m, q in zip(mods, old):
            m.p = q


class MethodContext:
    """What a method may read and call. Nothing else of the engine is part of the protocol.

    Model: ``model``, ``model_state`` (the model's cached state dict, shares storage), ``keys(role)``,
    ``initial_private``, ``load(values)``, ``snapshot(keys)``, ``build_default_model()``, ``device``.
    Data: ``data`` (the FederatedData), ``num_clients``, ``num_labels``, ``client(i)``, ``train_data(i)``,
    ``val_data(i)``, ``test_data(i)``, ``global_test_data()``, ``public_data()``.
    Training: ``hparams(i)``, ``server_hparams()``, ``train(...)``, ``evaluate(model, data)``, ``metric()``,
    ``make_optimizer(params, hp)``, ``generator(round, i, tag)``, ``seed_for(round, i, tag)``, ``args`` (read-only run
    settings).
    Several processes: ``is_main_process``, ``owned(clients)``, ``gather(items)``, ``private_state(i)``;
    ``output_dir`` for artefacts (grids, adapters)."""

    def __init__(self, sim: "Simulation"):
        self._sim = sim

    # model ------------------------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self._sim.model

    @property
    def model_state(self) -> TensorDict:
        return self._sim.model_state

    def keys(self, role: str) -> list[str]:
        return self._sim.keys_by_role[role]

    @property
    def keys_by_role(self) -> dict[str, list[str]]:
        return self._sim.keys_by_role

    @property
    def initial_private(self) -> TensorDict:
        return self._sim.initial_private

    def load(self, values: TensorDict) -> None:
        load_into(self._sim.model_state, values, getattr(self._sim, "_load_memo", None))

    def snapshot(self, keys) -> TensorDict:
        return snapshot(self._sim.model_state, keys)

    def cache(self, name: str) -> dict:
        """A per-run cache by name, for what a method derives once and reads every round (its KD pool, corrupted
        test copies): the same dict for the whole run, dropped with it."""
        return self._sim.cache(name)

    def build_default_model(self) -> nn.Module:
        return self._sim.build_default_model()

    @property
    def device(self) -> torch.device:
        return self._sim.device

    # data -------------------------------------------------------------------------------------------------
    @property
    def data(self):
        return self._sim.data

    @property
    def num_clients(self) -> int:
        return self._sim.num_clients

    @property
    def num_labels(self) -> int:
        return self._sim.data.num_labels

    def client(self, client_id: int):
        return self._sim.client(client_id)

    def train_data(self, client_id: int) -> TensorData:
        return self._sim.train_data(client_id)

    def val_data(self, client_id: int) -> TensorData:
        return self._sim.val_data(client_id)

    def test_data(self, client_id: int) -> TensorData:
        return self._sim.test_data(client_id)

    def global_test_data(self) -> TensorData:
        return self._sim.global_test_data()

    def public_data(self) -> TensorData:
        return self._sim.public_data()

    # training ---------------------------------------------------------------------------------------------
    @property
    def args(self):
        return self._sim.args

    @property
    def round(self) -> int:
        return self._sim.round

    def hparams(self, client_id: int) -> HParams:
        return self._sim.client_hparams(client_id)

    def server_hparams(self) -> ServerHParams:
        return self._sim.server_hparams()

    def metric(self) -> Metric:
        return self._sim.algorithm.metric()

    def make_optimizer(self, params, hp: HParams | None = None) -> torch.optim.Optimizer:
        hp = hp or HParams.from_args(self.args)
        return make_optimizer(params, hp.optimizer, hp.lr, hp.momentum, hp.weight_decay)

    def generator(self, round_idx: int, client_id: int, tag: str = "") -> torch.Generator:
        return self._sim.generator(round_idx, client_id, tag)

    def seed_for(self, round_idx: int, client_id: int, tag: str = "") -> int:
        return self._sim.seed_for(round_idx, client_id, tag)

    def evaluate(self, model: nn.Module, data: TensorData, metric: Metric | None = None) -> dict:
        with conv_channels_last(model, self.channels_last(model)):
            return evaluate(model, data, batch_size=self.args.eval_batch_size, device=self.device,
                            metric=metric or self.metric())

    def channels_last(self, model: nn.Module) -> bool:
        """Whether this run's ``--channels_last`` applies to ``model`` (:func:`hfpfl.training.channels_last_pays`)."""
        return channels_last_pays(model, getattr(self.args, "channels_last", "off"), self.device)

    def train(self, client_id: int, round_idx: int, *, params=None, hp: HParams | None = None, epochs=None,
              steps=None, data=None, tag: str = "", optimizer_state: TensorDict | None = None,
              optimizer: Callable | None = None, schedule: Callable | None = None, **hooks) -> dict:
        """The engine's training loop on a client's data with its hyperparameters, seeded by (seed, round, client,
        tag). ``params``: parameters or parameter groups (dicts with per-group ``lr``); several optimizers: pass
        ``params=[groups_a, groups_b]`` with ``loss_fn=[fn_a, fn_b]``. ``optimizer_state``: the optimizer state this
        client kept from earlier rounds (returned as ``metrics["optimizer_state"]`` for the method to keep).
        ``optimizer``: ``fn(params, hp) -> torch.optim.Optimizer`` in place of the run's ``--optimizer`` (e.g. a
        paper's AdamW betas). ``schedule``: ``fn(optimizer) -> LRScheduler``, built on every optimizer of this call
        and stepped after every optimizer step (a per-round warm-up, as FedDAT's). ``hooks``: ``loss_fn``,
        ``regularizer``, ``before_step``, ``after_step``."""
        sim = self._sim
        hp = hp or self.hparams(client_id)
        params = sim.algorithm.trainable_parameters() if params is None else params
        several = isinstance(hooks.get("loss_fn"), (list, tuple))
        param_sets = list(params) if several else [params]
        names = {id(p): n for n, p in self.model.named_parameters()}
        optimizers = [(optimizer or self.make_optimizer)(ps, hp) for ps in param_sets]
        if schedule is not None:
            if "scheduler" in hooks:
                raise ValueError("pass either schedule= (built on this call's optimizers) or scheduler=, not both")
            hooks["scheduler"] = _Schedules([schedule(opt) for opt in optimizers])
        if optimizer_state:
            for i, opt in enumerate(optimizers):
                load_optimizer_state(opt, {k[len(f"{i}:"):]: v for k, v in optimizer_state.items()
                                           if k.startswith(f"{i}:")}, names)
        if epochs is None and steps is None:
            epochs, steps = hp.local_epochs, hp.local_steps
        with dropout_rate(self.model, hp.dropout), conv_channels_last(self.model, self.channels_last(self.model)):
            metrics = train_local(self.model, data if data is not None else self.train_data(client_id),
                                  optimizers if several else optimizers[0], batch_size=hp.batch_size,
                                  epochs=epochs or 1, max_steps=steps,
                                  generator=self.generator(round_idx, client_id, tag), device=self.device,
                                  backward=sim.accelerator.backward, **{"loss_fn": default_loss, **hooks})
        if optimizer_state is not None:
            metrics["optimizer_state"] = {f"{i}:{k}": v for i, opt in enumerate(optimizers)
                                          for k, v in optimizer_state_tensors(opt, names).items()}
        return metrics

    # several processes and artefacts -------------------------------------------------------------------------
    @property
    def is_main_process(self) -> bool:
        return self._sim.accelerator.is_main_process

    def owned(self, client_ids) -> list[int]:
        """The clients of ``client_ids`` this process owns (fixed for the run; ``Simulation.ownership``)."""
        return self._sim.ownership.owned(client_ids)

    def gather(self, items: list) -> list:
        from .distributed import all_gather
        return all_gather(items, self._sim.accelerator)

    def private_state(self, client_id: int) -> Parts | None:
        return self._sim.store.get(client_id)

    @property
    def output_dir(self):
        return self._sim.output_dir

    # older plug-ins used ``self.sim.store.get`` / ``self.sim.accelerator``; keep the two read paths they need
    @property
    def accelerator(self):
        return self._sim.accelerator


class _Schedules:
    """Steps several learning-rate schedulers as one (``train_local`` steps its ``scheduler`` once per step)."""

    def __init__(self, schedulers):
        self.schedulers = schedulers

    def step(self):
        for s in self.schedulers:
            s.step()


def memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The order of ``t``'s dimensions in memory, outermost first (``(0, 2, 1)`` for a transposed batch of
    matrices), or None where ``t`` is not dense (overlapping or with gaps: no order reproduces it)."""
    order = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))  # stable: ties (size-1 dims) keep their index
    return order if t.permute(order).is_contiguous() else None


def _row_order(v: torch.Tensor) -> tuple[int, ...] | None:
    """For a ``[rows, ...]`` stack whose rows are dense but not contiguous (stored in another order of their
    dimensions): that order of dimensions ``1..``, outermost first; None when plain reshaping reads it well."""
    if v.dim() < 3 or v.is_contiguous():
        return None
    order = memory_order(v)
    return order[1:] if order is not None and order[0] == 0 else None


class WeightedSums:
    """Running sums of uploads, O(model) memory however many clients upload: float tensors accumulate
    ``coef * tensor`` in float64 and :meth:`get` divides them by ``denominator`` (the round's total weight); integer
    tensors (BatchNorm step counters) keep the running max. Across processes the partial sums are all-reduced
    (sum / max).

    Why the division comes last: with whole-number weights (sample counts, 1 for uniform means) each product
    ``weight * float32`` is exact in float64 and so, in practice, is their sum (exact while a value's products span
    fewer than ~53 - 24 - log2(weight) bits of exponent), and an exact sum does not depend on the order of its
    terms: one process, N processes (each summing its own clients, then all-reduced) and the vectorized fold give
    the same bits. Normalized weights (``w / total``) round every product, and the order then shows in the last bit
    of some float32 weights (e.g. 115 of 200,000 values, 500 clients, 1 vs 2 processes), which training amplifies.
    Not a guarantee for arbitrary weights or values: only what exact arithmetic gives."""

    def __init__(self, denominator: float = 1.0):
        self.denominator = float(denominator)
        self.sums: dict[str, dict[str, torch.Tensor]] = {}
        self.total: dict[str, float] = {}
        self.count = 0          # uploads folded in (the engine counts them; all-reduced across processes)

    def add(self, part: str, tensors: TensorDict, coef: float) -> None:
        acc = self.sums.setdefault(part, {})
        self.total[part] = self.total.get(part, 0.0) + coef
        for k, v in tensors.items():
            v = v.detach()
            if torch.is_floating_point(v):
                if k not in acc:
                    acc[k] = torch.zeros(v.shape, dtype=torch.float64)
                acc[k].add_(v.cpu(), alpha=coef)  # float64 accumulation, no float64 copy of the upload
            else:
                acc[k] = v.cpu().clone() if k not in acc else torch.maximum(acc[k], v.cpu())

    # float64 temporaries of :meth:`add_stacked` stay below this many bytes (clients are folded in blocks); on the
    # CPU, blocks of 1 MiB measured faster than 8 MiB (MLP 64-64-10 stacks, one process: 100 clients 1.2-1.3 ms vs
    # 1.0-2.0 ms run to run, 500 clients 4.1 vs 6.2 ms); on an accelerator larger blocks mean fewer calls
    STACKED_BLOCK_BYTES = 8 * 2**20
    STACKED_BLOCK_BYTES_CPU = 2**20
    # on the CPU, tensors of this many elements and more are folded client by client (see add_stacked)
    STACKED_ROW_LOOP = 1 << 16

    def add_stacked(self, part: str, stacked: TensorDict, coefs) -> None:
        """Fold many uploads at once: ``stacked[k]`` is ``[clients, *shape]`` (a vectorized chunk's tensors), client
        ``i`` with weight ``coefs[i]``. The same sums as calling :meth:`add` once per client (float64, integer
        tensors by running max), in another order, which does not matter while the sum is exact (see the class)."""
        acc = self.sums.setdefault(part, {})
        coefs = torch.as_tensor(coefs, dtype=torch.float64)
        self.total[part] = self.total.get(part, 0.0) + float(coefs.sum())
        for k, v in stacked.items():
            v = v.detach()
            n = len(v)
            if torch.is_floating_point(v):
                if k not in acc:
                    acc[k] = torch.zeros(v.shape[1:], dtype=torch.float64)
                flat, row = acc[k].view(-1), max(1, v[0].numel())
                if row >= self.STACKED_ROW_LOOP and v.device.type == "cpu":
                    # large tensors are bandwidth-bound: one fused float64 add per client (the bits of ``add``)
                    # beats converting the block to float64 first (measured 110 vs 237 ms, 27 x 0.5 M floats)
                    for i, c in enumerate(coefs.tolist()):
                        acc[k].add_(v[i], alpha=c)  # in any memory layout of ``v``: no copy of the row
                    continue
                cap = self.STACKED_BLOCK_BYTES_CPU if v.device.type == "cpu" else self.STACKED_BLOCK_BYTES
                block = max(1, cap // (8 * row))
                w = coefs.to(v.device)
                # a stack stored in another memory order (a vectorized chunk's parameters keep their gradients'
                # layout) is read in that order: permuted to contiguous (a view), summed, the sum put back in place
                order = _row_order(v)
                if order is not None:
                    v = v.permute(0, *order)
                # summed straight into the running sum where it is a CPU row in the usual order; else into one row
                # where the chunk lives, moved (back to the CPU, into its order) once
                into = flat if order is None and v.device.type == "cpu" else \
                    torch.zeros(row, dtype=torch.float64, device=v.device)
                for s in range(0, n, block):
                    blk = v[s:s + block].reshape(-1, row).double()   # [block, row] float64, where the chunk lives
                    into.addmv_(blk.t(), w[s:s + block])
                if into is not flat:
                    into = into.cpu()
                    if order is None:
                        flat.add_(into)
                    else:
                        acc[k].permute(*[d - 1 for d in order]).add_(into.view(v.shape[1:]))
            else:
                m = v.amax(0).cpu() if n else None
                if m is not None:
                    acc[k] = m.clone() if k not in acc else torch.maximum(acc[k], m)

    def __contains__(self, part: str) -> bool:
        return part in self.sums

    def get(self, part: str, like: TensorDict) -> TensorDict:
        """The sums of ``part`` divided by ``denominator`` (integer running maxima as they are), cast to the dtypes
        of ``like``."""
        acc, d = self.sums[part], self.denominator
        return {k: (acc[k] / d if d != 1.0 and torch.is_floating_point(acc[k]) else acc[k]).to(like[k].dtype)
                for k in acc}

    def all_reduce(self, accelerator) -> None:
        if accelerator.num_processes == 1:
            return
        import torch.distributed as dist
        parts = accelerator_broadcast_keys(self, accelerator)
        for part, keys in parts:
            acc = self.sums.setdefault(part, {})
            for k, (shape, is_float, dtype) in keys:
                if k not in acc:
                    acc[k] = torch.zeros(shape, dtype=torch.float64) if is_float else \
                        torch.full(shape, torch.iinfo(dtype).min, dtype=dtype)
                t = acc[k].to(accelerator.device)
                dist.all_reduce(t, op=dist.ReduceOp.SUM if is_float else dist.ReduceOp.MAX)
                acc[k] = t.cpu()
        totals = torch.tensor([self.total.get(p, 0.0) for p, _ in parts], dtype=torch.float64,
                              device=accelerator.device)
        dist.all_reduce(totals)
        self.total = {p: float(t) for (p, _), t in zip(parts, totals.cpu())}
        count = torch.tensor([self.count], dtype=torch.int64, device=accelerator.device)
        dist.all_reduce(count)
        self.count = int(count.item())


def accelerator_broadcast_keys(sums: WeightedSums, accelerator):
    """The union over processes of (part, [(key, (shape, is_float, dtype))]), in one agreed order (a process whose
    clients uploaded nothing for a key still joins the collective with zeros)."""
    from accelerate.utils import gather_object
    mine = [(p, [(k, (tuple(v.shape), v.dtype == torch.float64, v.dtype)) for k, v in acc.items()])
            for p, acc in sums.sums.items()]
    merged: dict[str, dict] = {}
    for per_process in gather_object([mine]):
        for p, keys in per_process:
            for k, meta in keys:
                merged.setdefault(p, {})[k] = meta
    return [(p, sorted(merged[p].items())) for p in sorted(merged)]


class Algorithm:
    """Base class = FedAvg semantics (with the FedOpt server optimizer); methods override only what differs."""

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

    @property
    def sim(self) -> MethodContext:
        """Older name of :attr:`ctx` (plug-ins written before the context existed)."""
        return self.ctx

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
        round's total weight, so ``reduce`` reads weighted means)."""
        sums.add(MODEL, update.upload[MODEL], coef)

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
        epochs = self.ctx.args.new_client_epochs
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


def server_optimizer_step(server_state: Parts, mean: TensorDict, hp: ServerHParams, round_idx: int,
                          param_keys=None) -> Parts:
    """FedOpt's server step on the model part's parameters (see :class:`ServerHParams`); the momentum buffer is the
    server state's part ``"server_opt"``. Buffers (BatchNorm statistics, counters) and integer tensors take the mean:
    a pseudo-gradient step with momentum on a running variance can make it negative. server_lr = 1 and
    momentum = 0 return the mean itself (FedAvg, bit for bit; after a momentum round, up to rounding, the buffer kept)."""
    fedavg = hp.server_lr == 1.0 and hp.server_momentum == 0.0 and hp.server_lr_decay == 1.0
    if fedavg and "server_opt" not in server_state:
        return {**server_state, MODEL: {**server_state[MODEL], **mean}}
    lr = hp.server_lr * hp.server_lr_decay ** (round_idx - 1)
    x, new, buf = server_state[MODEL], dict(server_state[MODEL]), dict(server_state.get("server_opt", {}))
    for k, m in mean.items():
        if not torch.is_floating_point(m) or (param_keys is not None and k not in param_keys):
            new[k] = m
            continue
        d = x[k].double() - m.double()                      # pseudo-gradient
        if hp.server_momentum and k in buf:
            d = hp.server_momentum * buf[k].double() + d
        if hp.server_momentum or k in buf:  # m_t = beta_t m_{t-1} + d_t every round, beta_t = 0 included: a tuner
            buf[k] = d.to(x[k].dtype)       # that sets momentum to 0 and back must not reuse an older m
        new[k] = (x[k].double() - lr * d).to(x[k].dtype)
    out = {**server_state, MODEL: new}
    if buf:
        out["server_opt"] = buf
    return out


def weighted_average(states: list[TensorDict], weights: list[float]) -> TensorDict:
    """FedAvg's weighted mean of same-keyed tensor dicts. Integer buffers take the max (e.g. BN step counters)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("aggregation weights sum to zero (every sampled client has no data)")
    sums = WeightedSums(denominator=total)
    for s, w in zip(states, weights):
        sums.add("x", s, w)
    return sums.get("x", states[0])


REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    REGISTRY[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    if name not in REGISTRY:
        import importlib
        # plug-in discovery: the built-in methods register on import (those that build transformers models on first use)
        importlib.import_module("hfpfl.algorithms").load_builtin_methods(name)
    try:
        return REGISTRY[name]
    except KeyError:
        import difflib
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown method {name!r}.{hint} Available methods: {', '.join(sorted(REGISTRY))}") from None

