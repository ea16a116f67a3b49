"""Vectorized local training: many sampled clients trained together in batched ``torch.func.vmap`` calls.

Small models are overhead-bound: a step of an MLP 64-64-10 on 10 images costs about as much Python and dispatch as
arithmetic, so stepping 100 clients one after another is ~10x slower than stepping them as one batched call. This
package runs the local training of a chunk of clients as stacked tensors (``[clients, *shape]`` per parameter,
buffer and optimizer state) with ``torch.func.functional_call`` under ``vmap``: ``vmap(grad_and_value(...))`` for
models with convolutions; for the others one batched forward of every client's loss and one backward of their sum,
which gives every client its own gradient (faster there). Either way with exactly the per-client semantics of the
sequential loop (:func:`hfpfl.training.train_local`):

* each client's own data order (the same seeded generator and ``randperm`` per epoch), own batches (the trailing
  singleton merged away), own number of steps: at every step only the clients that still have a batch step, grouped
  by batch size (a client that has finished is simply not in the group: its parameters and optimizer state stay);
* each client's own optimizer state (SGD with momentum / weight decay, Adam, AdamW: torch's update rules written out
  on stacked tensors), created fresh every round as ``ctx.train`` does;
* BatchNorm running statistics per client (buffers are stacked too and updated in place under ``vmap``);
* the method's local hooks, pure functions (:meth:`Algorithm.local_hooks`, e.g. FedProx's proximal term).

What cannot be vectorized falls back to the sequential loop automatically (:func:`vectorize_reason` says why):
methods that override ``client_update`` / ``local_train`` / ``load_client`` or whose hooks have no functional form,
models with active dropout (its random masks would differ from the sequential path), persistent optimizer state.
The numbers match the sequential path within float tolerance (batched kernels sum in another order).

Layout, one job a module: :mod:`.policy` (whether to vectorize), :mod:`.chunks` (which clients train together) and
:mod:`.heap` (glibc settings for rounds of many clients), :mod:`.schedules` (each client's batches),
:mod:`.client_states` (per-client values and their stacks), :mod:`.stacked_splits` (the clients' data as stacks),
:mod:`.optimizer` (torch's update rules on stacks), :mod:`.trainer` (a chunk's local training) and
:mod:`.evaluate` (a chunk's personal-model evaluation).
"""

from .chunks import ACCELERATOR_CHUNK_BYTES, CHUNK_BYTES, chunks_of
from .client_states import downloads, per_client_values, same_download_for_all
from .evaluate import evaluate_clients
from .heap import PIN_MMAP_CLIENTS, pin_mmap_threshold, release_freed_heap
from .policy import can_vectorize_eval, clients_per_step, local_steps, should_vectorize, vectorize_reason
from .schedules import batch_schedule
from .stacked_splits import StackedData, stacked_data
from .trainer import ChunkUpdates, train_chunk

__all__ = [
    "ACCELERATOR_CHUNK_BYTES", "CHUNK_BYTES", "PIN_MMAP_CLIENTS", "ChunkUpdates", "StackedData", "batch_schedule",
    "can_vectorize_eval", "chunks_of", "clients_per_step", "downloads", "local_steps", "evaluate_clients", "per_client_values",
    "pin_mmap_threshold", "release_freed_heap", "same_download_for_all", "should_vectorize", "stacked_data",
    "train_chunk", "vectorize_reason",
]
