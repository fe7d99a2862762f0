"""The stand-in driver: active, CPU device, and a one-shot benchmarker for the autotuner."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

TARGET = GPUTarget("cpu", "interpreter", 1)


class InterpreterCpuDriver(DriverBase):
    """What ``triton.runtime.driver.active`` returns under ``TRITON_INTERPRET=1`` on CPU."""

    @classmethod
    def is_active(cls) -> bool:
        # Only ever on the path of a CPU-only engine run, where no other driver is active.
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("the CPU stand-in only serves Triton's interpreter")

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_benchmarker(self) -> Callable[..., Sequence[float]]:
        # The interpreter is too slow to benchmark: time one call and report it for every
        # quantile, so an autotuner picks a config quickly and deterministically enough.
        def bench(kernel_call: Callable[[], object], *, quantiles: Sequence[float], **_: Any):
            start = time.perf_counter()
            kernel_call()
            elapsed_ms = (time.perf_counter() - start) * 1e3
            return [elapsed_ms for _ in quantiles]

        return bench
