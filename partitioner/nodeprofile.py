"""Moved to :mod:`splitinfer.shared.nodeprofile` (the edge agent reads profiles too).

This shim keeps ``from splitinfer.partitioner.nodeprofile import NodeProfile`` working
for one release; import it from ``splitinfer.shared.nodeprofile``.
"""

from splitinfer.shared.nodeprofile import FORMAT, FORMAT_VERSION, NodeProfile

__all__ = ["FORMAT", "FORMAT_VERSION", "NodeProfile"]
