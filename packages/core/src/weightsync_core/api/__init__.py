"""Layer 1, the interface: errors, configuration and engine options, typed conversion, dtypes,
the backend registry and plugin loading, and the protocols the manager needs from worker
groups, replicas and servers. Imports nothing else of weightsync_core, and no Ray."""
