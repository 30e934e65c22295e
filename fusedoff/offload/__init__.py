"""The offload engine: host state store, chunk planner and stream pipeline."""

from fusedoff.offload.engine import DEFAULT_CHUNK_SIZE, OffloadedBucket, OffloadEngine

__all__ = ["DEFAULT_CHUNK_SIZE", "OffloadEngine", "OffloadedBucket"]
