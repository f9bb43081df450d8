"""Environment servers and tasks: real sandboxes (bwrap), the product's own tools, a
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
from codeplane.agent.loop import Agent, HttpChatModel, Transcript
from codeplane.rl.env import EnvConfig, EnvFault, EnvServer
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


def test_env_server_runs_product_tools_in_a_fresh_sandbox(tasks, tmp_path) -> None:
    server = EnvServer(EnvConfig(backend="bwrap"), scratch=str(tmp_path))
    area = next(t for t in tasks if t.start == 7)
    messages = server.reset(area)
    assert messages[0]["role"] == "system" and "pkg/shapes.py" in messages[1]["content"]
    assert {t["function"]["name"] for t in server.tools()} >= {"grep", "read_file"}
    calls = [{"id": "c1", "type": "function", "function": {
                 "name": "grep", "arguments": json.dumps({"pattern": "Compute the area"})}},
             {"id": "c2", "type": "function", "function": {
                 "name": "run_terminal_cmd", "arguments": json.dumps(
                     {"command": "echo hacked > /tmp/x; rm -rf pkg; cat /etc/hostname"})}}]
    out = server.step(calls)
    assert [m["tool_call_id"] for m in out] == ["c1", "c2"]
    assert out[0]["content"].startswith("pkg/shapes.py:8:")
    assert server.env.metadata()["sandboxed"]
    # the episode's copy changed, the task's snapshot did not
    assert (Path(area.snapshot) / "pkg" / "shapes.py").exists()
    assert server.verify("pkg/shapes.py:8") == 1.0
    server.reset(area)  # a fresh copy: the deleted package is back
    assert server.step([{"id": "c3", "type": "function", "function": {
        "name": "read_file", "arguments": json.dumps({"path": "pkg/shapes.py"})}}])[0][
        "content"].count("def perimeter") == 1
    scratch = server.dir
    server.close()
    assert not scratch.exists()


def test_env_server_faults_are_typed(tasks, tmp_path) -> None:
    server = EnvServer(EnvConfig(), scratch=str(tmp_path))
    with pytest.raises(EnvFault) as step_first:
        server.step([])
    assert step_first.value.kind == "sandbox_killed"
    with pytest.raises(EnvFault) as verify_first:
        server.verify("x")
    assert verify_first.value.kind == "verifier_crash"


def test_agent_without_hooks_runs_the_plain_loop_and_says_so(provider, tmp_path) -> None:
    """The invented tool name that the product's call_repair hook turns into a read_file
    call ends a hookless run as its answer; both transcripts record the hooks that ran."""
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
    assert plain.status == "completed" and plain.answer == invented and plain.tool_calls == 0
    assert product.tool_calls == 1  # repaired into read_file
    starts = [json.loads(p.read_text().splitlines()[0]) for _, p in runs.values()]
    assert starts[0]["hooks"] == []
    assert starts[1]["hooks"] == ["preread", "call_repair", "code_block_edit", "corrections"]
    with pytest.raises(UnknownHook, match="available: preread"):
        Agent(HttpChatModel(provider.url, "scripted"), local_environment(repo), hooks=["x"])


def test_env_server_offers_and_runs_only_the_configured_tools(tasks, tmp_path) -> None:
    """`[env] tools` narrows the product's toolset (short prompts for the smoke run): a call
    to a tool it leaves out gets the product's unknown-tool error and runs nothing."""
    server = EnvServer(EnvConfig(tools=("grep", "read_file")), scratch=str(tmp_path))
    assert [t["function"]["name"] for t in server.tools()] == ["grep", "read_file"]
    server.reset(tasks[0])
    out = server.step([{"id": "c1", "type": "function", "function": {
        "name": "run_terminal_cmd", "arguments": json.dumps({"command": "touch pwned"})}}])
    assert "run_terminal_cmd" in out[0]["content"] and "grep" in out[0]["content"]
    assert not (server.dir / "repo" / "pwned").exists()
    server.close()
    with pytest.raises(ValueError, match="unknown tool.*nope"):
        EnvConfig(tools=("grep", "nope"))
