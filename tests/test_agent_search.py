"""What the agent is told about finding code: the system prompt names codebase_search only
when the tool is offered, and a search or grep hit, like a refused edit, spells out the
read_file call that must come before edit_file. Prompts are checked on the requests a scripted
loopback model receives; search runs against a real index on a loopback server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import LiveServer, free_port, make_settings
from upstreams.scripted import ScriptedModel

from codeplane.agent import toolset as T
from codeplane.agent.env import Environment, local_environment
from codeplane.agent.loop import Agent, AgentConfig
from codeplane.agent.prompts import SEARCH_STEP
from codeplane.agent.services import tool_services
from codeplane.agent.tools import default_toolset
from codeplane.core.chat import HttpChatModel
from codeplane.indexing.sync import sync
from codeplane.server.app import create_app

execute = default_toolset().execute  # one call as the agent makes it

BOOLS = '''"""Parameter types."""


class ParamType:
    name = "param"


class BoolParamType(ParamType):
    """Converts the command line words for true and false to booleans."""

    name = "boolean"

    def convert(self, value):
        norm = value.strip().lower()
        if norm in {"1", "true", "t", "yes", "y", "on"}:
            return True
        if norm in {"0", "false", "f", "no", "n", "off"}:
            return False
        raise ValueError(f"{value!r} is not a valid boolean")
'''
FILLER = "".join(f"LINE_{n} = {n}\n" for n in range(1, 60))


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "types.py").write_text(BOOLS)
    (root / "consts.py").write_text(FILLER + "TARGET = 'old'\n" + FILLER)
    return root


def call(name: str, args: dict) -> dict:
    return {"calls": [(name, args)]}


def first_system_prompt(provider: ScriptedModel, repo: Path, tools: T.Toolset | None = None,
                        **config) -> str:
    provider.reset().script = [{"content": "nothing to do"}]
    Agent(HttpChatModel(provider.url, "scripted"), local_environment(repo),
          AgentConfig(required_steps=0, **config), toolset=tools).run("look")
    return provider.requests[0]["messages"][0]["content"]


def without_search() -> T.Toolset:
    return T.Toolset(t for t in default_toolset().tools.values()
                     if t.name != "codebase_search")


def test_system_prompt_names_codebase_search_only_when_it_is_offered(scripted, repo) -> None:
    offered = first_system_prompt(scripted, repo)
    assert "find where it is implemented with codebase_search, then read_file the hit" \
        in offered
    assert first_system_prompt(scripted, repo) == offered  # fixed: the KV-cache prefix
    removed = first_system_prompt(scripted, repo, without_search())
    core = first_system_prompt(scripted, repo, toolset="core")  # 8 tools, search among them
    assert "codebase_search" not in removed and core == offered
    assert offered.replace(SEARCH_STEP, "") == removed  # the one difference


def test_unindexed_workspace_keeps_the_prompt_and_the_tool_points_to_grep(
        scripted, repo, settings) -> None:
    """Decided: the prompt depends on the toolset, not on whether this workspace has an
    index (one configuration, one cached prefix); the tool's answer names the fallback."""
    scripted.script = [call("codebase_search", {"query": "where are booleans parsed"}),
                       {"content": "done"}]
    Agent(HttpChatModel(scripted.url, "scripted"), local_environment(repo),
          AgentConfig(), services=tool_services(settings)).run("make 'si' parse as true")
    second = scripted.requests[1]["messages"]
    assert "codebase_search" in second[0]["content"]
    assert second[-1]["content"].startswith("index unavailable:")
    assert "use grep" in second[-1]["content"]


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-search")
    live = LiveServer(create_app(make_settings(tmp / "server-home")), free_port()).start()
    root = tmp / "repo"
    root.mkdir()
    (root / "types.py").write_text(BOOLS)
    (root / "readme.py").write_text('"""How to install and run the command line tool."""\n')
    cfg = make_settings(tmp / "client-home", server=live.url)
    sync(root, cfg)
    yield root, cfg
    live.stop()


def suggested_read(output: str) -> dict:
    """The read_file arguments a hint or refusal names (the JSON after 'read_file ')."""
    match = re.search(r"read_file (\{.*?\})", output)
    assert match, output
    return json.loads(match[1])


def test_search_hit_names_the_read_and_that_read_unlocks_the_edit(indexed) -> None:
    root, cfg = indexed
    env = local_environment(root)
    ctx = T.ToolContext(services=tool_services(cfg), read_before_edit=True)
    hit = execute(env, "codebase_search", {"query": "where are true/false words converted "
                                           "to booleans"}, ctx)
    assert hit.ok and hit.output.startswith("types.py:")
    lines = hit.output.splitlines()
    step = next(i for i, line in enumerate(lines) if line.startswith("[next:"))
    heads = [i for i, line in enumerate(lines) if " (score " in line]
    assert heads[0] == 0 and step < (heads[1:] or [len(lines)])[0]  # ends the top hit's block
    assert lines[step].startswith("[next: to change types.py, call read_file {")
    top = "\n".join(lines[:step + 1])
    cut = execute(env, "codebase_search", {"query": "where are true/false words converted "
                                           "to booleans"}, ctx, max_chars=len(top) + 40)
    assert cut.truncated and top in cut.output  # a long result is cut after it, not before
    args = suggested_read(top)
    assert args["path"] == "types.py" and args["start_line"] >= 1
    assert execute(env, "read_file", args, ctx).ok
    edit = {"path": "types.py", "old_string": '"yes", "y", "on"}',
            "new_string": '"yes", "y", "on", "si"}'}
    assert execute(env, "edit_file", edit, ctx).output.startswith("edited types.py")
    again = execute(env, "codebase_search", {"query": "boolean words"}, ctx)
    assert "[next:" not in again.output  # read already: nothing to add


def test_grep_hit_names_the_read_until_the_file_is_read(repo) -> None:
    env, ctx = local_environment(repo), T.ToolContext(read_before_edit=True)
    out = execute(env, "grep", {"pattern": "TARGET"}, ctx).output
    assert out == ('consts.py:60:TARGET = \'old\'\n[next: to change consts.py, call read_file '
                   '{"path": "consts.py", "start_line": 40, "end_line": 80} first; edit_file '
                   'needs the file read in this run, and a search hit is not a read]')
    execute(env, "read_file", suggested_read(out), ctx)
    assert execute(env, "grep", {"pattern": "TARGET"}, ctx).output == "consts.py:60:TARGET = 'old'"
    unguarded = T.ToolContext(read_before_edit=False)  # no rule, no hint
    assert execute(env, "grep", {"pattern": "TARGET"}, unguarded).output == \
        "consts.py:60:TARGET = 'old'"


def test_grep_next_step_survives_truncation(repo) -> None:
    (repo / "many.py").write_text("".join(f"HIT_{n} = {n}\n" for n in range(300)))
    res = execute(local_environment(repo), "grep", {"pattern": "HIT_", "path": "many.py"},
                  T.ToolContext(read_before_edit=True), max_chars=500)
    assert res.truncated
    assert res.output.splitlines()[:2] == [
        "many.py:1:HIT_0 = 0", ('[next: to change many.py, call read_file {"path": "many.py", '
                                '"start_line": 1, "end_line": 21} first; edit_file needs the '
                                'file read in this run, and a search hit is not a read]')]


def test_refused_edit_names_the_read_around_old_string(repo) -> None:
    env, ctx = local_environment(repo), T.ToolContext(read_before_edit=True)
    edit = {"path": "consts.py", "old_string": "TARGET = 'old'", "new_string": "TARGET = 'new'"}
    refused = execute(env, "edit_file", edit, ctx)
    assert refused.output == ('error: read consts.py with read_file first: call read_file '
                              '{"path": "consts.py", "start_line": 40, "end_line": 80}, then '
                              'copy old_string exactly from its output')
    assert execute(env, "read_file", suggested_read(refused.output), ctx).ok
    assert execute(env, "edit_file", edit, ctx).ok
    assert "TARGET = 'new'" in (repo / "consts.py").read_text()
    guess = execute(env, "edit_file", {"path": "types.py", "old_string": "no such text",
                                       "new_string": "x"}, ctx)
    assert suggested_read(guess.output) == {"path": "types.py", "start_line": 1,
                                            "end_line": 400}


def test_codebase_search_reads_no_settings_from_disk(indexed, monkeypatch) -> None:
    """The tool searches with the service its caller built from settings once; a call on a
    toolset without one reads no config from disk, even where the environment names a home
    whose index and server would answer."""
    root, cfg = indexed
    monkeypatch.setenv("CODEPLANE_HOME", str(cfg.home))
    monkeypatch.setenv("CODEPLANE_SERVER", cfg.server)
    found = execute(local_environment(root), "codebase_search",
                    {"query": "where are true/false words converted"})
    assert found.output.startswith("index unavailable:") and "use grep" in found.output
    assert found.data == {"available": False}


class Overlay:
    """A workspace whose files are not the host's files at its root (as in a copy-on-write
    sandbox, a VM guest or an RL actor's sandbox): `layer` holds what it shows instead."""

    def __init__(self, inner, layer: dict[str, bytes]) -> None:
        self.inner, self.layer, self.root = inner, layer, inner.root

    def read(self, path: Path, max_bytes: int) -> bytes:
        rel = str(self.real(path).relative_to(self.root))
        return self.layer[rel] if rel in self.layer else self.inner.read(path, max_bytes)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_codebase_search_snippets_come_through_the_workspace(indexed) -> None:
    """Snippets are read through `env.workspace`, never from the host path at its root."""
    root, cfg = indexed
    shown = BOOLS.replace("Converts the command line words", "WORKSPACE VIEW: converts words")
    env = local_environment(root)
    env = Environment(Overlay(env.workspace, {"types.py": shown.encode()}), env.limits)
    hit = execute(env, "codebase_search", {"query": "where are true/false words converted"},
                  T.ToolContext(services=tool_services(cfg)))
    assert hit.ok and hit.output.startswith("types.py:")
    assert "WORKSPACE VIEW" in hit.output and "Converts the command line" not in hit.output
