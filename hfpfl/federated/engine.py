"""The simulation engine: one model instance per process, client states swapped in and out, methods as plug-ins."""
from __future__ import annotations

import dataclasses
import logging
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm

from .. import tracking
from ..algorithms.base import FROZEN, GLOBAL, PRIVATE, Update, get_algorithm
from . import checkpoint as ckpt
from .comm import CommLedger, num_elements, tensor_bytes
from .distributed import all_gather, barrier, owned
from .state import ClientStateStore, snapshot
from .training import TensorData, evaluate, make_optimizer

logger = logging.getLogger("hfpfl")


class Simulation:
    """Runs one federated experiment. ``Simulation(run_args, data_args).run()`` -> results dict.

    ``fed_data`` may be passed in (already built) to share it between simulations (FedPop, benchmarks).
    """

    def __init__(self, run_args, data_args=None, method_config=None, *, fed_data=None,
                 accelerator: Accelerator | None = None):
        self.args = run_args
        self.data_args = data_args
        torch.set_num_threads(max(1, run_args.num_threads))
        log_with = None if run_args.report_to == "none" else run_args.report_to
        self.accelerator = accelerator or Accelerator(log_with=log_with, project_dir=run_args.output_dir)
        self.device = self.accelerator.device
        self.output_dir = Path(run_args.output_dir)
        self._prepare_output_dir()

        if fed_data is None:
            from ..data import build_federated_dataset
            fed_data = build_federated_dataset(data_args, seed=run_args.seed)
        self.data = fed_data
        self.num_clients = len(fed_data.clients)
        if self.num_clients == 0:
            raise ValueError("the federated dataset has no clients")

        algo_cls = get_algorithm(run_args.method)
        self.algorithm = algo_cls(self, method_config if method_config is not None else algo_cls.Config())
        if algo_cls.one_shot and run_args.num_rounds != 1:
            logger.warning("%s is one-shot: running exactly 1 round (asked for %d)", algo_cls.name, run_args.num_rounds)
            self.args = dataclasses.replace(run_args, num_rounds=1)

        set_seed(run_args.seed)
        self.model: nn.Module = self.algorithm.build_model().to(self.device)
        self.model_state = self.model.state_dict()  # entries share storage with the model: swap by copy_
        self.keys_by_role = self._assign_roles()
        self.initial_private = snapshot(self.model_state, self.keys_by_role[PRIVATE])
        self.store = ClientStateStore()
        self.ledger = CommLedger()
        self.history: list[dict] = []
        self._tensors: dict[tuple, TensorData] = {}
        self._elapsed_before = 0.0

    # ------------------------------------------------------------------ setup helpers
    def _prepare_output_dir(self) -> None:
        out = self.output_dir
        if self.args.resume_from_checkpoint:
            return
        finished = (out / "results.json").exists()
        has_ckpt = bool(ckpt.list_complete(out))
        if (finished or has_ckpt) and not self.args.overwrite_output_dir:
            what = "a finished run (results.json)" if finished else "checkpoints of an unfinished run"
            raise FileExistsError(f"output_dir {str(out)!r} already holds {what}; pass --resume_from_checkpoint "
                                  f"latest to continue it, --overwrite_output_dir to replace it, or another --output_dir")
        if self.accelerator.is_main_process:
            if self.args.overwrite_output_dir:
                shutil.rmtree(ckpt.checkpoint_root(out), ignore_errors=True)
                for name in ("results.json", "metrics.jsonl"):
                    (out / name).unlink(missing_ok=True)
            out.mkdir(parents=True, exist_ok=True)
        barrier(self.accelerator)

    def build_default_model(self) -> nn.Module:
        from ..models import build_run_model
        return build_run_model(self.args.model, self.args.adapter, num_labels=self.data.num_labels,
                               image_size=self.data.image_size, num_channels=self.data.num_channels,
                               lora_r=self.args.lora_r)

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

    # ------------------------------------------------------------------ data, seeds, optimizers
    def _tensor_data(self, key, ds) -> TensorData:
        if key not in self._tensors:
            self._tensors[key] = TensorData.from_dataset(ds)
        return self._tensors[key]

    def client(self, client_id: int):
        if client_id < self.num_clients:
            return self.data.clients[client_id]
        return self.data.new_clients[client_id - self.num_clients]

    def train_data(self, client_id: int) -> TensorData:
        c = self.client(client_id)
        if len(c.train) == 0:
            raise ValueError(f"client {client_id} has no training data; use fewer clients or a larger min_partition_size")
        return self._tensor_data((client_id, "train"), c.train)

    def test_data(self, client_id: int) -> TensorData:
        return self._tensor_data((client_id, "test"), self.client(client_id).test)

    def global_test_data(self) -> TensorData:
        return self._tensor_data(("global", "test"), self.data.global_test)

    def seed_for(self, round_idx: int, client_id: int, tag: str = "") -> int:
        ss = np.random.SeedSequence([self.args.seed, round_idx, client_id + 1, zlib.crc32(tag.encode())])
        return int(ss.generate_state(1)[0])

    def generator(self, round_idx: int, client_id: int, tag: str = "") -> torch.Generator:
        return torch.Generator().manual_seed(self.seed_for(round_idx, client_id, tag))

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        a = self.args
        return make_optimizer(params, a.optimizer, a.lr, a.momentum, a.weight_decay)

    def sample_clients(self, round_idx: int) -> list[int]:
        n = self.num_clients
        m = self.args.clients_per_round or max(1, int(round(self.args.client_fraction * n)))
        m = min(m, n)
        rng = np.random.default_rng([self.args.seed, round_idx])
        return sorted(int(c) for c in rng.choice(n, size=m, replace=False))

    # ------------------------------------------------------------------ one round
    def run_round(self, round_idx: int, server_state: dict) -> tuple[dict, dict]:
        algo, acc = self.algorithm, self.accelerator
        sampled = self.sample_clients(round_idx)
        updates: list[Update] = []
        for cid in owned(sampled, acc):
            down = algo.download(server_state, cid)
            private = self.store.get(cid)
            if private is None:
                private = algo.init_private_state(cid)
            torch.manual_seed(self.seed_for(round_idx, cid, "client"))
            upd = algo.client_update(cid, down, private, round_idx)
            self.store.put(cid, upd.private)
            upd.private = None  # private state never leaves the client
            upd.metrics["bytes_down"] = tensor_bytes(down)
            upd.upload = {k: v.detach().cpu() for k, v in upd.upload.items()}
            updates.append(upd)
        updates = sorted(all_gather(updates, acc), key=lambda u: u.client_id)
        for u in updates:
            self.ledger.record(round_idx, u.client_id, u.metrics["bytes_down"], tensor_bytes(u.upload))
        new_state = algo.aggregate(server_state, updates, round_idx)
        self.last_updates = updates  # exactly what reached the server this round (inspection, tests)
        total = sum(u.num_samples for u in updates) or 1
        metrics = {"round": round_idx, "clients": [u.client_id for u in updates]}
        if updates and "train_loss" in updates[0].metrics:
            metrics["train_loss"] = sum(u.metrics["train_loss"] * u.num_samples for u in updates) / total
        metrics["bytes_down"], metrics["bytes_up"] = self.ledger.round_totals(round_idx)
        return new_state, metrics

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, round_idx: int, server_state: dict, final: bool = False) -> dict:
        algo, acc, bs = self.algorithm, self.accelerator, self.args.eval_batch_size
        out: dict = {}
        model = algo.load_global(server_state)
        if model is not None:
            out["global_accuracy"] = evaluate(model, self.global_test_data(), batch_size=bs, device=self.device)["accuracy"]
        rows = []
        for cid in owned(range(self.num_clients), acc):
            torch.manual_seed(self.seed_for(round_idx, cid, "eval"))
            model = algo.load_personal(cid, server_state, self.store.get(cid), round_idx)
            res = evaluate(model, self.test_data(cid), batch_size=bs, device=self.device)
            rows.append((cid, res["accuracy"], res["num_samples"]))
        rows = sorted(all_gather(rows, acc))
        if rows:
            out["personal_accuracy"] = float(np.mean([r[1] for r in rows]))  # mean per-client accuracy
            out["personal_accuracy_weighted"] = sum(r[1] * r[2] for r in rows) / max(1, sum(r[2] for r in rows))
            out["per_client"] = {str(c): a for c, a, _ in rows}
        out.update(algo.extra_metrics(round_idx, server_state))
        if final and self.data.new_clients:
            new_rows = []
            for j in owned(range(len(self.data.new_clients)), acc):
                cid = self.num_clients + j
                torch.manual_seed(self.seed_for(round_idx, cid, "new-client"))
                model = algo.personalize_new_client(cid, server_state, self.train_data(cid), round_idx)
                new_rows.append((cid, evaluate(model, self.test_data(cid), batch_size=bs, device=self.device)["accuracy"]))
            new_rows = sorted(all_gather(new_rows, acc))
            out["new_client_accuracy"] = float(np.mean([a for _, a in new_rows]))
            out["new_clients"] = {str(c): a for c, a in new_rows}
        return out

    # ------------------------------------------------------------------ checkpoints
    def _fingerprint(self) -> dict:
        a = self.args
        return {"method": a.method, "model": a.model, "seed": a.seed, "num_clients": self.num_clients,
                "adapter": a.adapter, "world_size": self.accelerator.num_processes}

    def save_checkpoint(self, round_idx: int, server_state: dict, elapsed: float) -> None:
        acc = self.accelerator
        tmp = ckpt.tmp_dir(self.output_dir, round_idx)
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(acc)
        ckpt.save_tensors(self.store.flatten(), tmp / f"clients-rank{acc.process_index}.safetensors")
        if acc.is_main_process:
            ckpt.save_tensors(server_state, tmp / "server.safetensors")
        barrier(acc)
        if acc.is_main_process:
            ckpt.finalize(self.output_dir, round_idx, {
                "round": round_idx, "fingerprint": self._fingerprint(), "history": self.history,
                "ledger": self.ledger.to_json(), "elapsed": elapsed}, keep=self.args.keep_checkpoints)
        barrier(acc)

    def load_checkpoint(self, spec: str) -> tuple[int, dict]:
        path = ckpt.resolve(self.output_dir, spec)
        state = ckpt.read_state(path)
        mine, theirs = self._fingerprint(), state.get("fingerprint", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if k != "world_size" and theirs.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: checkpoint={a!r} now={b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"checkpoint {str(path)!r} was written by a different run ({detail}); resume with the "
                             "same settings or start a new --output_dir")
        server_state = ckpt.load_tensors(path / "server.safetensors")
        expected = set(self.algorithm.init_server_state())
        if set(server_state) != expected:
            raise ValueError(f"checkpoint {str(path)!r} does not match this model: server state keys differ "
                             f"({len(set(server_state) ^ expected)} mismatched)")
        acc = self.accelerator
        for f in sorted(path.glob("clients-rank*.safetensors")):
            self.store.load_flat(ckpt.load_tensors(f), keep=lambda c: c % acc.num_processes == acc.process_index)
        self.history = state["history"]
        self.ledger = CommLedger.from_json(state["ledger"])
        self._elapsed_before = float(state.get("elapsed", 0.0))
        return int(state["round"]), server_state

    # ------------------------------------------------------------------ the run
    def parameter_counts(self) -> dict:
        params = dict(self.model.named_parameters())
        trainable = sum(p.numel() for p in params.values() if p.requires_grad)
        comm = {k: self.model_state[k] for k in self.keys_by_role[GLOBAL]}
        return {"total": sum(p.numel() for p in params.values()), "trainable": trainable,
                "global_state_elements": num_elements(comm), "private_state_elements":
                    num_elements({k: self.model_state[k] for k in self.keys_by_role[PRIVATE]})}

    def run(self) -> dict:
        acc, args = self.accelerator, self.args
        start = time.perf_counter()
        first_round, server_state = 1, None
        if args.resume_from_checkpoint:
            last, server_state = self.load_checkpoint(args.resume_from_checkpoint)
            first_round = last + 1
            logger.info("resumed from round %d", last)
        else:
            server_state = self.algorithm.init_server_state()
        if acc.is_main_process:
            tracking.write_config(self.output_dir, run=args, data=self.data_args, method=self.algorithm.config)
        if acc.log_with:
            acc.init_trackers("hfpfl", config={k: v for k, v in dataclasses.asdict(args).items()
                                                if isinstance(v, (int, float, str, bool))})
        bar = tqdm(range(first_round, args.num_rounds + 1), desc=f"{args.method} rounds", initial=first_round - 1,
                   total=args.num_rounds, disable=not (args.progress and acc.is_local_main_process))
        for r in bar:
            server_state, metrics = self.run_round(r, server_state)
            last = r == args.num_rounds
            if r % args.eval_every == 0 or last:
                ev = self.evaluate(r, server_state, final=last)
                metrics.update({k: v for k, v in ev.items() if not isinstance(v, dict)})
                metrics["per_client"] = ev.get("per_client")
                if last:
                    final_eval = ev
                bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items() if k.endswith("accuracy") and isinstance(v, float)})
            self.history.append(metrics)
            if acc.log_with:
                acc.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=r)
            elapsed = self._elapsed_before + time.perf_counter() - start
            if args.checkpoint_every and (r % args.checkpoint_every == 0 or last):
                self.save_checkpoint(r, server_state, elapsed)
            if acc.is_main_process:
                tracking.write_history(self.output_dir, self.history)
        if first_round > args.num_rounds:  # resumed a finished run: evaluate the final state again
            final_eval = self.evaluate(args.num_rounds, server_state, final=True)
        self.server_state = server_state
        results = self._results(final_eval, self._elapsed_before + time.perf_counter() - start)
        if acc.is_main_process:
            tracking.write_results(self.output_dir, results)
            tracking.plot_curves(self.output_dir, self.history, title=f"{args.method} on {self._dataset_name()}")
            tracking.plot_client_bars(self.output_dir, final_eval.get("per_client", {}), title=args.method)
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
            "num_rounds": a.num_rounds, "seed": a.seed, "world_size": self.accelerator.num_processes,
            "final": {k: v for k, v in final_eval.items() if not isinstance(v, dict)},
            "per_client_accuracy": per_client,
            "per_domain_accuracy": {d: float(np.mean(v)) for d, v in sorted(per_domain.items())},
            "new_client_accuracy": final_eval.get("new_clients", {}),
            "communication": self.ledger.totals(),
            "parameters": self.parameter_counts(),
            "wall_time_s": wall,
        }
