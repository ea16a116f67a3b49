"""The simulation engine: one model instance per process, client states swapped in and out, methods as plug-ins.

``Simulation(run_args, data_args).run()`` runs a whole experiment; ``step()`` runs one round (a driver such as FedPop
interleaves several simulations and may give each round its own per-client and server hyperparameters);
``state_dict()`` / ``load_state_dict()`` hold everything needed to continue bit for bit.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm

from .. import tracking
from ..runtime import configure_determinism
from ..training import TensorData
from . import checkpoint as ckpt
from .aggregation import WeightedSums, all_finite
from .comm import CommLedger, bytes_by_part, flatten_parts, num_elements, tensor_bytes, unflatten_parts
from .context import HParams, MethodContext, NonFiniteError, ServerHParams, step_size_hint
from .distributed import Ownership, all_gather, barrier, broadcast_from_main, evaluate_sharded, gather_to_main
from .protocol import Algorithm, Update
from .registry import get_algorithm
from .state import FROZEN, GLOBAL, MODEL, PRIVATE, ClientStateStore, snapshot

logger = logging.getLogger("hfpfl")

# run settings that do not change what a run computes (they may differ on resume)
_NOT_FINGERPRINTED = {"output_dir", "overwrite_output_dir", "resume_from_checkpoint", "num_rounds", "progress",
                      "report_to", "num_threads", "num_processes", "checkpoint_every", "keep_checkpoints",
                      "eval_clients", "vectorize", "vector_chunk_mb", "channels_last", "data_cache_mb", "max_state_mb"}


class Simulation:
    """Runs one federated experiment. ``Simulation(run_args, data_args).run()`` -> results dict.

    ``fed_data`` may be passed in (already built) to share it between simulations (FedPop, benchmarks).
    ``keep_uploads=True`` keeps the last round's uploads in ``last_updates`` (tests, debugging); by default uploads
    are folded into running sums as they arrive and dropped (O(model) memory for any number of clients).
    ``recipe_settings`` are a recipe's own options that shape ``fed_data`` (e.g. FedPCE's ``--levels``): they join
    the resume fingerprint, so a checkpoint is never continued on differently built data.
    """

    def __init__(self, run_args, data_args=None, method_config=None, *, fed_data=None,
                 accelerator: Accelerator | None = None, keep_uploads: bool = False, recipe_settings: dict | None = None):
        if not run_args.output_dir:  # default: outputs/<method>-<timestamp>, the same on every process
            from ..runtime import resolve_output_dir
            run_args = dataclasses.replace(run_args, output_dir=resolve_output_dir(None, run_args.method))
        self.args = run_args
        self.data_args = data_args
        self.keep_uploads = keep_uploads
        self.recipe_settings = dict(recipe_settings or {})
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
        from ..config import check_run_against_data
        check_run_against_data(run_args, fed_data)
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
        self.keys_by_role = self._assign_roles()
        self.initial_private = snapshot(self.model_state, self.keys_by_role[PRIVATE])
        self._frozen_buffers = self._frozen_buffer_keys()
        self._frozen_reference = snapshot(self.model_state, self._frozen_buffers)
        cap = getattr(run_args, "max_state_mb", 0)
        self.store = ClientStateStore(max_bytes=int(cap * 2**20) if cap else None,
                                      spill_dir=self.output_dir / "client_states" /
                                      f"rank{self.accelerator.process_index}")
        self.ledger = CommLedger()
        self.history: list[dict] = []
        self._history_written = 0  # rounds of history in metrics.jsonl (0: rewrite it whole, as after a resume)
        # the data cache, keyed by the split object: clients that share a split (the same Dataset) share one
        # converted copy; each entry keeps its split alive so its id cannot be reused while the entry exists
        self._tensors: OrderedDict[int, tuple[object, TensorData]] = OrderedDict()  # least recently used first
        self._tensor_bytes = 0
        self._load_memo: dict | None = None   # set while evaluating: skips re-loading unchanged tensors
        self._elapsed_before = 0.0
        self.round = 0                        # the last completed round
        self.server_state: dict | None = None
        self.final_eval: dict | None = None
        self._client_hp_overrides: dict = {}
        self._caches: dict[str, dict] = {}   # per-run caches of methods (ctx.cache) and of the vectorized path
        self._stacked_data: dict = {}        # the vectorized path's stacked client splits (vectorized.stacked_data)
        self._grad_layouts: dict | None = None   # each gradient's memory order, once probed (vectorized.grad_layouts)
        self._server_hp = ServerHParams.from_args(run_args)
        self.last_updates: list[Update] = []

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
        from ..config import warn_random_backbone
        from ..models import build_run_model
        from ..runtime import preserved_rng
        warn_random_backbone(self.args)
        self.default_model_built = True  # the run header names --model only when the model came from it
        with preserved_rng():  # pretraining a stand-in on first use must not shift this run's random streams
            self._default_model = build_run_model(
                self.args.model, self.args.adapter, num_labels=self.data.num_labels, image_size=self.data.image_size,
                num_channels=self.data.num_channels, lora_r=self.args.lora_r)
        return self._default_model

    def _assign_roles(self) -> dict[str, list[str]]:
        """Default roles: trainable params -> global, frozen params -> frozen; a buffer follows its module
        (buffers of frozen modules, e.g. BN statistics of a frozen backbone, drift locally: private)."""
        params = dict(self.model.named_parameters())
        modules = dict(self.model.named_modules())
        roles = {GLOBAL: [], PRIVATE: [], FROZEN: []}
        for key in self.model_state:
            if key in params:
                default = GLOBAL if params[key].requires_grad else FROZEN
            else:
                module = modules.get(key.rsplit(".", 1)[0] if "." in key else "")
                own = list(module.parameters(recurse=False)) if module is not None else []
                if not own:
                    default = FROZEN
                else:
                    default = GLOBAL if any(p.requires_grad for p in own) else PRIVATE
            role = self.algorithm.key_role(key, default)
            if role not in roles:
                raise ValueError(f"{type(self.algorithm).__name__}.key_role returned {role!r} for {key!r}")
            roles[role].append(key)
        for key in roles[FROZEN]:
            if key in params:
                params[key].requires_grad_(False)
        return roles

    def _frozen_buffer_keys(self) -> list[str]:
        """Frozen keys that training could still change (floating buffers such as BN running statistics)."""
        params = dict(self.model.named_parameters())
        return [k for k in self.keys_by_role[FROZEN] if k not in params and torch.is_floating_point(self.model_state[k])]

    def _check_frozen(self, where: str) -> None:
        for k in self._frozen_buffers:
            if not torch.equal(self.model_state[k].cpu(), self._frozen_reference[k]):
                raise ValueError(f"{where}: {k!r} has role 'frozen' but changed during training (statistics that "
                                 f"change are state): {type(self.algorithm).__name__}.key_role must make it 'private' "
                                 "or 'global', or keep its module in eval mode")

    # ------------------------------------------------------------------ data, seeds, hyperparameters
    def _tensor_data(self, ds) -> TensorData:
        """A split's tensors, cached (images as uint8) under an LRU cap of ``--data_cache_mb``, once per split
        object: ``TensorData.from_dataset`` depends on the split alone, so clients built on the same Dataset (10,000
        clients over 1,000 distinct splits) read one copy instead of one each (scripts/bench_scale_memory.py)."""
        hit = self._tensors.get(id(ds))
        if hit is not None:
            self._tensors.move_to_end(id(ds))
            return hit[1]
        t = TensorData.from_dataset(ds)
        self._tensors[id(ds)] = (ds, t)
        self._tensor_bytes += t.nbytes()
        cap = getattr(self.args, "data_cache_mb", 0) * 2**20
        while cap and self._tensor_bytes > cap and len(self._tensors) > 1:
            _, (_, old) = self._tensors.popitem(last=False)
            self._tensor_bytes -= old.nbytes()
        return t

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
        ss = np.random.SeedSequence([self.args.seed, round_idx, client_id + 1, zlib.crc32(tag.encode())])
        return int(ss.generate_state(1)[0])

    def seeds_for(self, round_idx: int, client_ids, tag: str = "") -> list[int]:
        """``[seed_for(round_idx, c, tag) for c in client_ids]``, computed for all clients at once (numpy's
        SeedSequence hash written out on arrays: ~1 us per client instead of ~40 us)."""
        ids = [int(c) for c in client_ids]
        words = [self.args.seed, round_idx, zlib.crc32(tag.encode())]
        if not ids or not all(0 <= w < 2**32 for w in words) or min(ids) < -1 or max(ids) + 1 >= 2**32:
            return [self.seed_for(round_idx, c, tag) for c in ids]  # other word counts: numpy's own path
        entropy = np.empty((len(ids), 4), dtype=np.uint32)
        entropy[:, 0], entropy[:, 1], entropy[:, 3] = words[0], words[1], words[2]
        entropy[:, 2] = np.asarray(ids, dtype=np.int64) + 1
        return _seed_sequence_words(entropy).tolist()

    def generator(self, round_idx: int, client_id: int, tag: str = "") -> torch.Generator:
        return torch.Generator().manual_seed(self.seed_for(round_idx, client_id, tag))

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        return self.ctx.make_optimizer(params)

    def client_hparams(self, client_id: int) -> HParams:
        """This client's hyperparameters in the current round: run arguments < step(client_hparams=...) < method."""
        hp = HParams.from_args(self.args)
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
    def _client_updates(self, cids: list[int], round_idx: int, server_state: dict):
        """The sampled clients' updates, in order: vectorized in chunks where that applies (``--vectorize``),
        else one client after another."""
        for ups, _ in self._client_update_batches(cids, round_idx, server_state):
            yield from ups

    def _client_update_batches(self, cids: list[int], round_idx: int, server_state: dict, stacked: bool = False):
        """``(updates, stacked uploads or None)`` per vectorized chunk (or per client on the sequential path).
        ``stacked=True``: a vectorized chunk's updates come without per-client uploads, and its uploads as stacked
        tensors (:class:`~hfpfl.federated.vectorized.ChunkUpdates`) for the caller to fold in one call."""
        from . import vectorized
        if len(cids) > 1 and not getattr(self, "_vector_failed", False) and vectorized.should_vectorize(self, cids):
            algo = self.algorithm
            for chunk in vectorized.chunks_of(self, cids):
                downs, privs = vectorized.downloads(algo, server_state, chunk), {}
                for cid in chunk:
                    privs[cid] = self.store.get(cid)
                    if privs[cid] is None:  # a client without a stored state starts from the method's initial one
                        privs[cid] = algo.init_private_state(cid)
                try:
                    ups = vectorized.train_chunk(self, chunk, downs, privs, round_idx, uploads=not stacked)
                except Exception as e:  # noqa: BLE001 - an op vmap cannot batch: the sequential path is exact
                    logger.warning("vectorized training failed (%s: %s); training clients one by one",
                                   type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                    self._vector_failed = True
                    for cid in chunk:
                        yield [self._client_work(cid, round_idx, server_state)], None
                    continue
                if len(cids) >= vectorized.PIN_MMAP_CLIENTS:
                    vectorized.release_freed_heap()  # many chunks: keep freed temporaries from piling up in the heap
                self.seed_torch(self.seed_for(round_idx, chunk[-1], "client"))  # the RNG as the sequential path leaves it
                yield self._finish_chunk(ups, downs, round_idx), (ups.stacked if stacked else None)
            return
        for cid in cids:
            yield [self._client_work(cid, round_idx, server_state)], None

    def _finish_chunk(self, ups, downs: dict, round_idx: int) -> list[Update]:
        """:meth:`_finish_update` for a vectorized chunk: the frozen check once (the model does not change between
        its clients), bytes down counted once per download structure, bytes up from the chunk."""
        self._check_frozen(f"round {round_idx}, clients {ups[0].client_id}-{ups[-1].client_id}")
        down_bytes: dict = {}
        from .vectorized import same_download_for_all
        same_download = same_download_for_all(downs)
        for i, upd in enumerate(ups):
            cid = upd.client_id
            down = downs[cid]
            if not upd.finite:  # the chunk's check found a non-finite value: say where, as the sequential path does
                rows = upd.upload or {p: {k: v[i] for k, v in d.items()} for p, d in ups.stacked.items()}
                self._check_finite(Update(cid, rows, upd.num_samples, metrics=upd.metrics), round_idx)
            self.store.put(cid, upd.private)
            upd.private = None  # private state never leaves the client
            if upd.upload:
                upd.upload = {p: {k: v.detach().cpu() for k, v in d.items()} for p, d in upd.upload.items()}
            key = None if same_download else cid  # the default download: the same tensors for every client
            if key not in down_bytes:
                down_bytes[key] = (tensor_bytes(down), bytes_by_part(down))
            upd.metrics["bytes_down"], parts_down = down_bytes[key]
            # one dict per chunk, read-only (the ledger sums them): no two dicts per client held until the round ends
            upd.metrics["parts_down"], upd.metrics["parts_up"] = parts_down, ups.parts_up
        return list(ups)

    def _client_work(self, cid: int, round_idx: int, server_state: dict) -> Update:
        """One client's round: download, swap its private state in, local update, swap it out, checks."""
        algo = self.algorithm
        down = algo.download(server_state, cid)
        private = self.store.get(cid)
        if private is None:
            private = algo.init_private_state(cid)
        # the engine, not the method, swaps the client's private model keys in: nothing leaks between clients
        self.ctx.load(private.get(MODEL) or self.initial_private)
        self.seed_torch(self.seed_for(round_idx, cid, "client"))
        upd = algo.client_update(cid, down, private, round_idx)
        return self._finish_update(upd, down, round_idx)

    def _finish_update(self, upd: Update, down: dict, round_idx: int) -> Update:
        """Checks, the private state into the store, the upload to the CPU, bytes counted."""
        cid = upd.client_id
        if upd.private is None:
            upd.private = {}
        if self.keys_by_role[PRIVATE] and MODEL not in upd.private:
            upd.private[MODEL] = snapshot(self.model_state, self.keys_by_role[PRIVATE])
        self._check_frozen(f"round {round_idx}, client {cid}")
        if not getattr(upd, "finite", False):  # vectorized chunks checked every client at once
            self._check_finite(upd, round_idx)
        self.store.put(cid, upd.private)
        upd.private = None  # private state never leaves the client
        upd.upload = {p: {k: v.detach().cpu() for k, v in d.items()} for p, d in upd.upload.items()}
        upd.metrics["bytes_down"] = tensor_bytes(down)
        upd.metrics["parts_down"], upd.metrics["parts_up"] = bytes_by_part(down), bytes_by_part(upd.upload)
        return upd

    def _check_finite(self, upd: Update, round_idx: int) -> None:
        if self.algorithm.on_non_finite != "error":
            return
        loss = upd.metrics.get("train_loss")
        # one summing pass per tensor, no boolean copy of the upload (all_finite)
        bad = [f"{p}/{k}" for p, d in upd.upload.items() for k, v in d.items()
               if torch.is_floating_point(v) and not all_finite(v)]
        if bad or (loss is not None and not np.isfinite(loss)):
            what = f"upload {bad[0]!r}" if bad else f"train loss {loss}"
            hint = step_size_hint(self.args, self.algorithm.config, lr=self.client_hparams(upd.client_id).lr)
            raise NonFiniteError(f"training diverged in round {round_idx} on client {upd.client_id}: non-finite "
                                 f"{what}; {hint}; or check the data")

    def run_round(self, round_idx: int, server_state: dict) -> tuple[dict, dict]:
        algo, acc = self.algorithm, self.accelerator
        sampled = self.sample_clients(round_idx)
        gather = algo.aggregation == "gather"
        receives = algo.aggregation != "mean"   # a "mean" method's uploads only enter the weighted mean
        kept: list[Update] = []
        if gather:
            for upd in self._client_updates(self.ownership.owned(sampled), round_idx, server_state):
                if receives:  # per-upload server work where the upload is: spread over the processes
                    algo.receive(upd, round_idx)
                kept.append(upd)
            everything = gather_to_main(kept, acc)
            if acc.is_main_process:  # server work once, then every process gets the result
                everything = sorted(everything, key=lambda u: u.client_id)
                new_state = algo.aggregate(server_state, everything, round_idx)
                meta = [(u.client_id, u.num_samples, u.metrics) for u in everything]
            else:
                new_state, meta = None, None
            new_state, meta = broadcast_from_main((new_state, meta), acc)
            kept = everything if acc.is_main_process else []
        else:
            weights = algo.aggregation_weights(sampled)
            total = float(sum(weights.values()))
            if total <= 0:
                raise ValueError("aggregation weights sum to zero (every sampled client has no data)")
            sums = WeightedSums(denominator=total)  # raw weights in, one division out: see WeightedSums
            meta = []
            # the default accumulate (weighted mean of the model part: FedAvg, FedProx, FedBN, ...) folds a whole
            # vectorized chunk's stacked uploads in one call instead of one call per client
            fold_chunks = not self.keep_uploads and algo.aggregation == "mean"
            for ups, stacked in self._client_update_batches(self.ownership.owned(sampled), round_idx, server_state,
                                                            stacked=fold_chunks):
                if stacked is not None:
                    sums.add_stacked(MODEL, stacked[MODEL], [weights[u.client_id] for u in ups])
                    sums.count += len(ups)
                for upd in ups:
                    cid = upd.client_id
                    if receives:
                        algo.receive(upd, round_idx)
                    if stacked is None:
                        algo.accumulate(sums, upd, weights[cid])
                        sums.count += 1
                    meta.append((cid, upd.num_samples, upd.metrics))
                    if self.keep_uploads:
                        kept.append(upd)
            sums.all_reduce(acc)
            new_state = algo.reduce(server_state, sums, round_idx)
            meta = sorted(all_gather(meta, acc), key=lambda m: m[0])
        self._check_finite_state(new_state, round_idx)
        for cid, _, m in meta:
            self.ledger.record(round_idx, cid, m["bytes_down"], sum(m["parts_up"].values()), m["parts_down"],
                               m["parts_up"])
        self.last_updates = sorted(kept, key=lambda u: u.client_id) if self.keep_uploads else []
        total_n = sum(n for _, n, _ in meta) or 1
        metrics = {"round": round_idx, "clients": [cid for cid, _, _ in meta]}
        if meta and "train_loss" in meta[0][2]:
            metrics["train_loss"] = sum(m["train_loss"] * n for _, n, m in meta) / total_n
        metrics["bytes_down"], metrics["bytes_up"] = self.ledger.round_totals(round_idx)
        # the training budget: summed only when every client's update reports it (a method with its own loop may not)
        for key, name in (("steps", "optimizer_steps"), ("examples", "examples_seen")):
            if meta and all(key in m for _, _, m in meta):
                metrics[name] = int(sum(m[key] for _, _, m in meta))
        server = algo.server_training
        if server:  # the server trained the model this method evaluates (one-shot: FedBiP's classifier, Central)
            metrics["server_optimizer_steps"], metrics["server_examples_seen"] = int(server["steps"]), \
                int(server["examples"])
            algo.server_training = None
        return new_state, metrics

    def _check_finite_state(self, state: dict, round_idx: int) -> None:
        for p, d in state.items():
            for k, v in d.items():
                if torch.is_floating_point(v) and not all_finite(v):
                    raise NonFiniteError(f"training diverged in round {round_idx}: the server state {p}/{k!r} is "
                                         f"non-finite after aggregation; "
                                         f"{step_size_hint(self.args, self.algorithm.config, server=True)}")

    # ------------------------------------------------------------------ evaluation
    def _eval(self, model, data, where: str = "", shared: bool = False) -> dict:
        """Score ``model`` on ``data``; ``shared``: every process calls this with the same model and data (the global
        model on the global test set), which then scores its own share of the batches (the same numbers)."""
        if shared:
            res = evaluate_sharded(lambda d, m: self.ctx.evaluate(model, d, m), data, self.ctx.metric(),
                                   self.args.eval_batch_size, self.accelerator)
        else:
            res = self.ctx.evaluate(model, data)
        if "loss" in res and not np.isfinite(res["loss"]):  # finite weights can still overflow the logits
            raise NonFiniteError(f"training diverged by round {self.round}: {where} has a non-finite evaluation loss; "
                                 f"{step_size_hint(self.args, self.algorithm.config, server=True)}")
        return res

    def eval_client_ids(self, round_idx: int, final: bool = False) -> list[int]:
        """The clients scored at this evaluation: all at the final one, else ``--eval_clients`` of them (drawn from
        the seed and the round, the same on every process)."""
        n, k = self.num_clients, getattr(self.args, "eval_clients", None)
        if final or k is None:
            return list(range(n))
        m = min(n, max(1, int(round(k * n))) if k < 1 else int(k))
        if m >= n:
            return list(range(n))
        rng = np.random.default_rng([self.args.seed, round_idx, 7])
        return sorted(int(c) for c in rng.choice(n, size=m, replace=False))

    def evaluate(self, round_idx: int, server_state: dict, final: bool = False) -> dict:
        algo, acc = self.algorithm, self.accelerator
        out: dict = {}
        self.ctx.load(self.initial_private)  # the global model never carries a client's private statistics
        model = algo.load_global(server_state)
        if model is not None:
            out["global_accuracy"] = self._eval(model, self.global_test_data(), "the global model",
                                                shared=True)["accuracy"]
        rows = []
        ids = self.ownership.owned(self.eval_client_ids(round_idx, final))
        from . import vectorized
        if len(ids) > 1 and not getattr(self, "_vector_failed", False) and vectorized.can_vectorize_eval(self, ids):
            try:
                rows = vectorized.evaluate_clients(self, ids, server_state, round_idx)
                self.seed_torch(self.seed_for(round_idx, ids[-1], "eval"))  # the RNG as the loop leaves it
                ids = []
            except NonFiniteError:
                raise
            except Exception as e:  # noqa: BLE001 - an op vmap cannot batch: evaluate one by one
                logger.warning("vectorized evaluation failed (%s: %s); evaluating clients one by one",
                               type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self._vector_failed = True
                rows = []
        self._load_memo = {}  # the same global tensors are loaded for every client: copy them once
        try:
            for cid in ids:
                self.seed_torch(self.seed_for(round_idx, cid, "eval"))
                private = self.store.get(cid)
                self.ctx.load((private or {}).get(MODEL) or self.initial_private)
                model = algo.load_personal(cid, server_state, private, round_idx)
                res = self._eval(model, self.test_data(cid), f"client {cid}'s model")
                rows.append((cid, res["accuracy"], res["num_samples"]))
        finally:
            self._load_memo = None
        rows = sorted(all_gather(rows, acc))
        if rows:
            out["personal_accuracy"] = float(np.mean([r[1] for r in rows]))  # mean per-client accuracy
            out["personal_accuracy_weighted"] = sum(r[1] * r[2] for r in rows) / max(1, sum(r[2] for r in rows))
            out["per_client"] = {str(c): a for c, a, _ in rows}
        out.update(algo.extra_metrics(round_idx, server_state))
        if final and self.data.new_clients:
            new_rows = []
            for cid in self.ownership.owned(range(self.num_clients, self.num_clients + len(self.data.new_clients))):
                self.seed_torch(self.seed_for(round_idx, cid, "new-client"))
                self.ctx.load(self.initial_private)
                model = algo.personalize_new_client(cid, server_state, self.train_data(cid), round_idx)
                new_rows.append((cid, self._eval(model, self.test_data(cid))["accuracy"]))
            new_rows = sorted(all_gather(new_rows, acc))
            out["new_client_accuracy"] = float(np.mean([a for _, a in new_rows]))
            out["new_clients"] = {str(c): a for c, a in new_rows}
        return out

    # ------------------------------------------------------------------ whole state (FedPop, checkpoints)
    def state_dict(self) -> dict:
        """Everything needed to continue this simulation bit for bit (this process's clients): server state,
        client store (private parts, optimizer states), ledger, history, round, the method's own state, RNG."""
        return {"round": self.round, "server_state": {p: dict(d) for p, d in (self.server_state or {}).items()},
                "store": self.store.flatten(), "ledger": self.ledger.to_json(), "history": list(self.history),
                "algorithm": self.algorithm.state_dict(), "torch_rng": torch.get_rng_state(),
                "server_hparams": dataclasses.asdict(self._server_hp), "elapsed": self._elapsed()}

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
        self._history_written = 0
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
        fp = {"run": run, "data": plain(self.data_args), "method": plain(self.algorithm.config),
              "num_clients": self.num_clients}
        if self.recipe_settings:  # only when given, so checkpoints written without them still match
            fp["recipe"] = self.recipe_settings
        return fp

    def save_checkpoint(self, round_idx: int, server_state: dict, elapsed: float) -> None:
        acc = self.accelerator
        tmp = ckpt.tmp_dir(self.output_dir, round_idx)
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(acc)
        ckpt.save_tensors(self.store.flatten(), tmp / f"clients-rank{acc.process_index}.safetensors")
        if acc.is_main_process:
            ckpt.save_tensors(flatten_parts(server_state), tmp / "server.safetensors")
        barrier(acc)
        if acc.is_main_process:
            ckpt.finalize(self.output_dir, round_idx, {
                "round": round_idx, "fingerprint": self.fingerprint(), "history": self.history,
                "ledger": self.ledger.to_json(), "elapsed": elapsed, "algorithm": self.algorithm.state_dict(),
                "server_hparams": dataclasses.asdict(self._server_hp)}, keep=self.args.keep_checkpoints)
        barrier(acc)

    def load_checkpoint(self, spec: str) -> None:
        path = ckpt.resolve(self.output_dir, spec)
        state = ckpt.read_state(path)
        mine, theirs = self.fingerprint(), state.get("fingerprint", {})
        diff = _diff(theirs, mine)
        if diff:
            detail = "; ".join(f"{k}: checkpoint={a!r} now={b!r}" for k, (a, b) in list(diff.items())[:6])
            raise ValueError(f"--resume_from_checkpoint: checkpoint {str(path)!r} was written with other settings "
                             f"({detail}); resume with the same settings (only --num_rounds may grow), or start a new "
                             "run with another --output_dir")
        if int(state["round"]) > self.args.num_rounds:
            raise ValueError(f"--num_rounds {self.args.num_rounds} is smaller than the checkpoint's round "
                             f"{state['round']}; resume with --num_rounds >= {state['round']}")
        flat = {}
        for f in sorted(path.glob("clients-rank*.safetensors")):  # any world size wrote them: keep the clients we own
            flat.update({k: v for k, v in ckpt.load_tensors(f).items()
                         if self.ownership.owns(int(k.split("::", 1)[0]))})
        self.load_state_dict({"round": state["round"], "server_state": unflatten_parts(
            ckpt.load_tensors(path / "server.safetensors")), "store": flat, "ledger": state["ledger"],
            "history": state["history"], "algorithm": state.get("algorithm", {}), "elapsed": state.get("elapsed", 0.0),
            "server_hparams": state.get("server_hparams", dataclasses.asdict(self._server_hp))})

    # ------------------------------------------------------------------ the run
    def parameter_counts(self) -> dict:
        params = dict(self.model.named_parameters())
        trainable = sum(p.numel() for p in params.values() if p.requires_grad)
        comm = {k: self.model_state[k] for k in self.keys_by_role[GLOBAL]}
        return {"total": sum(p.numel() for p in params.values()), "trainable": trainable,
                "global_state_elements": num_elements(comm), "private_state_elements":
                    num_elements({k: self.model_state[k] for k in self.keys_by_role[PRIVATE]})}

    def _elapsed(self) -> float:
        return self._elapsed_before + time.perf_counter() - getattr(self, "_start", time.perf_counter())

    def setup(self) -> None:
        """Initial server state, or the state of ``--resume_from_checkpoint``; config written. Idempotent."""
        if self.server_state is not None:
            return
        acc, args = self.accelerator, self.args
        self._start = time.perf_counter()
        resumed_rounds = None
        if args.resume_from_checkpoint:
            self.load_checkpoint(args.resume_from_checkpoint)
            logger.info("resumed from round %d", self.round)
            resumed_rounds = self.history and max(h["round"] for h in self.history)
        else:
            self.server_state = self.algorithm.init_server_state()
        # a resumed run keeps its config.yaml; only an extended --num_rounds is recorded
        if acc.is_main_process and (not args.resume_from_checkpoint or not (self.output_dir / "config.yaml").exists()
                                    or (resumed_rounds is not None and args.num_rounds != _saved_rounds(self.output_dir))):
            recipe = {"recipe": self.recipe_settings} if self.recipe_settings else {}  # a recipe's own options
            tracking.write_config(self.output_dir, run=args, data=self.data_args, method=self.algorithm.config,
                                  **recipe)
        tracking.log_run_header(self)
        if acc.log_with:
            acc.init_trackers("hfpfl", config={k: v for k, v in dataclasses.asdict(args).items()
                                                if isinstance(v, (int, float, str, bool))})

    def step(self, client_hparams=None, server_hparams: dict | None = None) -> dict:
        """Run the next round (with evaluation and checkpoint as configured); returns its metrics.

        ``client_hparams``: ``{client_id: {"lr": ..., "local_epochs": ...}}`` or a function of the client id
        (FedPop-L gives every active client its own vector); ``server_hparams``: ``{"server_lr": ...,
        "server_momentum": ...}`` from this round on."""
        self.setup()
        acc, args = self.accelerator, self.args
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
        tracking.log_round(self, metrics, time.perf_counter() - round_start)
        if acc.log_with:
            acc.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=r)
        if args.checkpoint_every and (r % args.checkpoint_every == 0 or last):
            self.save_checkpoint(r, self.server_state, self._elapsed())
        if acc.is_main_process:
            self._history_written = tracking.write_history(self.output_dir, self.history, self._history_written)
        return metrics

    def run(self) -> dict:
        self.setup()
        acc, args = self.accelerator, self.args
        bar = tqdm(range(self.round + 1, args.num_rounds + 1), desc=f"{args.method} rounds", initial=self.round,
                   total=args.num_rounds, disable=not (tracking.show_progress_bars(args.progress) and acc.is_local_main_process))
        for _ in bar:
            metrics = self.step()
            bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items() if k.endswith("accuracy") and isinstance(v, float)})
        return self.finish()

    def finish(self) -> dict:
        """Final evaluation (if the last round did not have one), results.json and plots."""
        acc = self.accelerator
        if self.final_eval is None:  # resumed a finished run, or stepped externally: evaluate the final state
            self.final_eval = self.evaluate(self.round, self.server_state, final=True)
        results = self._results(self.final_eval, self._elapsed())
        if acc.is_main_process:
            tracking.write_results(self.output_dir, results)
            tracking.plot_run(self, self.final_eval)
        if acc.log_with:
            acc.end_training()
        return results

    def _dataset_name(self) -> str:
        return getattr(self.data_args, "dataset", "custom") if self.data_args is not None else "custom"

    def _results(self, final_eval: dict, wall: float) -> dict:
        a = self.args
        per_client = final_eval.get("per_client", {})
        per_domain: dict[str, list[float]] = {}
        for cid, accv in per_client.items():
            dom = self.data.clients[int(cid)].domain
            if dom is not None:
                per_domain.setdefault(str(dom), []).append(accv)
        return {
            "method": a.method, "model": a.model, "adapter": a.adapter, "dataset": self._dataset_name(),
            "partition": getattr(self.data_args, "partition", None), "num_clients": self.num_clients,
            "num_rounds": self.round, "seed": a.seed, "world_size": self.accelerator.num_processes,
            "process_train_examples": self.process_train_examples(),
            "final": {k: v for k, v in final_eval.items() if not isinstance(v, dict)},
            "per_client_accuracy": per_client,
            "per_domain_accuracy": {d: float(np.mean(v)) for d, v in sorted(per_domain.items())},
            "new_client_accuracy": final_eval.get("new_clients", {}),
            "communication": self.ledger.totals(),
            "parameters": self.parameter_counts(),
            "budget": self.budget(),
            "wall_time_s": wall,
        }

    def budget(self) -> dict:
        """Client training spent so far, from the round history (so a resumed run counts every round):
        optimizer steps and examples seen in total and per trained model (each client that trained keeps or uploads
        its own model, so the per-model figure is the total over the clients that trained at least once). None where
        a round's updates did not report them."""
        trained = {int(c) for h in self.history for c in h.get("clients", [])}
        out: dict = {"trained_models": len(trained)}
        for name in ("optimizer_steps", "examples_seen"):
            known = all(name in h for h in self.history)
            total = int(sum(h[name] for h in self.history)) if known else None
            out[name] = total
            out[f"{name}_per_model"] = (total / len(trained) if trained else 0.0) if known else None
        if any("server_optimizer_steps" in h for h in self.history):
            # one model, trained on the server, is what this run evaluates: its steps are the budget to match (what
            # the clients trained for it, e.g. FedBiP's concepts, stays as client_*)
            out["trained_models"] = 1
            for name in ("optimizer_steps", "examples_seen"):
                out[f"client_{name}"] = out[name]
                out[name] = out[f"{name}_per_model"] = int(sum(h.get(f"server_{name}", 0) for h in self.history))
        return out


# numpy's SeedSequence (numpy/random/bit_generator.pyx: pool size 4, uint32 words), for many entropy rows at once
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43b0d7e5, 0x931e8875, 0x8b51f9dd, 0x58f38ded
_MIX_MULT_L, _MIX_MULT_R, _MASK32 = 0xca01f9dd, 0x4973f715, 0xFFFFFFFF


def _seed_sequence_words(entropy: np.ndarray) -> np.ndarray:
    """``SeedSequence(list(row)).generate_state(1)[0]`` for every row of a ``[n, 4]`` uint32 array of entropy
    words (four words each: exactly the pool, so no extra mixing rounds). Tested against numpy."""
    u32 = np.uint32
    hash_const = _INIT_A

    def hashmix(value):
        nonlocal hash_const
        value = value ^ u32(hash_const)
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = value * u32(hash_const)
        return value ^ (value >> u32(16))

    def mix(x, y):
        r = u32(_MIX_MULT_L) * x - u32(_MIX_MULT_R) * y
        return r ^ (r >> u32(16))

    with np.errstate(over="ignore"):
        pool = [hashmix(entropy[:, i].astype(u32)) for i in range(4)]
        for src in range(4):
            for dst in range(4):
                if src != dst:
                    pool[dst] = mix(pool[dst], hashmix(pool[src]))
        hb = _INIT_B
        v = pool[0] ^ u32(hb)
        hb = (hb * _MULT_B) & _MASK32
        v = v * u32(hb)
        return v ^ (v >> u32(16))


def _diff(old: dict, new: dict, prefix: str = "") -> dict:
    """Flattened keys whose values differ between two nested fingerprints."""
    out = {}
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(_diff(a, b, f"{prefix}{k}."))
        elif a != b and not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)):
            out[f"{prefix}{k}"] = (a, b)
    return out


def _saved_rounds(output_dir: Path):
    import yaml
    try:
        cfg = yaml.safe_load((output_dir / "config.yaml").read_text()) or {}
    except Exception:  # noqa: BLE001 - an unreadable config is rewritten
        return None
    return (cfg.get("run") or {}).get("num_rounds", cfg.get("num_rounds"))

