"""Benchmarks of the engines, each against its raw transport or against the others.

- :mod:`weightsync_core.bench.gloo`: the ``gloo`` engine against raw gloo broadcast and the
  Ray object store (``weightsync bench gloo``);
- :mod:`weightsync_core.bench.ring`: a ring engine (``nixl``, ``mooncake``) to 1 and to N
  rollout workers against one raw write of its transport (``weightsync bench nixl``);
- :mod:`weightsync_core.bench.compare`: several backends on the same deployment and bytes
  (``weightsync compare``);
- :mod:`weightsync_core.bench.measure`: what they share (a deployment holding synthetic
  weights, warm-up, alternating timed rounds, medians, result rows).
"""
