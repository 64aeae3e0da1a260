"""Errors raised by the trainer."""

from __future__ import annotations

__all__ = ["ConfigError", "NoLoadBalancerError"]


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key and the fix."""


class NoLoadBalancerError(RuntimeError):
    """An :class:`~weightsync_trainer.llm_server.LLMServerClient` was asked to route a request
    but has neither a load balancer nor its own routing."""
