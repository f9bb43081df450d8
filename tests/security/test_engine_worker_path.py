"""A model's worker process is a fresh interpreter started by the server: it must import the
server's own code only, never modules planted in the directory the server runs in (a
repository checkout, say). `python -m` puts the working directory first on the module path;
the worker is started with `-P`, which does not."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_settings

from codeplane.models.engine import Engine

pytestmark = pytest.mark.model


def test_modules_in_the_servers_directory_never_run_in_the_worker(tmp_path, monkeypatch):
    marker = tmp_path / "planted-module-ran"
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "llama_cpp.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(repo)
    engine = Engine(make_settings(tmp_path / "home"))
    try:
        assert engine.info("code-small").n_ctx > 0  # the real llama_cpp loaded the model
    finally:
        engine.close()
    assert not marker.exists()
    assert Path.cwd() == repo
