"""The packaged configs of ``weightsync-train`` (Hydra's ``pkg://weightsync_trainer.conf``):
``ppo_trainer.yaml``, the defaults, at verl's key paths."""
