"""Layer 2, orchestration on Ray: the manager that runs one sync, its stages and the blame for
a failure, the delta ledger, Ray worker groups and replicas, deployments for benchmarks and
a local Ray instance. The only folder of weightsync_core that imports Ray."""
