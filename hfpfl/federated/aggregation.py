"""The server's arithmetic: running weighted sums of uploads (exact float64 sums, the same bits for any number of
processes or any chunking of clients), the FedOpt server optimizer step, and the finiteness checks of uploads."""
from __future__ import annotations

import torch

from .comm import Parts, TensorDict
from .context import ServerHParams
from .state import MODEL


def _sum_dtype(t: torch.Tensor):
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a floating tensor is finite: its sum in its own precision is finite only if every
    value is (NaN and inf propagate), which is one fast pass; only a sum that overflowed is checked value by value."""
    return bool(t.sum(dtype=_sum_dtype(t)).isfinite()) or bool(torch.isfinite(t).all())


def all_finite_each(tensors) -> list[bool]:
    """:func:`all_finite` of each tensor, with one wait for the answer where all are finite (the common case): their
    sums stacked into one check (float64 holds every float sum's inf and NaN); a sum that overflowed or is
    non-finite is then checked tensor by tensor."""
    tensors = list(tensors)
    if not tensors:
        return []
    if bool(torch.stack([t.sum(dtype=_sum_dtype(t)).to(device="cpu", dtype=torch.float64) for t in tensors])
            .isfinite().all()):
        return [True] * len(tensors)
    return [all_finite(t) for t in tensors]


def finite_rows(t: torch.Tensor) -> torch.Tensor:
    """:func:`all_finite` of every row of a ``[rows, ...]`` tensor (a vectorized chunk's clients), as a bool tensor."""
    dims = tuple(range(1, t.dim()))  # summed in place whatever the layout (a reshape would copy a strided stack)
    ok = (t.sum(dims, dtype=_sum_dtype(t)) if dims else t).isfinite()
    if not bool(ok.all()):
        ok = torch.isfinite(t).flatten(1).all(1) if dims else torch.isfinite(t)
    return ok


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


class NonFiniteUpload(ValueError):
    """An upload given to :meth:`WeightedSums.add` with a ``source`` held a NaN or an infinity: ``source`` (the
    client), ``part`` and ``key`` name it."""

    def __init__(self, source, part: str, key: str):
        super().__init__(f"non-finite upload {part}/{key!r} from {source!r}")
        self.source, self.part, self.key = source, part, key


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

    # :meth:`add` holds CPU uploads until they reach this many bytes (and at most HOLD_UPLOADS of them), then folds
    # them block by block: each block of the float64 sums stays in the cache while every held upload is added to
    # it, so the sums are read and written once per fold instead of once per upload. The same additions in the same
    # order per value as folding each upload at once, so the same bits. CPU, PFLlib's CNN (0.58 M floats), 500
    # clients: see CHANGELOG.md
    HOLD_BYTES = 8 * 2**20
    HOLD_UPLOADS = 8
    FOLD_BLOCK = 1 << 16     # float64 values of the sums per block (512 KiB: within a core's L2 cache)

    def __init__(self, denominator: float = 1.0):
        self.denominator = float(denominator)
        self._sums: dict[str, dict[str, torch.Tensor]] = {}
        self._held: dict[str, list[tuple[TensorDict, float, object]]] = {}   # (tensors, coef, source) by part
        self._held_bytes = 0
        self.total: dict[str, float] = {}
        self.count = 0          # uploads folded in (the engine counts them; all-reduced across processes)

    @property
    def sums(self) -> dict[str, dict[str, torch.Tensor]]:
        """The running sums by part and key (every held upload folded in first)."""
        self.fold_held()
        return self._sums

    def add(self, part: str, tensors: TensorDict, coef: float, source=None) -> None:
        """Add ``coef * tensor`` for every float tensor of ``tensors`` (the running max for integer ones). The tensors
        may be held until a later fold: pass tensors that nothing changes afterwards (uploads are fresh copies).
        ``source`` (a client id): the float tensors are checked for NaN and infinities as they are folded, and a
        fold that meets one raises :class:`NonFiniteUpload` naming the source (here or at a later ``add``, ``get``
        or ``sums``)."""
        acc = self._sums.setdefault(part, {})
        self.total[part] = self.total.get(part, 0.0) + coef
        floats = {}
        for k, v in tensors.items():
            v = v.detach()
            if torch.is_floating_point(v):
                floats[k] = v
            else:
                acc[k] = v.cpu().clone() if k not in acc else torch.maximum(acc[k], v.cpu())
        if not floats:
            return
        if any(v.device.type != "cpu" for v in floats.values()):
            self._fold(part, [(floats, coef, source)])
            return
        self._held.setdefault(part, []).append((floats, coef, source))
        self._held_bytes += sum(v.numel() * v.element_size() for v in floats.values())
        if self._held_bytes >= self.HOLD_BYTES or sum(map(len, self._held.values())) >= self.HOLD_UPLOADS:
            self.fold_held()

    def fold_held(self) -> None:
        """Fold every held upload now (reading the sums does)."""
        held, self._held, self._held_bytes = self._held, {}, 0
        for part, uploads in held.items():
            self._fold(part, uploads)

    def _fold(self, part: str, uploads: list[tuple[TensorDict, float, object]]) -> None:
        """``sums += coef * tensor`` for every upload, in upload order for each value (float64, no float64 copy of an
        upload); a contiguous key of several uploads block by block (see HOLD_BYTES). Uploads with a source are
        checked on the way: the sums were finite before this fold, and a float64 sum of float32 values times
        sample counts cannot overflow, so they are finite after it unless an upload (or a weight) is not; each
        block's sum is taken while the block is in the cache, one wait for all of them. An upload folded alone is
        summed itself (half the bytes of its float64 sums, and as cheap as a separate check)."""
        acc = self._sums.setdefault(part, {})
        checked = any(src is not None for _, _, src in uploads)
        sums = []
        for k in dict.fromkeys(k for tensors, _, _ in uploads for k in tensors):
            rows = [(tensors[k], coef) for tensors, coef, _ in uploads if k in tensors]
            if k not in acc:
                acc[k] = torch.zeros(rows[0][0].shape, dtype=torch.float64)
            n, block = acc[k].numel(), self.FOLD_BLOCK
            if len(rows) == 1 or n <= block or not all(v.is_contiguous() for v, _ in rows):
                for v, coef in rows:
                    acc[k].add_(v.cpu(), alpha=coef)
                if checked:
                    v = rows[0][0]
                    sums.append(v.sum(dtype=_sum_dtype(v)).to(device="cpu", dtype=torch.float64) if len(rows) == 1
                                else acc[k].sum())
                continue
            flat, flats = acc[k].view(-1), [(v.view(-1), coef) for v, coef in rows]
            for s in range(0, n, block):
                into = flat[s:s + block]
                for v, coef in flats:
                    into.add_(v[s:s + block], alpha=coef)
                if checked:
                    sums.append(into.sum())
        if sums and not bool(torch.stack(sums).isfinite().all()):
            for tensors, _, src in uploads:  # the first non-finite upload with a source, in upload order
                for k, ok in zip(tensors, all_finite_each(tensors.values()) if src is not None else ()):
                    if not ok:
                        raise NonFiniteUpload(src, part, k)
            # else a sourceless upload or a weight made the sums non-finite: later folds find their uploads the same way

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
        self.fold_held()  # the held uploads before these: the same order of additions as folding each at once
        acc = self._sums.setdefault(part, {})
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
        return part in self._sums

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
