"""weightsync-nccl."""
