"""hfpfl's log format and the libraries' noise: the one logging set-up every entry point calls, and the switch that
turns library progress bars off when an hfpfl program's log is redirected. At the bottom of the package: a method
that loads a pipeline late (FedBiP) quiets its bars without importing the command line."""
from __future__ import annotations

import logging
import os
import sys
import warnings


class _NoTorchvisionFallbackNotice(logging.Filter):
    """transformers 5 says "`CLIPImageProcessor` requires torchvision (not installed); falling back to
    `CLIPImageProcessorPil`" when diffusers' Stable Diffusion modules are imported. The PIL processors are the ones
    hfpfl uses (torchvision is not in its pinned set), so the notice has nothing for a user to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


_FALLBACK_FILTER = _NoTorchvisionFallbackNotice()
_REDIRECTED_LOG = False  # set by _setup_logging: an hfpfl program whose stderr is not a terminal


def quiet_library_progress_bars(diffusers: bool = False) -> bool:
    """In an hfpfl program whose log is redirected (:func:`_setup_logging` ran and stderr is not a terminal), turn
    off the progress bars of huggingface_hub, transformers, datasets and -- when ``diffusers`` or when it is already
    imported -- diffusers, through their public switches, so that the log holds plain lines, not bar redraws.
    Returns whether it did. Library use (hfpfl imported in a notebook, whose stderr is no terminal either) keeps the
    user's bars. diffusers is imported only when asked: it costs about a second, which runs that never use it
    should not pay."""
    if not _REDIRECTED_LOG:
        return False
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read by huggingface_hub and transformers at import
    import datasets
    import huggingface_hub.utils
    import transformers.utils.logging

    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    if diffusers or "diffusers" in sys.modules:
        import diffusers.utils.logging

        diffusers.utils.logging.disable_progress_bar()
    return True


def setup_logging(diffusers: bool = False) -> None:
    """hfpfl's log format; library noise off: chatty loggers at WARNING, the torchvision fallback notice dropped,
    and off a terminal every library progress bar off (``diffusers=True`` for programs that load pipelines)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    for noisy in ("httpx", "urllib3", "filelock", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # the logger transformers' lazy module warns through (a logger-level filter sees the record before any handler)
    fallback_logger = logging.getLogger("transformers.utils.import_utils")
    if _FALLBACK_FILTER not in fallback_logger.filters:
        fallback_logger.addFilter(_FALLBACK_FILTER)
    # accelerate warns in every forked worker that it set torch's threads for OMP_NUM_THREADS; the engine sets the
    # run's --num_threads itself right after (hfpfl.federated.engine), so the notice says nothing about this run
    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS/MKL_NUM_THREADS unset", category=UserWarning)
    global _REDIRECTED_LOG
    _REDIRECTED_LOG = not sys.stderr.isatty()
    quiet_library_progress_bars(diffusers=diffusers)
