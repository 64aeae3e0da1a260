"""weightsync-mooncake."""
