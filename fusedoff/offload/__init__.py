"""The offload engine: buckets and placement, host state store, chunk planner and stream pipeline."""

from fusedoff.offload.bucket import Bucket
from fusedoff.offload.contract import FusedUpdate, OptimizerRules, Phase, ShardReduction, StateSpec, UpdateArgs
from fusedoff.offload.engine import DEFAULT_CHUNK_SIZE, OFFLOAD_MODES, OffloadEngine

__all__ = ["DEFAULT_CHUNK_SIZE", "OFFLOAD_MODES", "Bucket", "FusedUpdate", "OffloadEngine", "OptimizerRules", "Phase",
           "ShardReduction", "StateSpec", "UpdateArgs"]
