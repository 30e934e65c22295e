"""``opt.state`` of a fusedoff optimizer: torch's per-parameter dicts, read only once host state is final.

A streamed state is a view of host memory that the step's last copies back still write after
``step()`` returns (on CUDA, asynchronously). Reading a parameter's state through ``opt.state``
first waits for those copies, once per step (a host synchronisation with the device, on the first
read after a step only): a read after ``step()`` sees that step's values. The step itself reads
the dicts without waiting (the engine's `Bucket.adopt_states`, through ``dict``'s own methods).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable



class OptimizerState(defaultdict):
    def __init__(self, wait_host: Callable[[], None], items=()) -> None:
        super().__init__(dict, items)
        self._wait_host = wait_host

    def __getitem__(self, param):
        self._wait_host()
        return super().__getitem__(param)

    def get(self, param, default=None):
        self._wait_host()
        return super().get(param, default)

    def items(self):
        self._wait_host()
        return super().items()

    def values(self):
        self._wait_host()
        return super().values()

    def __reduce__(self):
        # Copies (deepcopy, pickle) are plain defaultdicts, as torch's own; the optimizer they
        # belong to wraps them again.
        return defaultdict, (dict,), None, None, iter(dict.items(self))
