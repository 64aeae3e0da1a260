"""CheckpointEngineConfig validation."""

import pytest
import torch

from weightsync_core import CheckpointEngineConfig
from weightsync_core.config import parse_dtype


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
        ({"engine_kwargs": {"gloo": 3}}, "engine_kwargs must map a backend name"),
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

    from weightsync_core.errors import SyncTimeoutError, TransferError, VerificationError

    for error in (
        VerificationError("bad", tensors=["w"]),
        TransferError("lost", peer="rank 1", stage="bucket data", code=-1),
        SyncTimeoutError("late", stage="transfer", pending=["rollout rank 2"]),
    ):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
        assert copy.__dict__ == error.__dict__
