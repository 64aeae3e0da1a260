"""Server-side extension classes: a replica class, a balancer and a self-routing client."""

from weightsync_trainer import GlobalRequestLoadBalancer, HFRolloutReplica, LLMServerClient


class TaggedReplica(HFRolloutReplica):
    """An HF replica set by an LLMServerManager subclass (no registry lookup)."""


class RecordingLoadBalancer(GlobalRequestLoadBalancer):
    """Least-in-flight routing that remembers every request id (runs as a Ray actor)."""

    def __init__(self, server_ids, max_sessions=100_000):
        super().__init__(server_ids, max_sessions)
        self.request_ids = []

    def acquire(self, request_id=None):
        self.request_ids.append(request_id)
        return super().acquire(request_id)

    def seen(self):
        return list(self.request_ids)


class RoundRobinClient(LLMServerClient):
    """Routes requests itself; built with load_balancer_handle=None."""

    def __init__(self, config, load_balancer_handle=None, **kwargs):
        super().__init__(config, load_balancer_handle, **kwargs)
        self.routed = []

    async def _acquire_server(self, request_id):
        names = sorted(self.servers)
        name = names[len(self.routed) % len(names)]
        self.routed.append(name)
        return name, self.servers[name]

    async def _release_server(self, server_id):
        return None
