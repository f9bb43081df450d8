"""Environment servers and tasks: real sandboxes (bwrap) the product's own tools run in, a
verifier over tasks made from real code; and the agent loop's switchable hooks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_repo

from codeplane.agent.env import local_environment
from codeplane.agent.hooks import UnknownHook
from codeplane.agent.loop import Agent, Transcript
from codeplane.agent.tools import default_toolset
from codeplane.core.chat import HttpChatModel
from codeplane.rl.envserver import EnvConfig, EnvFault, EnvServer
from codeplane.rl.tasks import locate_tasks, sample_tasks, score


@pytest.fixture
def tasks(tmp_path: Path):
    return locate_tasks("shapes", make_repo(tmp_path / "shapes"))


def test_tasks_from_documented_definitions_with_exact_spans(tasks) -> None:
    by_path = {(t.path, t.start, t.end) for t in tasks}
    assert by_path == {("pkg/shapes.py", 1, 9), ("pkg/shapes.py", 7, 9),
                       ("pkg/shapes.py", 12, 14)}  # __init__ has no docstring: no task
    area = next(t for t in tasks if t.start == 7)
    assert "Compute the area of the circle from its radius." in area.instruction
    assert [t.id for t in sample_tasks(tasks, 2, 1)] == [t.id for t in sample_tasks(tasks, 2, 1)]


def test_score_full_partial_and_zero(tasks) -> None:
    area = next(t for t in tasks if t.start == 7)
    assert score(area, "It is in pkg/shapes.py:8") == 1.0
    assert score(area, "first pkg/shapes.py:13, no wait: ./pkg/shapes.py:9") == 1.0
    assert score(area, "pkg/shapes.py:13") == 0.5  # right file, another definition
    assert score(area, "pkg/__init__.py:1") == 0.0
    assert score(area, "the area method") == 0.0


def test_env_server_opens_a_fresh_sandbox_the_product_tools_run_in(tasks, tmp_path) -> None:
    server = EnvServer(EnvConfig(backend="bwrap"), scratch=str(tmp_path))
    area = next(t for t in tasks if t.start == 7)
    env = server.open(area)
    tools = default_toolset()
    hit = tools.execute(env, "grep", {"pattern": "Compute the area"})
    assert hit.output.startswith("pkg/shapes.py:8:")
    hacked = tools.execute(env, "run_terminal_cmd", {
        "command": "echo hacked > /tmp/x; rm -rf pkg; cat /etc/hostname"})
    assert hacked.data["sandboxed"] and env.metadata()["sandboxed"]
    # the episode's copy changed, the task's snapshot did not
    assert (Path(area.snapshot) / "pkg" / "shapes.py").exists()
    assert server.verify("pkg/shapes.py:8") == 1.0
    env = server.open(area)  # a fresh copy: the deleted package is back
    assert tools.execute(env, "read_file", {"path": "pkg/shapes.py"}).output.count(
        "def perimeter") == 1
    scratch = server.dir
    server.close()
    assert not scratch.exists()


def test_env_server_faults_are_typed(tasks, tmp_path) -> None:
    server = EnvServer(EnvConfig(), scratch=str(tmp_path))
    with pytest.raises(EnvFault) as call_first:
        server.workspace("list", Path("."))
    assert call_first.value.kind == "sandbox_killed"
    with pytest.raises(EnvFault) as verify_first:
        server.verify("x")
    assert verify_first.value.kind == "verifier_crash"
    server.reset(tasks[0])
    with pytest.raises(ValueError, match="no workspace call 'close'"):
        server.workspace("close")  # only the Workspace calls of the tools get through
    server.close()


def test_agent_without_hooks_runs_the_plain_loop_and_says_so(provider, tmp_path) -> None:
    """The invented tool name that the product's call_repair hook turns into a read_file
    call gets only the loop's own hint in a hookless run (a call written as text is never
    an answer); both transcripts record the hooks that ran."""
    repo = make_repo(tmp_path / "repo")
    invented = '{"name": "open_shapes", "arguments": {"path": "pkg/shapes.py", "start_line": 1}}'
    runs = {}
    for hooks in ((), None):
        provider.reset().script = [{"content": invented}, {"content": "done"}]
        transcript = Transcript(tmp_path / f"{hooks}.jsonl")
        kwargs = {} if hooks is None else {"hooks": hooks}
        agent = Agent(HttpChatModel(provider.url, "scripted"), local_environment(repo),
                      on_event=transcript, **kwargs)
        agent.config.required_steps = 0
        runs[hooks] = (agent.run("what is in pkg/shapes.py?"), transcript.path)
        transcript.close()
    plain, product = runs[()][0], runs[None][0]
    assert plain.status == "completed" and plain.answer == "done" and plain.tool_calls == 0
    assert product.tool_calls == 1  # repaired into read_file
    plain_events = [json.loads(x) for x in runs[()][1].read_text().splitlines()]
    hint = next(e for e in plain_events if e["type"] == "user_message")["content"]
    assert hint.startswith("error: open_shapes is not a tool")
    starts = [json.loads(p.read_text().splitlines()[0]) for _, p in runs.values()]
    assert starts[0]["hooks"] == []
    assert starts[1]["hooks"] == ["preread", "call_repair", "code_block_edit", "corrections"]
    with pytest.raises(UnknownHook, match="available: preread"):
        Agent(HttpChatModel(provider.url, "scripted"), local_environment(repo), hooks=["x"])
