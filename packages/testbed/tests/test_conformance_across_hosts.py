"""The conformance suite of every CPU backend with actor ranks on two hosts and each
replica on a host of its own (1 Gbit/s links): every byte and control message crosses
the emulated network."""

from __future__ import annotations

from typing import ClassVar

import pytest

from weightsync_core.testing import CheckpointEngineConformanceTests
from weightsync_testbed.conformance import AcrossHosts

pytestmark = pytest.mark.usefixtures("testbed")


class TestGlooAcrossHosts(AcrossHosts, CheckpointEngineConformanceTests):
    backend = "gloo"


class TestNixlAcrossHosts(AcrossHosts, CheckpointEngineConformanceTests):
    backend = "nixl"
    engine_kwargs: ClassVar[dict] = {"device": "cpu", "ucx_transports": "tcp"}


class TestMooncakeAcrossHosts(AcrossHosts, CheckpointEngineConformanceTests):
    backend = "mooncake"
    engine_kwargs: ClassVar[dict] = {"protocol": "tcp"}


class TestKimiAcrossHosts(AcrossHosts, CheckpointEngineConformanceTests):
    backend = "kimi"
    engine_kwargs: ClassVar[dict] = {"protocol": "tcp", "collective": "gloo"}
