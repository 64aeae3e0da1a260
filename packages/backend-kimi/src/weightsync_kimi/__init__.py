"""weightsync-kimi: the `kimi` checkpoint-engine backend for weightsync (not implemented yet)."""

__all__: list[str] = []
