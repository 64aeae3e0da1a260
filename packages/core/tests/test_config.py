"""CheckpointEngineConfig validation."""

import pytest
import torch

from weightsync_core import CheckpointEngineConfig
from weightsync_core.api.config import parse_dtype


def test_defaults_follow_verl():
    config = CheckpointEngineConfig()
    assert config.backend == "naive"
    assert config.bucket_size_bytes == 512 << 20
    assert config.verify is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": ""}, "backend must be a non-empty string"),
        ({"update_weights_bucket_megabytes": 0}, "positive integer"),
        ({"update_weights_bucket_megabytes": 1.5}, "positive integer"),
        ({"update_weights_bucket_megabytes": 1 << 20}, "at most 65536"),
        ({"sync_timeout_seconds": 0}, "sync_timeout_seconds must be a finite number"),
        ({"sync_timeout_seconds": float("inf")}, "finite number of seconds > 0, got inf"),
        ({"sync_timeout_seconds": float("nan")}, "finite number of seconds > 0, got nan"),
        ({"sync_timeout_seconds": True}, "finite number of seconds > 0, got True"),
        ({"sync_timeout_seconds": "60"}, "finite number of seconds > 0, got '60'"),
        ({"engine_kwargs": {"gloo": 3}},
         "engine_kwargs must be a mapping of a backend name to a dict"),
        ({"rollout_dtype": "bfloat17"}, "'bfloat17' is not a torch dtype"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckpointEngineConfig(**kwargs)


def test_only_the_active_backend_kwargs_are_used():
    config = CheckpointEngineConfig(
        backend="gloo", engine_kwargs={"gloo": {"host": "127.0.0.1"}, "nixl": {"x": 1}}
    )
    assert config.active_engine_kwargs == {"host": "127.0.0.1"}


def test_parse_dtype_accepts_names_and_dtypes():
    assert parse_dtype("torch.bfloat16") is torch.bfloat16
    assert parse_dtype(torch.float16) is torch.float16
    assert parse_dtype(None) is None


def test_errors_survive_pickling_across_ray_with_their_attributes():
    import pickle

    from weightsync_core.api.errors import SyncTimeoutError, TransferError, VerificationError

    for error in (
        VerificationError("bad", tensors=["w"]),
        TransferError("lost", peer="rank 1", stage="bucket data", code=-1),
        SyncTimeoutError("late", stage="transfer", pending=["rollout rank 2"]),
    ):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert copy.__dict__ == error.__dict__


GIB = 1 << 30


@pytest.fixture
def six_gib_machine(monkeypatch):
    """This machine, as if it had 6 GiB of physical memory."""
    from weightsync_core.api import config as config_module

    monkeypatch.setattr(config_module, "physical_memory_bytes", lambda: 6 * GIB, raising=False)


def test_host_buckets_that_cannot_fit_in_physical_memory_are_refused(six_gib_machine):
    # a receiver holds up to three buckets: 3 x 2048 MiB fit in 6 GiB, 3 x 2049 do not
    assert CheckpointEngineConfig(backend="gloo", update_weights_bucket_megabytes=2048)
    with pytest.raises(ValueError) as info:
        CheckpointEngineConfig(backend="gloo", update_weights_bucket_megabytes=2049)
    message = str(info.value)
    assert message.startswith("update_weights_bucket_megabytes=2049 does not fit in this "
                              "machine's memory")
    assert "this machine has 6.0 GiB of physical memory" in message
    assert "The largest accepted here is 2048 MiB" in message


def test_the_memory_bound_counts_a_ring_worker_s_slots_and_spares_device_buckets(
    six_gib_machine,
):
    from weightsync_core.api.registry import CheckpointEngineRegistry
    from weightsync_core.engines import RingCheckpointEngine

    if "test_memory_ring" not in CheckpointEngineRegistry.names():
        @CheckpointEngineRegistry.register("test_memory_ring")
        class _Ring(RingCheckpointEngine):
            def create_transport(self):
                raise NotImplementedError

    def ring(megabytes, **options):
        return CheckpointEngineConfig(backend="test_memory_ring",
                                      update_weights_bucket_megabytes=megabytes,
                                      engine_kwargs={"test_memory_ring": options})

    # a ring worker: 8 registered slots and 3 copies
    with pytest.raises(ValueError, match=r"holds up to 11 buckets .* accepted here is 558 MiB"):
        ring(1024, slots=8)
    assert ring(558, slots=8)
    with pytest.raises(ValueError, match=r"or keep the buckets on a device \(engine option "
                                         r"device='cuda'\)"):
        ring(4096)
    assert ring(4096, device="cuda")  # on a GPU: bounded by the 64 GiB cap only
    assert CheckpointEngineConfig(backend="naive", update_weights_bucket_megabytes=4096)


def test_the_bucket_is_checked_again_where_the_engine_is_built(monkeypatch):
    from weightsync_core.api import config as config_module
    from weightsync_core.worker import build_engine

    config = CheckpointEngineConfig(backend="gloo", update_weights_bucket_megabytes=1024)
    # a worker's machine, smaller than the driver's
    monkeypatch.setattr(config_module, "physical_memory_bytes", lambda: 2 * GIB, raising=False)
    with pytest.raises(ValueError, match="largest accepted here is 682 MiB"):
        build_engine(config)


def test_the_64_gib_cap_holds_beside_this_machine_s_real_memory():
    from weightsync_core.api.config import MAX_BUCKET_MEGABYTES, physical_memory_bytes

    memory = physical_memory_bytes()
    assert memory is not None and memory > GIB
    if memory >= 3 * (MAX_BUCKET_MEGABYTES << 20):
        pytest.skip("this machine holds three 64 GiB buckets")
    with pytest.raises(ValueError, match=f"GiB of physical memory. The largest accepted here "
                                         f"is {memory // 3 >> 20} MiB"):
        CheckpointEngineConfig(backend="gloo", update_weights_bucket_megabytes=MAX_BUCKET_MEGABYTES)


@pytest.mark.parametrize("dtype", ["int8", "bool", "uint8", "complex64", "float64",
                                   "float8_e4m3fn", torch.int8])
def test_a_rollout_dtype_no_replica_serves_is_refused_naming_those_accepted(dtype):
    from weightsync_core import CheckpointEngineRegistry

    accepted = r"a replica serves only 'bfloat16', 'float16', 'float32'; set rollout_dtype"
    with pytest.raises(ValueError, match=rf"rollout_dtype .* cannot be a rollout dtype: .*"
                                         rf"{accepted}"):
        CheckpointEngineConfig(backend="gloo", rollout_dtype=dtype)
    with pytest.raises(ValueError, match=accepted):  # an engine built without a config
        CheckpointEngineRegistry.new("gloo", bucket_size=1 << 20, rollout_dtype=dtype)


def test_the_rollout_dtypes_replicas_serve_are_accepted():
    for dtype in ("bfloat16", "torch.float16", "float32", torch.bfloat16):
        assert CheckpointEngineConfig(rollout_dtype=dtype).rollout_torch_dtype == parse_dtype(dtype)


def test_full_verify_every_without_delta_is_refused():
    with pytest.raises(ValueError, match=r"full_verify_every=3 applies to delta sync only, and "
                                         r"delta is off .*: set delta=True as well, or drop "
                                         r"full_verify_every"):
        CheckpointEngineConfig(backend="gloo", full_verify_every=3)
    assert CheckpointEngineConfig(backend="gloo", delta=True, full_verify_every=3)
    assert CheckpointEngineConfig(backend="gloo", full_verify_every=0)


def test_a_config_built_in_python_refuses_what_its_annotations_refuse():
    # a string where a flag belongs was taken (a truthy 'no' left verification on)
    with pytest.raises(ValueError, match=r"verify must be True or False, got 'no' \(str\)"):
        CheckpointEngineConfig(verify="no")  # pyright: ignore[reportArgumentType]
    by_dtype = CheckpointEngineConfig(rollout_dtype=torch.bfloat16)  # pyright: ignore[reportArgumentType]
    assert by_dtype.rollout_dtype == "bfloat16"
