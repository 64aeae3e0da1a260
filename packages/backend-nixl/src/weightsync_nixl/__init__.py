"""weightsync-nixl."""
