"""One round of a simulation: each sampled client's download, local update and upload (one by one, or many at once
on the vectorized path), then the server's aggregation -- streamed into running sums or gathered, as the method
declares (``Algorithm.aggregation``) -- with the checks every upload and the new server state pass."""
from __future__ import annotations

import logging

import numpy as np
import torch

from . import vectorized
from .aggregation import NonFiniteUpload, WeightedSums, all_finite, all_finite_each
from .comm import bytes_by_part, tensor_bytes
from .context import NonFiniteError, step_size_hint
from .distributed import all_gather, broadcast_from_main, gather_to_main
from .protocol import Algorithm, Update
from .state import MODEL, PRIVATE, snapshot

logger = logging.getLogger("hfpfl")


class RoundRunner:
    """Runs rounds for a :class:`~hfpfl.federated.engine.Simulation` (its model, client store, ownership, ledger)."""

    def __init__(self, sim):
        self.sim = sim
        # while a round streams its uploads into sums that check them as they fold them (the default accumulate of
        # a "mean" method): those sums; the uploads' model part is then not read a second time for NaN and infinities
        self.checking_sums: WeightedSums | None = None

    def client_updates(self, cids: list[int], round_idx: int, server_state: dict):
        """The sampled clients' updates, in order: vectorized in chunks where that applies (``--vectorize``),
        else one client after another."""
        for ups, _ in self.update_batches(cids, round_idx, server_state):
            yield from ups

    def update_batches(self, cids: list[int], round_idx: int, server_state: dict, stacked: bool = False):
        """``(updates, stacked uploads or None)`` per vectorized chunk (or per client on the sequential path).
        ``stacked=True``: a vectorized chunk's updates come without per-client uploads, and its uploads as stacked
        tensors (:class:`~hfpfl.federated.vectorized.ChunkUpdates`) for the caller to fold in one call. A callback
        that sees each client's upload (``needs_each_client``) keeps every client on the sequential path."""
        if len(cids) > 1 and not self.sim._vector_failed and not self.sim.each_client \
                and vectorized.should_vectorize(self.sim, cids):
            algo = self.sim.algorithm
            for chunk in vectorized.chunks_of(self.sim, cids):
                downs, privs = vectorized.downloads(algo, server_state, chunk), {}
                for cid in chunk:
                    privs[cid] = self.sim.store.get(cid)
                    if privs[cid] is None:  # a client without a stored state starts from the method's initial one
                        privs[cid] = algo.init_private_state(cid)
                try:
                    ups = vectorized.train_chunk(self.sim, chunk, downs, privs, round_idx, uploads=not stacked)
                except Exception as e:  # noqa: BLE001 - an op vmap cannot batch: the sequential path is exact
                    logger.warning("vectorized training failed (%s: %s); training clients one by one",
                                   type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                    self.sim._vector_failed = True
                    for cid in chunk:
                        yield [self.client_work(cid, round_idx, server_state)], None
                    continue
                if len(cids) >= vectorized.PIN_MMAP_CLIENTS:
                    vectorized.release_freed_heap()  # many chunks: keep freed temporaries from piling up in the heap
                # the RNG as the sequential path leaves it
                self.sim.seed_torch(self.sim.seed_for(round_idx, chunk[-1], "client"))
                yield self.finish_chunk(ups, downs, round_idx), (ups.stacked if stacked else None)
            return
        self.sim.prefetch_seeds(round_idx, cids, ("client", ""))  # client_work's and ctx.train's streams
        for cid in cids:
            yield [self.client_work(cid, round_idx, server_state)], None

    def finish_chunk(self, ups, downs: dict, round_idx: int) -> list[Update]:
        """:meth:`finish_update` for a vectorized chunk: the frozen check once (the model does not change between
        its clients), bytes down counted once per download structure, bytes up from the chunk."""
        self.sim.frozen.check(f"round {round_idx}, clients {ups[0].client_id}-{ups[-1].client_id}")
        down_bytes: dict = {}
        same_download = vectorized.same_download_for_all(downs)
        for i, upd in enumerate(ups):
            cid = upd.client_id
            down = downs[cid]
            if not upd.finite:  # the chunk's check found a non-finite value: say where, as the sequential path does
                rows = upd.upload or {p: {k: v[i] for k, v in d.items()} for p, d in ups.stacked.items()}
                self.check_finite(Update(cid, rows, upd.num_samples, metrics=upd.metrics), round_idx)
            self.sim.store.put(cid, upd.private)
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

    def client_work(self, cid: int, round_idx: int, server_state: dict) -> Update:
        """One client's round: download, swap its private state in, local update, swap it out, checks."""
        algo = self.sim.algorithm
        down = algo.download(server_state, cid)
        private = self.sim.store.get(cid)
        if private is None:
            private = algo.init_private_state(cid)
        # the engine, not the method, swaps the client's private model keys in: nothing leaks between clients
        self.sim.ctx.load(private.get(MODEL) or self.sim.initial_private)
        self.sim.seed_torch(self.sim.seed_for(round_idx, cid, "client"))
        upd = self.finish_update(algo.client_update(cid, down, private, round_idx), down, round_idx)
        for cb in self.sim.callbacks:
            if cb.needs_each_client:
                cb.after_client_update(self.sim, cid, upd)
        return upd

    def finish_update(self, upd: Update, down: dict, round_idx: int) -> Update:
        """Checks, the private state into the store, the upload to the CPU, bytes counted."""
        cid = upd.client_id
        if upd.private is None:
            upd.private = {}
        if self.sim.keys_by_role[PRIVATE] and MODEL not in upd.private:
            upd.private[MODEL] = snapshot(self.sim.model_state, self.sim.keys_by_role[PRIVATE])
        self.sim.frozen.check(f"round {round_idx}, client {cid}")
        if not getattr(upd, "finite", False):  # vectorized chunks checked every client at once
            self.check_finite(upd, round_idx, skip=(MODEL,) if self.checking_sums is not None else ())
        self.sim.store.put(cid, upd.private)
        upd.private = None  # private state never leaves the client
        upd.upload = {p: {k: v.detach().cpu() for k, v in d.items()} for p, d in upd.upload.items()}
        upd.metrics["bytes_down"] = tensor_bytes(down)
        upd.metrics["parts_down"], upd.metrics["parts_up"] = bytes_by_part(down), bytes_by_part(upd.upload)
        return upd

    def check_finite(self, upd: Update, round_idx: int, skip=()) -> None:
        """Raise :class:`NonFiniteError` where the client's training loss or a float tensor of its upload (but the
        parts in ``skip``) is NaN or infinite."""
        if self.sim.algorithm.on_non_finite != "error":
            return
        loss = upd.metrics.get("train_loss")
        # one summing pass per tensor, no boolean copy of the upload, one wait for the answer (all_finite_each)
        floats = [(f"{p}/{k}", v) for p, d in upd.upload.items() if p not in skip for k, v in d.items()
                  if torch.is_floating_point(v)]
        bad = [name for (name, _), ok in zip(floats, all_finite_each(v for _, v in floats)) if not ok]
        if bad or (loss is not None and not np.isfinite(loss)):
            if self.checking_sums is not None:  # an earlier client's held upload may have diverged first: named first
                self.checking_sums.fold_held()
            raise self.diverged(round_idx, upd.client_id, f"upload {bad[0]!r}" if bad else f"train loss {loss}")

    def diverged(self, round_idx: int, client_id, what: str) -> NonFiniteError:
        hint = step_size_hint(self.sim.args, self.sim.algorithm.config, lr=self.sim.client_hparams(client_id).lr)
        return NonFiniteError(f"training diverged in round {round_idx} on client {client_id}: non-finite {what}; "
                              f"{hint}; or check the data")

    def run(self, round_idx: int, server_state: dict) -> tuple[dict, dict]:
        algo, acc = self.sim.algorithm, self.sim.accelerator
        sampled = self.sim.sample_clients(round_idx)
        gather = algo.aggregation == "gather"
        receives = algo.aggregation != "mean"   # a "mean" method's uploads only enter the weighted mean
        kept: list[Update] = []
        if gather:
            for upd in self.client_updates(self.sim.ownership.owned(sampled), round_idx, server_state):
                if receives:  # per-upload server work where the upload is: spread over the processes
                    algo.receive(upd, round_idx)
                kept.append(upd)
            everything = gather_to_main(kept, acc)
            if acc.is_main_process:  # server work once, then every process gets the result
                everything = sorted(everything, key=lambda u: u.client_id)
                try:  # the default aggregate folds through accumulate, whose sums check what they fold
                    new_state = algo.aggregate(server_state, everything, round_idx)
                except NonFiniteUpload as e:
                    raise self.diverged(round_idx, e.source, "upload " + repr(f"{e.part}/{e.key}")) from None
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
            fold_chunks = not self.sim.keep_uploads and algo.aggregation == "mean"
            if algo.aggregation == "mean" and algo.on_non_finite == "error" and \
                    type(algo).accumulate is Algorithm.accumulate:
                self.checking_sums = sums
            try:
                for ups, stacked in self.update_batches(self.sim.ownership.owned(sampled), round_idx, server_state,
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
                        if self.sim.keep_uploads:
                            kept.append(upd)
                sums.all_reduce(acc)
                new_state = algo.reduce(server_state, sums, round_idx)
            except NonFiniteUpload as e:  # found by the sums as they folded it (Algorithm.accumulate)
                raise self.diverged(round_idx, e.source, "upload " + repr(f"{e.part}/{e.key}")) from None
            finally:
                self.checking_sums = None
            meta = sorted(all_gather(meta, acc), key=lambda m: m[0])
        self.check_finite_state(new_state, round_idx)
        for cid, _, m in meta:
            self.sim.ledger.record(round_idx, cid, m["bytes_down"], sum(m["parts_up"].values()), m["parts_down"],
                               m["parts_up"])
        self.sim.last_updates = sorted(kept, key=lambda u: u.client_id) if self.sim.keep_uploads else []
        total_n = sum(n for _, n, _ in meta) or 1
        metrics = {"round": round_idx, "clients": [cid for cid, _, _ in meta]}
        if meta and "train_loss" in meta[0][2]:
            metrics["train_loss"] = sum(m["train_loss"] * n for _, n, m in meta) / total_n
        metrics["bytes_down"], metrics["bytes_up"] = self.sim.ledger.round_totals(round_idx)
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

    def check_finite_state(self, state: dict, round_idx: int) -> None:
        for p, d in state.items():
            for k, v in d.items():
                if torch.is_floating_point(v) and not all_finite(v):
                    raise NonFiniteError(f"training diverged in round {round_idx}: the server state {p}/{k!r} is "
                                         f"non-finite after aggregation; "
                                         f"{step_size_hint(self.sim.args, self.sim.algorithm.config, server=True)}")
