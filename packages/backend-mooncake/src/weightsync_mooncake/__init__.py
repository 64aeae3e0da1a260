"""weightsync-mooncake: the `mooncake` checkpoint-engine backend (not implemented yet)."""

__all__: list[str] = []
