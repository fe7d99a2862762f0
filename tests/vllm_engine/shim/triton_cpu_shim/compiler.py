"""The stand-in compiler: registered so the backend exists; never compiles anything."""

from __future__ import annotations

from typing import Any

from triton.backends.compiler import BaseBackend, GPUTarget


class InterpreterCpuBackend(BaseBackend):
    """Claims the ``cpu`` target; every compile step raises (the interpreter never calls it)."""

    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "aostore-triton-cpu-interpreter-shim"

    def parse_options(self, options: dict[str, Any]) -> Any:
        raise NotImplementedError("the CPU stand-in only serves Triton's interpreter")

    def add_stages(self, stages: dict[str, Any], options: Any, language: Any = None) -> None:
        raise NotImplementedError("the CPU stand-in only serves Triton's interpreter")

    def load_dialects(self, context: Any) -> None:
        pass

    def get_module_map(self) -> dict[str, Any]:
        return {}
