"""--deterministic: on a CUDA device the run asks PyTorch for reproducible kernels (measured on an H100: without them
vectorized and sequential FedAvg rounds differed by 3e-3 and the same seed gave different numbers); the CPU is left
alone. The flags are plain process-global settings, so this checks them without a GPU (and restores them)."""
import os

import torch

from hfpfl.runtime import configure_determinism


def _flags():
    return (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())


def test_cuda_device_gets_deterministic_kernels_and_cpu_is_untouched(monkeypatch):
    before = _flags()
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        configure_determinism("cpu", True)
        assert _flags() == before and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        configure_determinism("cuda", True)
        # deterministic cuDNN without autotuning, full float32 (no TF32), SDPA without its non-deterministic
        # memory-efficient backward, non-deterministic ops warn
        assert _flags() == (True, False, False, False, False, True, True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        configure_determinism("cuda", False)  # the fast settings: cuDNN autotuning, TF32
        assert _flags()[:6] == (False, True, True, True, True, False)
    finally:
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32,
         torch.backends.cuda.matmul.allow_tf32) = before[:4]
        torch.backends.cuda.enable_mem_efficient_sdp(before[4])
        torch.use_deterministic_algorithms(before[5], warn_only=before[6])
