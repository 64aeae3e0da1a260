"""The processes a test starts beside this Ray driver (the ``clean_processes`` fixture) leave
the driver's connections to Ray alone. A child forked from the driver inherited them: its
garbage collector finalized the driver's actor handles over the driver's own gRPC
connections, and the driver's next calls to Ray never returned (a clean-clone CI run hung
until it was stopped at 90 minutes)."""

import gc

import ray


@ray.remote
class _Echo:
    def echo(self, value: str) -> str:
        return value


def _collect_garbage(results) -> None:
    gc.collect()
    results.put("collected")


def test_processes_beside_the_driver_leave_its_ray_connections_alone(clean_processes):
    gc.disable()  # the garbage below waits for the child's collection, not the driver's
    try:
        for round_ in ("first", "second"):
            handles = [_Echo.remote() for _ in range(2)]
            assert ray.get([handle.echo.remote(round_) for handle in handles],
                           timeout=60) == [round_] * 2
            garbage = {"handles": handles}
            garbage["itself"] = garbage  # only a garbage collection frees it
            del garbage, handles
            results = clean_processes.Queue()
            child = clean_processes.Process(target=_collect_garbage, args=(results,))
            child.start()
            assert results.get(timeout=60) == "collected"
            child.join(timeout=30)
            gc.collect()
        assert ray.get(_Echo.remote().echo.remote("after"), timeout=60) == "after"
    finally:
        gc.enable()
