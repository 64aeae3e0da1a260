"""weightsync-kimi."""
