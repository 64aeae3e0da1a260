"""Layer 1, the bytes of a sync: bucketing, buffers (host or device), verification, the
deployment layout of a sync and its topologies, sharded layouts (:mod:`.shards`) and delta
patches (:mod:`.delta`). Imports only :mod:`weightsync_core.api` and
:mod:`weightsync_core.net` below it, and no Ray."""
