"""weightsync-trainer."""
