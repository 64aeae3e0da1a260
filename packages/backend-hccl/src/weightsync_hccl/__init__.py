"""weightsync-hccl."""
