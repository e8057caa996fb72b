"""The backend's compiler: refuses to compile (kernels run in Triton's interpreter)."""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import BaseBackend, GPUTarget, Language


class CPUBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "prime_r3_triton_cpu-interpreter-only"

    def parse_options(self, options: dict) -> Any:
        raise RuntimeError(
            "prime_r3_triton_cpu compiles nothing: run with TRITON_INTERPRET=1 "
            "(Triton's interpreter runs every kernel on the host)"
        )

    def add_stages(self, stages: dict, options: object, language: Language) -> None:
        self.parse_options({})

    def load_dialects(self, context: Any) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
