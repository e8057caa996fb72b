"""The backend's driver: the host as Triton's one active device."""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class CPUDriver(DriverBase):
    @staticmethod
    def is_active() -> bool:
        # The only active driver where torch sees no GPU (Triton requires exactly one).
        import torch

        return not torch.cuda.is_available()

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("prime_r3_triton_cpu builds no launcher: use TRITON_INTERPRET=1")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 1)

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        return None

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_device_interface(self) -> Any:
        import torch

        return torch.cpu

    def get_benchmarker(self) -> Any:
        from triton.testing import do_bench

        return do_bench
