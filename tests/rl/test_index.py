"""The product's index in RL episodes (rl/index.py): a run indexes each task snapshot once with
the product's indexer against the product's app on loopback, an episode's codebase_search
answers from its snapshot's index with exactly what `codeplane agent` shows on that repository,
and a second run or a resume embeds nothing again. Real index, real server, real bwrap
sandboxes; the model is the scripted loopback one."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import make_settings
from helpers import make_repo, require_ray, rl_cli, write_config
from typer.testing import CliRunner

from codeplane.cli import app
from codeplane.core.chat import HttpChatModel
from codeplane.rl.actor import RayEnv
from codeplane.rl.envserver import EnvConfig, EnvServer
from codeplane.rl.index import RunIndex, SearchConfig
from codeplane.rl.rollout import RolloutConfig, RolloutManager, play
from codeplane.rl.run import start_ray
from codeplane.rl.tasks import locate_tasks

QUERY = "where is the area of a circle computed from its radius"
SEARCH_SCRIPT = [{"calls": [("codebase_search", {"query": QUERY})]},
                 {"content": "pkg/shapes.py:8"}]


def index_home(path: Path) -> Path:
    """An index home whose models/ is the test weights (as `RunIndex.open` links the user's)."""
    make_settings(path)
    return path


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """A run's index (the product's app started on loopback by it) of one snapshot."""
    tmp = tmp_path_factory.mktemp("rl-index")
    snapshot = make_repo(tmp / "snapshot")
    index = RunIndex(SearchConfig(home=str(index_home(tmp / "index")))).open()
    reports = index.index([str(snapshot)])
    yield index, snapshot, reports
    index.close()


def search_output(requests: list[dict]) -> str:
    """What the model was shown after its codebase_search call."""
    return next(m["content"] for r in requests for m in r["messages"] if m["role"] == "tool")


def normalised(requests: list[dict]) -> str:
    return re.sub(r"call_[0-9a-f]{24}", "call_*", json.dumps(requests))


def test_an_episode_searches_its_snapshot_as_codeplane_agent_does(indexed, provider,
                                                                  tmp_path) -> None:
    """The same scripted model calls codebase_search through `codeplane agent` on the
    snapshot (indexed the product's way, `codeplane index`, in its own home) and through RL
    episodes on copies of it (in-process, and with the sandbox in a Ray actor): the model
    gets byte-identical requests, the search result included."""
    index, snapshot, _ = indexed
    task = next(t for t in locate_tasks("shapes", snapshot) if t.start == 7)
    home = make_settings(tmp_path / "product").home
    env = {"CODEPLANE_HOME": str(home), "CODEPLANE_SERVER": index.settings.server}
    res = CliRunner().invoke(app, ["index", str(snapshot), "--json"], env=env)
    assert res.exit_code == 0, res.output
    provider.reset().script = list(SEARCH_SCRIPT)
    res = CliRunner().invoke(app, ["agent", task.instruction, "--path", str(snapshot),
                                   "--base-url", provider.url, "--model", "scripted",
                                   "--json"], env=env)
    assert res.exit_code == 0, res.output
    product = list(provider.requests)
    shown = search_output(product)
    assert shown.startswith("pkg/shapes.py:") and "3.14 * self.r ** 2" in shown
    config = RolloutConfig(in_flight=1, group_size=1, groups_per_step=1, max_turns=25,
                           max_tokens=1024, temperature=0.0, hooks="product")
    model = HttpChatModel(provider.url, "scripted")
    provider.reset().script = list(SEARCH_SCRIPT)
    server = EnvServer(EnvConfig(), scratch=str(tmp_path))
    try:
        episode = play(model, server, task, "g", config, services=index.services(task))
    finally:
        server.close()
    assert episode.reward == 1.0
    assert normalised(provider.requests) == normalised(product)
    require_ray()
    start_ray(2)
    import ray

    provider.reset().script = list(SEARCH_SCRIPT)
    manager = RolloutManager(model, [task], config, lambda i: RayEnv(
        EnvConfig(), call_timeout=60, scratch=str(tmp_path)), services=index.services)
    try:
        data = manager.start().collect(0, 0)
    finally:
        manager.stop()
        model.close()
        ray.shutdown()
    assert data.episodes[0].fault is None and data.episodes[0].reward == 1.0
    assert search_output(provider.requests) == shown
    assert normalised(provider.requests) == normalised(product)


def test_snippets_come_from_the_episodes_copy(indexed, provider, tmp_path) -> None:
    """The index is the snapshot's; the text shown is the episode's workspace's (here a copy
    that differs from the snapshot), never read from the snapshot on the host."""
    index, snapshot, _ = indexed
    task = next(t for t in locate_tasks("shapes", snapshot) if t.start == 7)
    copy = tmp_path / "copy"
    shutil.copytree(snapshot, copy)
    shapes = copy / "pkg" / "shapes.py"
    shapes.write_text(shapes.read_text().replace("3.14 * self.r", "EPISODE_COPY * self.r"))
    provider.reset().script = list(SEARCH_SCRIPT)
    server = EnvServer(EnvConfig(), scratch=str(tmp_path))
    try:
        play(HttpChatModel(provider.url, "scripted"), server,
             dataclasses.replace(task, snapshot=str(copy)), "g",
             RolloutConfig(max_turns=3), services=index.services(task))
    finally:
        server.close()
    shown = search_output(provider.requests)
    assert shown.startswith("pkg/shapes.py:") and "EPISODE_COPY" in shown
    assert "3.14 * self.r" not in shown


def test_a_run_indexes_each_snapshot_once_and_a_second_run_embeds_nothing(
        provider, tmp_path) -> None:
    """`codeplane rl train` with two tasks on one snapshot syncs it once (one line in
    index.jsonl), its episodes' codebase_search answers from that index, and the same
    command again (a resume, with its own server on the same home) re-embeds nothing."""
    require_ray()
    make_repo(tmp_path / "repo")
    home = index_home(tmp_path / "index")
    provider.reset().script = [step for _ in range(4) for step in SEARCH_SCRIPT]

    def run(out: str) -> dict:
        config = write_config(tmp_path / f"{out}.toml", f"""
steps = 1
out = "{tmp_path / out}"
trainer_kind = "none"
[tasks]
train_dirs = ["repo"]
[rollout]
in_flight = 1
group_size = 2
groups_per_step = 1
max_turns = 3
transcripts = true
[sampler]
kind = "http"
model = "scripted"
base_url = "{provider.url}"
[search]
home = "{home}"
[ray]
num_cpus = 2
""")
        result = rl_cli(str(config), "--json", env={"CODEPLANE_HOME": str(home)})
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    first = run("first")
    assert len(locate_tasks("repo", tmp_path / "repo")) == 3  # three tasks, one snapshot
    lines = (tmp_path / "first" / "index.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["root"] == str(tmp_path / "repo")
    assert first["index"]["snapshots"] == 1 and first["index"]["chunks_embedded"] > 0
    transcript = next((tmp_path / "first" / "transcripts").glob("*.jsonl"))
    results = [json.loads(x) for x in transcript.read_text().splitlines()]
    found = next(e for e in results if e["type"] == "tool_result")
    assert found["name"] == "codebase_search" and found["output"].startswith("pkg/shapes.py:")
    second = run("second")
    assert second["index"]["snapshots"] == 1
    assert second["index"]["files_changed"] == 0 and second["index"]["chunks_embedded"] == 0


def test_a_snapshot_that_shares_files_reuses_their_embeddings(indexed, tmp_path) -> None:
    """A second snapshot with the same files (another version, a failing-test copy) gets
    its vectors from the embedding cache: one key for the run's home."""
    index, snapshot, reports = indexed
    assert reports[0].chunks_embedded > 0
    again = index.index([str(snapshot)])[0]
    assert again.files_changed == 0 and again.chunks_embedded == 0
    copy = tmp_path / "version2"
    shutil.copytree(snapshot, copy)
    other = index.index([str(copy)])[0]
    assert other.files_changed > 0 and other.chunks_embedded == 0
    assert other.chunks_reused == reports[0].chunks_embedded


@pytest.mark.parametrize(("body", "message"), [
    ("[tasks]\ntrain_dirs = ['a']\n[search]\nserver = 'ftp://example.org'\n",
     "search.server: Value error, \"local\", \"none\" or an http(s) URL"),
    ("[tasks]\ntrain_dirs = ['a']\n[search]\nserver = 'localhost:8300'\n",
     "search.server"),
    ("[tasks]\ntrain_dirs = ['a']\n[search]\nindex = true\n",
     "search.index: Extra inputs are not permitted"),
])
def test_a_bad_search_key_is_a_config_error(tmp_path, body, message) -> None:
    result = rl_cli(str(write_config(tmp_path / "bad.toml", body)), timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_search_server_that_is_down_is_a_clear_error(tmp_path) -> None:
    require_ray()
    make_repo(tmp_path / "repo")
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = write_config(tmp_path / "down.toml", f"""
trainer_kind = "none"
out = "{tmp_path / 'out'}"
[tasks]
train_dirs = ["repo"]
[sampler]
kind = "http"
[search]
server = "{url}"
home = "{index_home(tmp_path / 'index')}"
""")
    result = rl_cli(str(config), env={"CODEPLANE_HOME": str(tmp_path / "index")})
    assert result.returncode == 2, result.stderr
    assert "search.server: cannot index the task snapshots: cannot reach" in result.stderr
    assert "Traceback" not in result.stderr
