"""weightsync-trainer: a Ray RL trainer built on weightsync (not implemented yet)."""

__all__: list[str] = []
