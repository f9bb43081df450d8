"""The README's main job: `codeplane quickstart` end to end, as a user runs it."""

import os
import subprocess
import sys

from conftest import make_settings


def test_quickstart_shows_fim_and_tool_call(tmp_path):
    home = make_settings(tmp_path / "home").home
    proc = subprocess.run([sys.executable, "-m", "codeplane", "quickstart"], check=False,
                          env={**os.environ, "CODEPLANE_HOME": str(home), "COLUMNS": "120"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "server up at http://127.0.0.1:" in out
    assert "FIM completion by code-small" in out and "text[::-1]" in out
    assert "tool call by code-medium" in out and '"name": "get_weather"' in out
