"""Settings: TOML file, environment overrides, and errors that name the key and line."""

from pathlib import Path

import pytest

from codeplane.config import ConfigError, load_settings
from codeplane.gateway.providers.table import PROVIDERS


def test_defaults_and_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("CODEPLANE_HOME", str(tmp_path))
    cfg = load_settings()
    assert cfg.home == tmp_path
    assert cfg.server == "http://127.0.0.1:8300"
    assert (cfg.models_dir, cfg.server_dir, cfg.client_dir) == (
        tmp_path / "models", tmp_path / "server", tmp_path / "client")


def test_toml_then_environment_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("CODEPLANE_HOME", str(tmp_path))
    (tmp_path / "codeplane.toml").write_text(
        '[serve]\nport = 9001\nhost = "0.0.0.0"\n[engine]\nn_ctx = 4096\n')
    cfg = load_settings()
    assert (cfg.serve.port, cfg.serve.host, cfg.engine.n_ctx) == (9001, "0.0.0.0", 4096)
    monkeypatch.setenv("CODEPLANE_SERVE__PORT", "9002")
    monkeypatch.setenv("CODEPLANE_SERVER", "http://10.0.0.5:8300")
    cfg = load_settings()
    assert cfg.serve.port == 9002 and cfg.server == "http://10.0.0.5:8300"


def test_explicit_config_file(tmp_path):
    path = tmp_path / "other.toml"
    path.write_text("[engine]\ndefault_model = 'code-medium'\n")
    assert load_settings(path, home=tmp_path).engine.default_model == "code-medium"
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "missing.toml")


def test_invalid_value_names_key_and_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[serve]\nhost = 'x'\nport = 70000\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, home=tmp_path)
    assert "serve.port (line 3)" in str(info.value)


def test_unknown_key_and_bad_toml_are_reported(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[engine]\nn_cxt = 10\n")
    with pytest.raises(ConfigError, match=r"engine.n_cxt \(line 2\)"):
        load_settings(path, home=tmp_path)
    path.write_text("[engine\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_settings(path, home=Path(tmp_path))


def test_server_policy_settings_are_validated(tmp_path, monkeypatch):
    monkeypatch.setenv("CODEPLANE_HOME", str(tmp_path))
    (tmp_path / "codeplane.toml").write_text(
        '[serve]\ntrusted_proxies = ["10.0.0.0/8", "::1"]\nmax_body_bytes = 65536\n'
        'public_metrics = true\nproxy_header = "forwarded"\n')
    cfg = load_settings()
    assert cfg.serve.trusted_proxies == ["10.0.0.0/8", "::1"]
    assert (cfg.serve.max_body_bytes, cfg.serve.public_metrics) == (65536, True)
    (tmp_path / "codeplane.toml").write_text(
        '[serve]\ntrusted_proxies = ["proxy.lan"]\nproxy_header = "x-real-ip"\n')
    with pytest.raises(ConfigError, match="proxy.lan"):
        load_settings()
    (tmp_path / "codeplane.toml").write_text('[serve]\nmax_body_bytes = 10\n')
    with pytest.raises(ConfigError, match="max_body_bytes"):
        load_settings()


def test_bad_tab_and_gateway_values_fail_at_load_naming_the_section(tmp_path):
    """Checked when settings load, so no server (and no client command) starts on them."""
    with pytest.raises(ConfigError, match=r"\[tab\]"):
        load_settings(home=tmp_path, tab={"max_tokens": 0})
    with pytest.raises(ConfigError, match="gateway"):
        load_settings(home=tmp_path, gateway={"auth": "maybe"})


def test_fleet_background_and_agent_sections_are_validated_at_load(tmp_path):
    path = tmp_path / "c.toml"
    for text, where in (("[fleet]\npool_size = 1\nmax_per_tenant = 0\n", "fleet.max_per_tenant"),
                        ("[background]\npatch_bytes = 1\ndif_bytes = 1\n", "background.dif_bytes"),
                        ('[agent]\nmodel = "mine"\napply_modle = "x"\n', "agent.apply_modle")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"{where} \(line 3\)"):
            load_settings(path, home=tmp_path)
    path.write_text('[fleet]\npool_size = 0\n[background]\ndiff_bytes = 7\n[agent]\nmodel = "mine"\n')
    cfg = load_settings(path, home=tmp_path)
    assert (cfg.fleet.pool_size, cfg.fleet.max_per_tenant) == (0, 16)
    assert (cfg.background.diff_bytes, cfg.background.patch_bytes) == (7, 16 << 20)
    assert (cfg.agent.model, cfg.agent.apply_model) == ("mine", "code-small")


def test_indexing_section_is_validated_at_load_and_keeps_its_defaults(tmp_path):
    path = tmp_path / "c.toml"
    for text, where in (("[indexing]\nbatch_chunks = 4\nsync_intreval = 60\n",
                         "indexing.sync_intreval"),
                        ('[indexing]\nbatch_chunks = 4\nembed = "cloud"\n', "indexing.embed"),
                        ("[indexing]\nbatch_chunks = 4\nembed_concurrency = 0\n",
                         "indexing.embed_concurrency")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"{where} \(line 3\)"):
            load_settings(path, home=tmp_path)
    path.write_text("[indexing]\nbatch_chunks = 4\n")
    cfg = load_settings(path, home=tmp_path).indexing
    assert cfg.batch_chunks == 4
    # the defaults each reader wrote where it read the key, before the section was typed
    assert (cfg.sync_interval, cfg.max_file_bytes, cfg.key_file, cfg.fusion, cfg.embed) == (
        180.0, 1_000_000, None, "hybrid", "server")
    assert (cfg.lancedb_uri, cfg.ann_min_rows, cfg.max_workspaces_per_tenant) == ("", 20_000, 100)
    assert (cfg.embed_concurrency, cfg.embed_wait, cfg.embedder) == (2, 60.0, {})


def test_models_router_gateway_and_tab_are_validated_at_load(tmp_path):
    """A misspelled key in any of the four sections fails when settings load (`[[models]]`'s
    by the provider table the program's root hands over), named with its line; inside a
    section its own line, not the same key's line in another section."""
    path = tmp_path / "c.toml"
    first = '[[models]]\nname = "a"\nprovider = "openai"\nbase_url = "http://x/v1"\n\n'
    for text, where in (
            (first + '[[models]]\nname = "b"\nprovider = "local"\nmax_paralel = 2\n',
             r"models\.1\.max_paralel \(line 9\)"),
            ('[router]\ncooldown_s = 1\nretires = 3\n', r"router\.retires \(line 3\)"),
            ('[gateway]\nauth = "on"\nip_rmp = 5\n', r"gateway\.ip_rmp \(line 3\)"),
            ('[router]\ncooldown_s = 1\n[gateway]\nauth = "on"\ncooldown_s = 2\n',
             r"gateway\.cooldown_s \(line 5\)"),
            ('[tab]\nmodel = "code-small"\nmax_token = 8\n', r"tab\.max_token \(line 3\)"),
            ('[tab]\nmax_tokens = 8\n[agent]\nmodel = "x"\nmax_tokens = 0\n',
             r"agent\.max_tokens \(line 5\)")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=where):
            load_settings(path, home=tmp_path, providers=PROVIDERS)
    path.write_text(first + '[router]\ncooldown_s = 1\n[gateway]\nauth = "on"\n'
                    '[tab]\nmax_tokens = 8\n')
    cfg = load_settings(path, home=tmp_path, providers=PROVIDERS)
    assert (cfg.models[0].provider, cfg.models[0].base_url) == ("openai", "http://x/v1")
    assert (cfg.router.cooldown_s, cfg.router.allowed_fails) == (1.0, 3)
    assert (cfg.gateway.auth, cfg.gateway.queue["batch"]) == ("on", 32)
    assert (cfg.tab.max_tokens, cfg.tab.model, cfg.tab.model_fields_set) == (
        8, "code-small", {"max_tokens"})
    assert load_settings(home=tmp_path).tab.model_fields_set == set()  # no [tab]: no preload


def test_a_command_shows_the_bad_section_as_the_file_writes_it(tmp_path, monkeypatch):
    """The message goes through rich: `[tab]` and `[[models]]` are text, not markup."""
    from typer.testing import CliRunner

    from codeplane.cli import app

    monkeypatch.setenv("CODEPLANE_HOME", str(tmp_path))
    (tmp_path / "codeplane.toml").write_text(
        '[[models]]\nname = "a"\nprovider = "local"\nrpn = 3\n[tab]\nmax_tokenz = 3\n')
    result = CliRunner().invoke(app, ["keys", "list"])
    assert result.exit_code == 2
    assert "invalid settings in [[models]], [tab] (" in result.output
    assert "models.0.rpn (line 4)" in result.output
    assert "tab.max_tokenz (line 6)" in result.output
