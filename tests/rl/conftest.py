"""Fixtures of the RL tests: the scripted OpenAI-compatible model on loopback."""

from __future__ import annotations

import pytest
from upstreams.scripted import ScriptedModel


@pytest.fixture(scope="module")
def provider():
    p = ScriptedModel()
    p.server.start()
    yield p
    p.server.stop()
