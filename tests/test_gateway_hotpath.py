"""What the gateway's latency work changed keeps its guarantees: the objects built at start-up
are out of the garbage collector's full scans (the 200+ ms stalls that were the p99 at
500 rps), without weakening the auth gate."""

from __future__ import annotations

import gc

from conftest import make_settings
from fastapi.testclient import TestClient

from codeplane.models.engine import Engine
from codeplane.server.app import create_app


def test_startup_objects_are_frozen_out_of_full_collections(tmp_path):
    """Once the server has started, the app and its services sit in the permanent generation,
    so a full collection no longer walks them; what requests allocate later is still
    collected."""
    gc.unfreeze()
    settings = make_settings(tmp_path / "home")
    app = create_app(settings, engine=Engine(settings))
    try:
        with TestClient(app):
            assert gc.get_freeze_count() > 0
            tracked = {id(o) for o in gc.get_objects()}
            assert id(app.state.services) not in tracked
            assert id(app.state.services.gateway) not in tracked
            cycle: list = []
            cycle.append(cycle)
            assert id(cycle) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
