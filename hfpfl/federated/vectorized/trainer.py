"""Local training of a chunk of clients as stacked tensors: ``vmap``-batched steps with each client's own batches,
optimizer state and BatchNorm statistics, ending in one :class:`Update` per client."""
from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ...training import declared_loss, model_inputs
from ..aggregation import finite_rows, memory_order
from ..protocol import Update
from ..state import MODEL, Fresh
from .client_states import empty_in_order, per_client_values, stack_values
from .optimizer import StackedOptimizer
from .schedules import BatchSchedules
from .stacked_splits import stacked_data


def grad_layouts(sim, vstep, P: dict, B: dict, anchors: dict, anchor_dims: dict, batch: dict) -> dict:
    """The memory order of each stacked parameter's gradient (:func:`memory_order`), found once per simulation by
    one probe step of (at most) two clients; :func:`train_chunk` then stores the stacked parameters in those orders
    from the start, so each optimizer update walks parameter and gradient in the same order.

    Why: a batched ``Linear``'s weight gradient comes out transposed (``[clients, out, in]`` with strides ``(out*in,
    1, out)``), and an in-place update of a contiguous parameter by it walks one of the two against its memory order:
    ~8x an update of matching layouts (MLP 64-64-10, 100 clients: 1.03 vs 0.13 ms; the batched matmuls read the
    transposed weight as it is). Values are unchanged, only strides. Found by a probe, not by a chunk's own first
    step, so that every chunk of every process trains in the same layout from its first step whatever the chunking
    (the layout is a property of the model's operations, not of the clients or their number). The probe reads
    copies: ``P``, ``B`` and the batch are left as they were."""
    cache = sim._grad_layouts
    if cache is None:
        n = min(2, len(next(iter(batch.values()))))
        if n < 2:  # one client: a size-1 client dimension has no place in memory to learn; the next chunk probes
            return {}
        rows = slice(0, n)
        grads, _ = vstep({k: v[rows].clone() for k, v in P.items()}, {k: v[rows].clone() for k, v in B.items()},
                         {k: v if anchor_dims[k] is None else v[rows] for k, v in anchors.items()},
                         {k: v[rows] for k, v in batch.items()})
        orders = {k: memory_order(g) for k, g in grads.items()}
        # the client dimension outermost (each client's row one block, as slicing and folding a row expect)
        cache = sim._grad_layouts = {k: o if o is not None and o[0] == 0 else None for k, o in orders.items()}
    return cache


def _declared_loss_step(model, shared: dict, loss_of, reg, anchor_dims: dict):
    """The summed-loss step with the model's declared loss (:func:`~hfpfl.training.declared_loss`) computed outside
    ``vmap``: the clients' logits come from one batched forward, and the loss is one call over all of them. A step's
    group of clients has batches of one size, so ``C x`` the mean over the ``C x B`` examples is the sum of the
    clients' own mean losses, whose gradient is, row by row, each client's own (0.90x the step time of the loss
    inside ``vmap`` for a 64-64-10 MLP at 20 clients, 0.94x at 100)."""
    def logits_of(p, b, batch):
        return functional_call(model, ({**shared, **p, **b}), args=(), kwargs=model_inputs(batch), strict=False,
                               tie_weights=False).logits

    vlogits = vmap(logits_of, in_dims=(0, 0, 0), randomness="error")
    vtask = vmap(loss_of)
    vreg = vmap(reg, in_dims=(0, anchor_dims)) if reg is not None else None

    def vstep(p, b, a, batch):
        leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
        labels = batch["labels"]
        with torch.enable_grad():
            logits = vlogits(leaves, b, {k: v for k, v in batch.items() if k != "labels"})
            loss = loss_of(logits.flatten(0, 1), labels.flatten(0, 1)) * logits.shape[0]
            if vreg is not None:
                loss = loss + vreg(leaves, a).sum()
            grads = torch.autograd.grad(loss, list(leaves.values()), materialize_grads=True)
        with torch.no_grad():  # each client's own task loss, for its metrics and finiteness
            task = vtask(logits.detach(), labels)
        return dict(zip(leaves, grads)), task
    return vstep


class ChunkUpdates(list):
    """The :class:`Update` of every client of a vectorized chunk, in order, plus the chunk's uploads as stacked
    tensors (``stacked[part][key]`` is ``[clients, *shape]``) and the bytes one client uploads per part (the same
    for every client of a chunk). With ``uploads=False`` the per-client ``upload`` dicts are left empty: the engine
    folds ``stacked`` into its running sums in one call (:meth:`WeightedSums.add_stacked`)."""

    stacked: dict
    parts_up: dict


def train_chunk(sim, clients: list[int], downs: dict[int, dict], privates: dict[int, dict],
                round_idx: int, uploads: bool = True) -> ChunkUpdates:
    """Local training of ``clients`` (same hyperparameters) as stacked tensors; one :class:`Update` per client
    with the uploads and private state the base ``client_update`` would produce (views into the stacks)."""
    algo, model, device = sim.algorithm, sim.model, sim.device
    hp = sim.client_hparams(clients[0])
    state = sim.model_state
    params_all = dict(model.named_parameters())
    trainable = [n for n, p in params_all.items()
                 if p.requires_grad and n in set(algo.global_keys) | set(algo.private_keys)]
    trainable_set = set(trainable)
    buffers_all = dict(model.named_buffers())
    per_client_keys = set(algo.global_keys) | set(algo.private_keys)
    # per-client tensors: trainable parameters and the buffers that are state (global / private); frozen ones shared
    buffer_keys = [k for k in buffers_all if k in per_client_keys]
    shared = {k: v for k, v in {**params_all, **buffers_all}.items() if k not in trainable_set and k not in buffer_keys}

    def client_value(cid, k):
        priv, down = privates[cid].get(MODEL) or {}, downs[cid].get(MODEL, {})
        if k in priv:
            return priv[k]
        if k in down:
            return down[k]
        if k in sim.initial_private:
            return sim.initial_private[k]
        return state[k]

    vals = per_client_values(clients, [*trainable, *buffer_keys], client_value, downs, privates)
    hp_plain_sgd = hp.optimizer == "sgd" and not (hp.weight_decay or hp.momentum)
    convs = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    with torch.no_grad():
        layouts = sim._grad_layouts or {}  # each gradient's memory order (grad_layouts), once known
        # every client starts from one tensor per parameter (FedAvg's download): the first step reads it unstacked
        # (see ``start`` below)
        start = {k: vals[k][0].to(device).to(params_all[k].dtype) for k in trainable} \
            if convs and trainable and all(all(v is vals[k][0] for v in vals[k]) for k in trainable) else None
        if start is not None and layouts and hp_plain_sgd:
            # plain SGD writes each client's parameters after its first step as start - lr * gradient, straight
            # into the stack: no copy of the start values per client first
            P = {k: torch.empty((len(clients), *v.shape), dtype=v.dtype, device=device) if layouts.get(k) is None
                 else empty_in_order(v.unsqueeze(0).expand(len(clients), *v.shape), layouts[k])
                 for k, v in start.items()}
            first_into_stack = True
        else:
            P = {k: stack_values(vals[k], device, copy_shared=True, order=layouts.get(k)).to(params_all[k].dtype)
                 for k in trainable}
            first_into_stack = False
        B = {k: stack_values(vals[k], device, copy_shared=True) for k in buffer_keys}
    del vals
    shared = {k: v.detach() for k, v in shared.items()}

    hooks = {}
    for c in clients:
        hooks = algo.local_hooks(c, downs[c], privates[c])
        if set(hooks) - {"regularizer"}:  # the engine falls back to training these clients one by one (exact)
            raise RuntimeError(f"{type(algo).__name__}'s local hooks {sorted(set(hooks) - {'regularizer'})} have "
                               "no vectorized form (only a regularizer has)")
    reg = hooks.get("regularizer")
    # what the regularizer reads per client: the download's model part (shared when every client got the same)
    anchor_keys = sorted(downs[clients[0]].get(MODEL, {})) if reg is not None else []
    anchors, anchor_dims = {}, {}
    for k in anchor_keys:
        vals = [downs[c][MODEL][k] for c in clients]
        if all(v is vals[0] for v in vals):
            anchors[k], anchor_dims[k] = vals[0].to(device), None
        else:
            anchors[k], anchor_dims[k] = stack_values(vals, device), 0

    def loss_fn(p, b, anchor, batch):
        out = functional_call(model, ({**shared, **p, **b}), args=(), kwargs={**model_inputs(batch),
                                                                              "labels": batch["labels"]},
                              strict=False, tie_weights=False)
        task = out.loss
        loss = task + reg(p, anchor) if reg is not None else task
        return loss, task

    # buffers are an input (BatchNorm updates them in place), not differentiated
    def _grad(p, b, anchor, batch):
        def f(p_, b_):
            return loss_fn(p_, b_, anchor, batch)
        g, (_, task) = grad_and_value(f, argnums=0, has_aux=True)(p, b)
        return g, task

    in_dims = (0, 0, anchor_dims, 0)
    loss_of = declared_loss(model)
    vstep_start = None
    if convs:
        # convolutions: vmap(grad) (functorch batches a conv's backward as one grouped conv); the summed-loss
        # backward below measured 20-23% slower on PFLlib's CNN (500 clients x 5 images, batch 5)
        vstep = vmap(_grad, in_dims=in_dims, randomness="error")
        # the first step from parameters every client shares: unbatched weights, so the forward and the input
        # gradients are ordinary convolutions over all the clients' examples (not grouped ones), and only the
        # weight gradients are per client
        vstep_start = vmap(_grad, in_dims=(None, 0, anchor_dims, 0), randomness="error")
    elif loss_of is not None:
        vstep = _declared_loss_step(model, shared, loss_of, reg, anchor_dims)
    else:
        vloss = vmap(loss_fn, in_dims=in_dims, randomness="error")

        def vstep(p, b, a, batch):
            """Every client's gradient and task loss. The clients' losses are independent, so the gradient of their
            sum w.r.t. the stacked parameters is, row by row, each client's own gradient: one batched forward and
            one ordinary backward, 18-27% faster than ``vmap(grad(loss))`` for a 64-64-10 MLP at 20-100 clients
            (at 500 the two trade places run to run: scripts/bench_vectorized_step.py)."""
            leaves = {k: v.detach().requires_grad_() for k, v in p.items()}
            with torch.enable_grad():
                loss, task = vloss(leaves, b, a, batch)
                grads = torch.autograd.grad(loss.sum(), list(leaves.values()), materialize_grads=True)
            return dict(zip(leaves, grads)), task

    # schedules: every client's batches, drawn as the sequential loop draws them
    epochs, steps = hp.local_epochs, hp.local_steps
    datas = {c: sim.train_data(c) for c in clients}
    sizes = [len(datas[c]) for c in clients]
    scheds = BatchSchedules(sizes, sim.seeds_for(round_idx, clients, ""), hp.batch_size, epochs or 1, steps,
                            sim.args.last_batch)
    stacked = stacked_data(sim, clients, "train", [datas[c] for c in clients])
    n_steps = scheds.n_steps
    loss_sums = torch.zeros(len(clients), dtype=torch.float64, device=device)  # read once, after the last step
    opt = StackedOptimizer(hp, {})
    model.train()
    for s in range(max(n_steps)):
        for members, batch_idx in scheds.groups(s):
            everyone = len(members) == len(clients)
            idx = None if everyone else torch.tensor(members, device=device)
            if stacked is not None:  # one gather per column for the whole group
                rows = None if everyone else torch.tensor(members)
                batch = stacked.gather(rows, batch_idx)
                batch = {k: v.to(device) for k, v in batch.items()}
            else:
                sel = [datas[clients[i]].select(batch_idx[j]) for j, i in enumerate(members)]
                batch = {k: torch.stack([b[k] for b in sel]).to(device) for k in sel[0]}
            if s == 0 and not layouts:  # the simulation's first chunk: find the layouts, store P in them (one copy)
                layouts = grad_layouts(sim, vstep, P, B, anchors, anchor_dims, batch)
                with torch.no_grad():
                    P = {k: v if layouts.get(k) in (None, memory_order(v)) else
                         empty_in_order(v, layouts[k]).copy_(v) for k, v in P.items()}
            b = B if everyone else {k: v[idx] for k, v in B.items()}
            a = {k: (v if anchor_dims[k] is None or everyone else v[idx]) for k, v in anchors.items()}
            if s == 0 and start is not None:
                grads, task = vstep_start(start, b, a, batch)
            else:
                p = P if everyone else {k: v[idx] for k, v in P.items()}
                grads, task = vstep(p, b, a, batch)  # BatchNorm statistics update ``b`` in place
            if not everyone:  # ``b`` was a gathered copy: scatter it back
                with torch.no_grad():
                    for k in B:
                        B[k][idx] = b[k]
            with torch.no_grad():
                # plain SGD's first step: start - lr * gradient (the optimizer's rule). Step 0 writes every row:
                # every client has a first batch (a split is never empty, and a lone partial batch is kept)
                if s == 0 and first_into_stack:
                    for k, g in grads.items():
                        if everyone:
                            torch.add(start[k], g, alpha=-hp.lr, out=P[k])
                        else:
                            P[k][idx] = torch.add(start[k], g, alpha=-hp.lr)
                else:
                    opt.step(P, grads, idx, s + 1)
            if everyone:
                loss_sums += task.detach().double()
            else:
                loss_sums[idx] += task.detach().double()
    # private states and per-client uploads leave in the usual layout; stacked uploads keep their gradients' (folded
    # in their own memory order by WeightedSums.add_stacked: no copy)
    leave = set(algo.private_keys) | (set(algo.global_keys) if uploads else set())
    P = {k: v.contiguous() if k in leave else v for k, v in P.items()}
    # the model ends as the sequential loop leaves it: holding the last client's state
    with torch.no_grad():
        for k in trainable:
            state[k].copy_(P[k][-1])
        for k in buffer_keys:
            state[k].copy_(B[k][-1])
    # finiteness of every client's result at once (a float64 sum of finite values is finite)
    with torch.no_grad():
        ok = loss_sums.isfinite()
        for t in (*P.values(), *(v for v in B.values() if torch.is_floating_point(v))):
            ok &= finite_rows(t)
        ok, loss_sums = ok.cpu(), loss_sums.cpu()
    out = ChunkUpdates()
    gkeys, pkeys = algo.global_keys, algo.private_keys

    def stack_of(k):
        if k in P:
            return P[k].detach()
        if k in B:
            return B[k]
        # not trained: the model's own value, copied (the model's tensors change with the next chunk)
        return state[k].detach().clone().expand(len(clients), *state[k].shape)
    out.stacked = {MODEL: {k: stack_of(k) for k in gkeys}}
    out.parts_up = {MODEL: sum(v[0].numel() * v.element_size() for v in out.stacked[MODEL].values())}
    # private states: one CPU tensor per client and key (the store may spill or save each client on its own)
    priv_rows = {k: stack_of(k).cpu().unbind(0) for k in pkeys}
    up_rows = {k: v.cpu().unbind(0) for k, v in out.stacked[MODEL].items()} if uploads else None
    losses, finite = loss_sums.tolist(), ok.tolist()
    for i, c in enumerate(clients):
        upload = {MODEL: {k: up_rows[k][i] for k in gkeys}} if uploads else {}
        private = {MODEL: Fresh({k: priv_rows[k][i].clone() for k in pkeys})}
        metrics = {"train_loss": losses[i] / max(n_steps[i], 1), "steps": n_steps[i],
                   "examples": sum(size for _, size in scheds.spans[i])}
        upd = Update(c, upload=upload, num_samples=sizes[i], private=private, metrics=metrics)
        upd.finite = finite[i]  # checked here for the whole chunk (the engine checks only what is not)
        out.append(upd)
    return out
