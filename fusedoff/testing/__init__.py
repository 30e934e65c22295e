"""fusedoff's test tools: never imported by the library itself (``import fusedoff`` loads none of them).

- ``emulation``: the test backend ``cuda_emulated`` (the CUDA kernels compiled as host C++ and run by
  the CUDA emulation, csrc/emulation), added to ``fusedoff.backends``' table when this package is
  imported;
- ``simulator``: ``SimulatedRuntime``, the engine's device side on CPU tensors with a race checker;
- ``timed``: ``TimedRuntime``, the engine's device side recorded and timed by a model of a GPU (the
  tests and ``benchmarks/predict_step.py``, ``benchmarks/measure_overlap.py``).

The runtimes take the engine's place through ``fusedoff.offload.runtimes.simulate``.
"""

from fusedoff.testing import emulation

__all__ = ["emulation"]
