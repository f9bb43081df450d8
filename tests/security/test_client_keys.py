"""Client commands against a server that requires keys (audit 2026-11-28, L4): `codeplane
index` and `codeplane search` send `CODEPLANE_API_KEY` (or `--api-key`), as `codeplane agents`
and `codeplane gateway status` do, so nobody has to run a server without keys to index.
Real server on loopback (`auth = "on"`), real CLI (Typer's runner), real index and search."""

from __future__ import annotations

import json

import pytest
from conftest import LiveServer, free_port, make_settings
from typer.testing import CliRunner

from codeplane.cli import app
from codeplane.gateway.keys import KeyStore
from codeplane.server.app import create_app


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("keyed") / "home", gateway={"auth": "on"})
    _, secret = KeyStore.from_settings(settings).create("ci", tenant="acme")
    server = LiveServer(create_app(settings), free_port()).start()
    yield server, secret
    server.stop()


@pytest.fixture
def client_env(tmp_path, keyed):
    """A client machine: its own home, the server's URL, no key yet."""
    server, _ = keyed
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "billing.py").write_text("def monthly_invoice_total(lines):\n"
                                     "    return sum(line.amount for line in lines)\n")
    env = {"CODEPLANE_HOME": str(tmp_path / "client-home"), "CODEPLANE_SERVER": server.url,
           "CODEPLANE_API_KEY": ""}
    return repo, env


def run(args: list[str], env: dict):
    return CliRunner().invoke(app, args, env=env)


def test_index_and_search_send_the_key_from_the_environment(keyed, client_env):
    _, secret = keyed
    repo, env = client_env
    refused = run(["index", str(repo), "--json"], env)
    assert refused.exit_code == 2 and "API key" in refused.output, refused.output
    keyed_env = {**env, "CODEPLANE_API_KEY": secret}
    indexed = run(["index", str(repo), "--json"], keyed_env)
    assert indexed.exit_code == 0, indexed.output
    assert json.loads(indexed.output)["files_scanned"] == 1
    found = run(["search", "sum of the invoice amounts", "--root", str(repo), "--json"],
                keyed_env)
    assert found.exit_code == 0, found.output
    assert json.loads(found.output)[0]["path"] == "billing.py"
    assert run(["search", "invoice", "--root", str(repo), "--json"], env).exit_code == 2


def test_the_api_key_option_works_too(keyed, client_env):
    _, secret = keyed
    repo, env = client_env
    result = run(["index", str(repo), "--json", "--api-key", secret], env)
    assert result.exit_code == 0, result.output
    status = run(["gateway", "status", "--json", "--api-key", secret], env)
    assert status.exit_code == 0 and "models" in json.loads(status.output)
    runs = run(["agents", "list", "--json"], {**env, "CODEPLANE_API_KEY": secret})
    assert runs.exit_code == 0, runs.output
