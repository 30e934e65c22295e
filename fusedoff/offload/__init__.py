"""The offload engine: placement, host state store, chunk planner and stream pipeline."""

from fusedoff.offload.engine import DEFAULT_CHUNK_SIZE, OffloadEngine, StateLayout
from fusedoff.offload.update import FusedUpdate, Phase, UpdateArgs

__all__ = ["DEFAULT_CHUNK_SIZE", "FusedUpdate", "OffloadEngine", "Phase", "StateLayout", "UpdateArgs"]
