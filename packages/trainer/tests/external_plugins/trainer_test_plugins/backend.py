"""A custom backend named only in ``custom_backend_module``: gloo under another name."""

from weightsync_core import CheckpointEngineRegistry

GlooCheckpointEngine = CheckpointEngineRegistry.get("gloo")


@CheckpointEngineRegistry.register("trainer_test_gloo")
class TrainerTestGlooEngine(GlooCheckpointEngine):
    """Gloo registered by a module outside the project."""
