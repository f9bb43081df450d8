"""The agent loop. Loop mechanics run against a scripted OpenAI-compatible provider on
loopback (a stand-in for a frontier provider URL); the end-to-end runs use the real local
model through the real server, sandbox included."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from upstreams.scripted import ScriptedModel, caller, run_server, wait_end

from codeplane.agent.env import local_environment
from codeplane.agent.loop import Agent, AgentConfig, StepOutcome, Transcript
from codeplane.core.chat import HttpChatModel


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    (root / "a.py").write_text("A = 1\n")
    (root / "b.py").write_text("B = 2\n")
    return root


def agent_for(provider: ScriptedModel, repo: Path, **config) -> Agent:
    model = HttpChatModel(provider.url, "scripted")
    return Agent(model, local_environment(repo), AgentConfig(**config))


def test_parallel_calls_results_in_call_order_and_transcript(scripted, repo, tmp_path) -> None:
    scripted.script = [
        {"content": "reading", "calls": [("read_file", {"path": "a.py"}),
                                         ("grep", {"pattern": "B ="}),
                                         ("edit_file", {"path": "a.py", "old_string": "A = 1",
                                                        "new_string": "A = 10"}),
                                         ("read_file", {"path": "a.py"})]},
        {"content": "Changed A to 10."}]
    agent = agent_for(scripted, repo)
    transcript = Transcript(tmp_path / "run.jsonl")
    agent.listeners.append(transcript)
    result = agent.run("set A to 10")
    transcript.close()
    assert result.status == "completed" and result.answer == "Changed A to 10."
    assert result.steps == 2 and result.tool_calls == 4
    tool_msgs = [m for m in scripted.requests[1]["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ["call_0", "call_1", "call_2", "call_3"]
    assert tool_msgs[0]["content"].endswith("A = 1")  # read before the edit ...
    assert tool_msgs[1]["content"].startswith("b.py:1:B = 2\n[next: to change b.py, call "
                                              "read_file")
    assert tool_msgs[3]["content"].endswith("A = 10")  # ... and after it, as ordered
    assert scripted.requests[0]["tools"][0]["function"]["name"] == "read_file"
    first = scripted.requests[0]["messages"]
    assert "{" not in first[0]["content"]  # the system prompt is static (KV-cache prefix)
    assert first[1]["content"] == "set A to 10\n\nFiles in the repository:\na.py\nb.py"
    events = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert kinds.count("tool_start") == 4 and kinds.count("tool_result") == 4
    start = events[0]
    assert start["environment"]["sandboxed"] and start["model"] == "scripted"
    assert start["messages"][1]["content"].startswith("set A to 10\n\n")
    assert start["task"] == "set A to 10"
    turn = next(e for e in events if e["type"] == "model_turn")
    assert turn["usage"]["prompt_tokens"] == 100 and turn["seconds"] >= 0
    edit = next(e for e in events if e["type"] == "tool_result" and e["name"] == "edit_file")
    assert "+A = 10" in edit["data"]["diff"]
    assert events[-1]["prompt_tokens"] == 200 and events[-1]["messages"][-1]["content"] == \
        "Changed A to 10."


def test_invented_tool_and_no_tool_replies_get_hints(scripted, repo) -> None:
    scripted.script = [{"content": '{"name": "fix_bug", "arguments": {"path": "a.py"}}'},
                       {"content": "I would edit a.py."},
                       {"content": "Nothing to do."}]
    result = agent_for(scripted, repo, corrections=2).run("fix it")
    assert result.status == "completed" and result.steps == 3
    hints = [m["content"] for m in scripted.requests[2]["messages"] if m["role"] == "user"]
    assert "fix_bug is not a tool" in hints[1] and "not used any tool" in hints[2]


def test_named_files_preread_and_edits_need_a_read(scripted, repo) -> None:
    scripted.script = [{"calls": [("edit_file", {"path": "b.py", "old_string": "B = 2",
                                                 "new_string": "B = 3"}),
                                  ("edit_file", {"path": "a.py", "old_string": "A = 1",
                                                 "new_string": "A = 2"})]},
                       {"calls": [("read_file", {"path": "src/b.py"})]},
                       {"content": "done"}]
    result = agent_for(scripted, repo).run("In a.py set A to 2.")
    assert result.status == "completed"
    first = scripted.requests[0]["messages"]
    assert [m["role"] for m in first] == ["system", "user"]
    assert first[1]["content"].endswith("already read for you (you may edit them):\n\n"
                                        "a.py (lines 1-1 of 1):\nA = 1")
    outs = [m["content"] for m in scripted.requests[1]["messages"] if m["role"] == "tool"]
    assert outs[0].startswith("error: read b.py with read_file first")
    assert outs[1].startswith("edited a.py")  # pre-read counts as read
    assert (repo / "b.py").read_text() == "B = 2\n" and (repo / "a.py").read_text() == "A = 2\n"
    missing = [m["content"] for m in scripted.requests[2]["messages"] if m["role"] == "tool"]
    assert missing[-1] == "error: src/b.py does not exist; did you mean b.py?"
    assert [r["tool_choice"] for r in scripted.requests] == ["required", "auto", "auto"]


def test_code_or_fake_results_instead_of_calls_get_hints(scripted, repo) -> None:
    scripted.script = [{"content": "<tool_response>\nA = 1\n</tool_response>"},
                       {"content": "Fixed:\n```python\nA = 2\n```"},
                       {"content": "Fixed."}]
    result = agent_for(scripted, repo, corrections=2).run("set A to 2")
    assert result.status == "completed" and result.steps == 3
    hints = [m["content"] for m in scripted.requests[2]["messages"] if m["role"] == "user"]
    assert "Do not write <tool_call> or <tool_response>" in hints[1]
    assert "You showed code, but no file has changed" in hints[2]
    assert [r["tool_choice"] for r in scripted.requests] == ["required", "auto", "required"]


FAKE_RESULT = "<tool_response>\na.py (lines 1-1 of 1):\nA = 1\n</tool_response>"
INVENTED = '{"name": "fix_bug", "arguments": {"path": "a.py"}}'


@pytest.mark.parametrize("hooks", [(), None], ids=["no hooks", "product hooks"])
@pytest.mark.parametrize(("reply", "hint"), [(FAKE_RESULT, "Do not write <tool_call>"),
                                             (INVENTED, "error: fix_bug is not a tool")],
                         ids=["fake result", "call as text"])
def test_markup_is_never_the_answer(scripted, repo, hooks, reply, hint) -> None:
    """A reply that imitates a tool result, or is a call of no tool written as text, gets a
    hint with or without the hooks; one that keeps doing so once the hints are used up ends
    the run `malformed`, never `completed` with the markup as its answer."""
    scripted.script = [{"content": reply}] * 4
    kwargs = {} if hooks is None else {"hooks": hooks}
    agent = Agent(HttpChatModel(scripted.url, "scripted"), local_environment(repo),
                  AgentConfig(required_steps=0), **kwargs)
    result = agent.run("what is A?")
    assert result.status == "malformed" and result.answer == "" and result.steps == 4
    hints = [m["content"] for m in scripted.requests[-1]["messages"] if m["role"] == "user"]
    assert len(hints) == 4 and all(h.startswith(hint) for h in hints[1:])


def test_a_call_written_as_text_runs_without_hooks(scripted, repo) -> None:
    """A provider that does not parse the Hermes format sends the call as text: the
    product's tool-call parser finds it, it runs, and the history shows it as a call."""
    tagged = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    scripted.script = [{"content": tagged}, {"content": "A is 1."}]
    agent = Agent(HttpChatModel(scripted.url, "scripted"), local_environment(repo), hooks=())
    events: list[dict] = []
    agent.listeners.append(events.append)
    result = agent.run("what is A?")
    assert result.status == "completed" and result.answer == "A is 1." and result.tool_calls == 1
    assert next(e for e in events if e["type"] == "call_repair")["hook"] == "parser"
    second = scripted.requests[1]["messages"]
    assert second[-2]["content"] == "" and second[-2]["tool_calls"][0]["function"] == {
        "name": "read_file", "arguments": '{"path": "a.py"}'}
    assert second[-1]["content"] == "a.py (lines 1-1 of 1):\nA = 1"


def test_the_answer_turn_is_asked_without_tools_and_runs_no_call(scripted, repo) -> None:
    scripted.script = [{"calls": [("list_dir", {})]}, {"content": "a.py and b.py"}]
    result = agent_for(scripted, repo, max_steps=2, answer_turn=True).run("list the files")
    assert [r["tool_choice"] for r in scripted.requests] == ["required", "none"]
    assert result.status == "completed" and result.answer == "a.py and b.py"
    scripted.reset().script = [{"calls": [("list_dir", {})]}] * 2
    result = agent_for(scripted, repo, max_steps=2, answer_turn=True).run("list the files")
    assert result.status == "malformed" and result.tool_calls == 1  # its call did not run


@pytest.mark.parametrize("reply", [
    '{"name": "read_file", "arguments": {"path": "a.py"}}\n{"name": "run_terminal_cmd", "argu',
    '{"name": "read_file", "arguments": {"path": "a.'], ids=["calls then a cut one", "cut call"])
def test_calls_cut_off_by_the_token_limit_are_no_answer(scripted, repo, reply) -> None:
    """Calls written as text whose last one the token limit cut off (code-small on an answer
    turn) are markup, not an answer: taken as one, a reward that scores the files an answer
    names would pay for the paths in the calls."""
    scripted.script = [{"calls": [("list_dir", {})]}, {"content": reply}]
    result = agent_for(scripted, repo, max_steps=2, answer_turn=True).run("which file holds A?")
    assert result.status == "malformed" and result.answer == ""


def test_the_loop_is_steppable(scripted, repo) -> None:
    """What `run` does, a turn at a time (how an RL rollout drives the product's loop)."""
    scripted.script = [{"calls": [("list_dir", {})]}, {"content": "Two files."}]
    agent = agent_for(scripted, repo, max_steps=3)
    agent.start("how many files are there?")
    assert [m["role"] for m in agent.messages] == ["system", "user"]
    assert agent.step() == StepOutcome() and agent.messages[-1]["role"] == "tool"
    assert agent.step() == StepOutcome("completed", "Two files.")
    agent.close()
    result = agent.finish("completed", "Two files.")
    assert result.steps == 2 and result.tool_calls == 1
    assert agent.messages[-1] == {"role": "assistant", "content": "Two files."}


def test_invented_tool_name_with_fitting_arguments_is_repaired(scripted, repo) -> None:
    scripted.script = [
        {"content": '{"name": "show_a", "arguments": {"path": "a.py", "start_line": 1}}'},
        {"content": '{"name": "set_b", "arguments": {"path": "b.py", "content": "B = 3"}}'},
        {"content": '{"name": "look", "arguments": {"path": "a.py"}}'},  # fits 4 tools
        {"content": "done"}]
    result = agent_for(scripted, repo).run("show A")
    second = scripted.requests[1]["messages"]
    assert second[-2]["tool_calls"][0]["function"]["name"] == "read_file"
    assert second[-1]["content"] == "a.py (lines 1-1 of 1):\nA = 1"
    overwrite = scripted.requests[2]["messages"][-1]["content"]
    assert overwrite.startswith("error: b.py already exists; read it with read_file first")
    assert (repo / "b.py").read_text() == "B = 2\n"
    assert "look is not a tool" in scripted.requests[3]["messages"][-1]["content"]
    assert result.tool_calls == 2 and result.answer == "done"


def test_code_block_for_a_read_file_is_applied_as_an_edit(scripted, repo) -> None:
    (repo / "text.py").write_text('"""Text helpers."""\n\n\ndef rev(s):\n    return s[::-1]\n')
    fixed = "def rev(s):\n    return ' '.join(s.split()[::-1])\n"
    scripted.script = [{"content": f"Here is the fix:\n```python\n{fixed}```"},
                       {"content": f"Again:\n```python\n{fixed}```"}, {"content": "Done."}]
    result = agent_for(scripted, repo).run("rev in text.py should reverse the words")
    assert (repo / "text.py").read_text() == '"""Text helpers."""\n\n\n' + fixed
    edit = scripted.requests[1]["messages"][-2]["tool_calls"][0]["function"]
    assert edit["name"] == "edit_file" and json.loads(edit["arguments"])["path"] == "text.py"
    assert scripted.requests[1]["messages"][-1]["content"].startswith("edited text.py")
    # once a file changed, code in a reply is an answer, not another edit
    assert result.answer.startswith("Again:") and result.tool_calls == 1


def test_javascript_code_block_for_a_named_file_is_applied(scripted, repo) -> None:
    broken = "function total(xs) {\n  let s = 0;\n  for (const x of xs) {\n    s += x;\n" \
             "\n  return s;\n}\n\nmodule.exports = { total };\n"
    (repo / "index.js").write_text(broken)
    fixed = broken.replace("    s += x;\n\n", "    s += x;\n  }\n")
    scripted.script = [{"calls": [("read_lints", {"paths": ["index.js"]})]},
                       {"content": f"Add the brace:\n```javascript\n{fixed}```"},
                       {"content": "Added the missing brace."}]
    result = agent_for(scripted, repo).run("index.js has a syntax error. Fix it.")
    assert (repo / "index.js").read_text() == fixed
    assert result.answer == "Added the missing brace." and result.tool_calls == 2


def test_empty_reply_after_work_gets_a_hint(scripted, repo) -> None:
    scripted.script = [{"calls": [("list_dir", {})]}, {"content": ""}, {"content": "Listed."}]
    result = agent_for(scripted, repo).run("list the files")
    assert result.status == "completed" and result.answer == "Listed."
    assert scripted.requests[2]["messages"][-1]["content"].startswith("Your reply was empty")


def test_claimed_change_without_one_gets_a_forced_hint(scripted, repo) -> None:
    bad = ("edit_file", {"path": "a.py", "old_string": "A = 9", "new_string": "A = 2"})
    scripted.script = [{"calls": [bad]}, {"content": "I found the bug and fixed it."},
                       {"calls": [("edit_file", {"path": "a.py", "old_string": "A = 1",
                                                 "new_string": "A = 2"})]},
                       {"content": "I changed A to 2 in a.py."}]
    result = agent_for(scripted, repo).run("In a.py set A to 2.")
    hint = scripted.requests[2]["messages"][-1]["content"]
    assert hint.startswith("No file has changed in this run: every edit you tried failed")
    assert [r["tool_choice"] for r in scripted.requests] == \
        ["required", "auto", "required", "auto"]
    assert result.answer == "I changed A to 2 in a.py." and result.steps == 4


def test_change_task_ending_without_a_change_gets_a_hint_a_question_does_not(
        scripted, repo) -> None:
    read = {"calls": [("read_file", {"path": "a.py"})]}
    scripted.script = [read, {"content": "Implement C = 3 in a.py."}, read, {"content": "Ok."}]
    agent_for(scripted, repo).run("Add a constant C = 3 to a.py.")
    assert scripted.requests[2]["messages"][-1]["content"].startswith(
        "No file has changed in this run: you have not edited any file.")
    assert scripted.requests[2]["tool_choice"] == "required"
    scripted.requests.clear()
    scripted.script = [read, {"content": "A is 1."}]
    result = agent_for(scripted, repo).run("What is the value of A in a.py?")
    assert result.answer == "A is 1." and len(scripted.requests) == 2


def test_a_question_about_a_change_is_answered_without_editing(scripted, repo) -> None:
    """A localisation question (rl/commits.py's instruction) describes a change but asks
    where it goes: the answer naming files ends the run; no "nothing changed" hint."""
    read = {"calls": [("read_file", {"path": "a.py"})]}
    scripted.script = [read, {"content": "The change touches a.py."}]
    result = agent_for(scripted, repo).run(
        "Fix A's value and add a constant C.\n\n"
        "Which files would this change touch? Answer with their paths.")
    assert result.answer == "The change touches a.py." and len(scripted.requests) == 2


def test_answer_checks_syntax_then_asks_for_tests_once(scripted, repo) -> None:
    (repo / "tests").mkdir()
    (repo / "tests" / "test_a.py").write_text("from a import A\n")
    broken = ("edit_file", {"path": "a.py", "old_string": "A = 1", "new_string": "A = (2"})
    fixed = ("edit_file", {"path": "a.py", "old_string": "A = (2", "new_string": "A = 2"})
    scripted.script = [{"calls": [broken]}, {"content": "Done."}, {"calls": [fixed]},
                       {"content": "Done."}, {"calls": [("run_terminal_cmd",
                                                         {"command": "true"})]},
                       {"content": "Done, tests pass."}]
    result = agent_for(scripted, repo).run("In a.py set A to 2.")
    hints = [m["content"] for m in scripted.requests[-1]["messages"] if m["role"] == "user"]
    assert hints[1].startswith("Your change left syntax errors:\na.py:1:")
    assert hints[2].startswith("Before you finish, check your change: run the tests")
    assert result.answer == "Done, tests pass." and result.status == "completed"
    assert [r["tool_choice"] for r in scripted.requests] == \
        ["required", "auto", "required", "auto", "required", "auto"]


def test_core_toolset_is_smaller(scripted, repo) -> None:
    agent_for(scripted, repo, toolset="core").run("hi")
    tools = {t["function"]["name"]: t["function"]["parameters"]["properties"]
             for t in scripted.requests[0]["tools"]}
    assert set(tools) == {"read_file", "list_dir", "grep", "codebase_search", "edit_file",
                          "create_file", "delete_file", "run_terminal_cmd"}
    assert "code_edit" not in tools["edit_file"] and "replace_all" in tools["edit_file"]


def test_repeated_calls_collapse_and_are_capped(scripted, repo) -> None:
    same = ("read_file", {"path": "a.py"})
    greps = [("grep", {"pattern": f"p{i}"}) for i in range(9)]
    scripted.script = [{"calls": [same] * 3 + greps}, {"calls": [same]}]
    agent_for(scripted, repo, max_steps=3, max_calls_per_turn=8).run("look")
    outs = [m["content"] for m in scripted.requests[1]["messages"] if m["role"] == "tool"]
    assert outs[1] == outs[2] == "[same call as #1 in this turn; see its result]"
    assert outs[-1].startswith("error: not run - at most 8")
    again = [m["content"] for m in scripted.requests[-1]["messages"] if m["role"] == "tool"]
    assert "you already made this exact call" in again[-1]


def test_step_limit_and_token_budget(scripted, repo) -> None:
    scripted.script = [{"calls": [("list_dir", {})]}] * 3
    assert agent_for(scripted, repo, max_steps=2).run("loop").status == "max_steps"
    scripted.script = [{"calls": [("list_dir", {})], "prompt_tokens": 5000}] * 3
    result = agent_for(scripted, repo, token_budget=4000).run("loop")
    assert result.status == "budget" and result.steps == 2


def test_compaction_of_old_turns_and_overflow_retry(scripted, repo) -> None:
    (repo / "big.py").write_text("x = 1\n" * 500)
    read = ("read_file", {"path": "big.py"})
    scripted.script = [{"calls": [read]}, {"calls": [("list_dir", {})], "prompt_tokens": 9000},
                       {"calls": [("grep", {"pattern": "zzz"})]},
                       {"error": {"message": "too long", "code": "context_length_exceeded"},
                        "status": 400},
                       {"content": "ok"}]
    result = agent_for(scripted, repo, context_tokens=6000, keep_turns=1).run("read")
    assert result.status == "completed"
    third = scripted.requests[2]["messages"]
    assert next(m for m in third if m["role"] == "tool")["content"].startswith("[compacted:")
    retried = scripted.requests[4]["messages"]
    assert all(m["content"].startswith("[compacted") for m in retried if m["role"] == "tool")


def test_cancellation_and_model_errors(scripted, repo) -> None:
    scripted.delay = 0.3
    scripted.script = [{"calls": [("list_dir", {})]}] * 20
    agent = agent_for(scripted, repo, max_steps=20)
    threading.Timer(0.5, agent.cancel.set).start()
    result = agent.run("loop forever")
    assert result.status == "cancelled" and result.steps < 5
    scripted.delay, scripted.chunk_delay = 0.0, 0.1
    scripted.script = [{"content": "a long answer " * 40}]  # 140 chunks, 14 s
    agent = agent_for(scripted, repo)
    threading.Timer(0.5, agent.cancel.set).start()
    before = scripted.abandoned  # the first run's cancel may have cut a stream too (load)
    start = time.monotonic()
    result = agent.run("answer at length")
    assert result.status == "cancelled" and time.monotonic() - start < 3
    deadline = time.monotonic() + 5
    while scripted.abandoned == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scripted.abandoned > before  # the connection closed: a real server stops generating
    scripted.chunk_delay = 0.0
    scripted.script = [{"error": {"message": "model 'x' does not exist"}, "status": 404}]
    err = agent_for(scripted, repo).run("hi")
    assert err.status == "error" and "404" in err.error and "does not exist" in err.error
    start = 'data: {"choices": [{"index": 0, "delta": {"content": "I"}}]}\n\n'
    cut = 'data: {"error": {"message": "upstream cut", "code": "stream_interrupted"}}\n\n'
    for raw, expected in (('data: {"choices": [\n\n', "malformed chunk"),
                          ("data: 5\n\n", "malformed chunk"), (cut, "upstream cut"),
                          ('data: {"error": "overloaded"}\n\n', "overloaded"),
                          ('data: {"choices": [7]}\n\n', "wrong shape"),
                          ('data: {"choices": [], "usage": [1]}\n\n', "wrong shape"),
                          (": keep-alive\n\n", "ended without [DONE]")):
        scripted.script = [{"raw": [start, raw]}]
        broken = agent_for(scripted, repo).run("hi")
        assert broken.status == "error" and expected in broken.error
    dead = Agent(HttpChatModel("http://127.0.0.1:9/v1", "m"), local_environment(repo)).run("hi")
    assert dead.status == "error" and "cannot reach the model server" in dead.error


def _sleeping(seconds: str) -> bool:
    """Is a `sleep <seconds>` process alive anywhere on this machine?"""
    for proc in Path("/proc").iterdir():
        try:
            if (proc / "cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", seconds.encode()]:
                return (proc / "stat").read_text().split(") ")[1][0] != "Z"
        except (OSError, IndexError):
            continue
    return False


@pytest.fixture
def server(scripted, repo, tmp_path):
    """A real server whose agent runs reach the scripted model through the gateway."""
    live = run_server(tmp_path / "home", scripted.url, workspace_roots=[str(repo.parent)])
    yield live
    live.stop()


def test_server_run_cancelled_when_stream_client_hangs_up(scripted, repo, server) -> None:
    scripted.script = [{"calls": [("run_terminal_cmd", {"command": "sleep 41.5; touch late"})]}]
    body = {"task": "wait", "path": str(repo), "model": "scripted", "max_steps": 3}
    url = server.url
    with httpx.stream("POST", url + "/v1/agent/runs", json=body, timeout=30) as resp:
        run_id = resp.headers["x-agent-run-id"]
        for line in resp.iter_lines():
            if '"type": "tool_start"' in line:
                break  # the command is running: hang up
    got = wait_end(url, run_id, timeout=15)
    assert got["status"] == "cancelled"
    result = next(e for e in got["transcript"] if e["type"] == "tool_result")
    assert result["data"]["killed"] == "cancelled" and not _sleeping("41.5")
    assert not (repo / "late").exists()
    # without a stream the run does not depend on any connection
    scripted.script = [{"calls": [("run_terminal_cmd", {"command": "sleep 1; touch ok"})]}]
    started = httpx.post(url + "/v1/agent/runs", json={**body, "stream": False}).json()
    assert wait_end(url, started["id"], timeout=15)["status"] == "completed"
    assert (repo / "ok").exists()


def test_run_manager_never_evicts_running_runs(scripted, repo) -> None:
    """Only finished runs age out; a running one stays, whatever the number of later runs."""
    from codeplane.agent.runs import RunLimit, RunManager

    manager = RunManager(max_running_per_tenant=1, keep_finished=1)
    scripted.script = [{"raw": ['data: {"choices": []}\n\n'], "hang": True}]
    slow = agent_for(scripted, repo)
    manager.start("a", slow, "wait", slow.model)
    with pytest.raises(RunLimit, match="already has 1 agent runs running"):
        manager.admit("a")
    quick = []
    for _ in range(3):
        quick.append(agent_for(scripted, repo))
        run = manager.start("b", quick[-1], "hi", quick[-1].model)
        run.thread.join(10)
        assert run.status() == "completed"
    assert manager.get("a", slow.run_id).status() == "running"
    assert manager.get("b", slow.run_id) is None  # another tenant's run is missing
    kept = [a.run_id for a in quick if manager.get("b", a.run_id) is not None]
    assert kept == [quick[-1].run_id]
    manager.close()  # cancels the hanging run; it still ends with run_end
    ended = manager.get("a", slow.run_id)
    assert ended.status() == "cancelled" and ended.events[-1]["type"] == "run_end"


# ------------------------------------------------------------------ the real local model

@pytest.mark.model
def test_agent_creates_hello_file_with_local_model(live_server, tmp_path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    agent = Agent(HttpChatModel(live_server.url + "/v1", "code-medium"), local_environment(ws),
                  AgentConfig(max_steps=4, max_tokens=200))
    result = agent.run("create hello.txt containing the word hello")
    assert (ws / "hello.txt").is_file(), result
    assert "hello" in (ws / "hello.txt").read_text().lower()
    assert result.prompt_tokens > 500 and result.tool_calls >= 1


@pytest.mark.model
def test_server_agent_run_streams_events_and_keeps_status(engine, tmp_path) -> None:
    """The real local model through the in-process gateway client, sandbox included."""
    ws = tmp_path / "ws"
    ws.mkdir()
    server = run_server(tmp_path / "home", None, engine=engine, workspace_roots=[str(ws)])
    body = {"task": "create notes.txt containing the word notes", "path": str(ws),
            "model": "code-medium", "max_steps": 4, "max_tokens": 200}
    events = []
    try:
        with httpx.stream("POST", server.url + "/v1/agent/runs", json=body,
                          timeout=300) as resp:
            assert resp.status_code == 200
            run_id = resp.headers["x-agent-run-id"]
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        kinds = [e["type"] for e in events]
        assert kinds[0] == "run_start" and kinds[-1] == "run_end" and "tool_result" in kinds
        assert events[0]["model_info"] == {"name": "code-medium", "via": "gateway",
                                           "priority": "agent"}
        assert events[-1]["prompt_tokens"] > 500
        assert (ws / "notes.txt").is_file()
        got = httpx.get(f"{server.url}/v1/agent/runs/{run_id}").json()
        assert got["status"] == events[-1]["status"] and len(got["transcript"]) == len(events)
        # a resume point that is no event id, or past any integer the database holds, is
        # bad input (400), never a 500
        for bad in ("x", "-1", "9" * 30):
            resp = httpx.get(f"{server.url}/v1/agent/runs/{run_id}/events",
                             headers={"last-event-id": bad})
            assert resp.status_code == 400, (bad, resp.text)
    finally:
        server.stop()


AREA = "def area(width, height):\n    check(width)\n    check(height)\n    return width * height\n"
VOLUME = ("def volume(width, height, depth):\n    check(width)\n    check(height)\n"
          "    return width * height * depth\n")
TIED_SKETCH = ("# ... existing code ...\n    check(width)\n    check(depth)\n    check(height)\n"
               "# ... existing code ...\n")  # fits both functions: the deterministic merge declines


@pytest.mark.model
def test_server_run_code_edit_reaches_the_apply_model(scripted, engine, tmp_path) -> None:
    """A sketch the deterministic merge declines (it fits two functions equally well) is
    merged by the apply model the server holds (code-small scores the two readings), in an
    agent run the server built: `code_edit` reaches the engine, not only the free path. The
    model's tokens are charged to the run's key, as `/v1/apply` charges them."""
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "geo.py").write_text(f"{AREA}\n\n{VOLUME}")
    server = run_server(tmp_path / "home", scripted.url, engine=engine,
                        workspace_roots=[str(ws)])
    scripted.script = [{"calls": [("read_file", {"path": "geo.py"})]},
                       {"calls": [("edit_file", {"path": "geo.py", "code_edit": TIED_SKETCH})]},
                       {"content": "done"}]
    try:
        body = {"task": "check depth in volume", "path": str(ws), "model": "scripted",
                "max_steps": 4, "stream": False}
        headers = caller(server)
        run = httpx.post(server.url + "/v1/agent/runs", json=body, headers=headers).json()
        got = wait_end(server.url, run["id"], headers, timeout=120)
        keys = server.app.state.services.keys
        used = keys.used(next(k for k in keys.all() if k.tenant == "t1"))
    finally:
        server.stop()
    edit = [e for e in got["transcript"] if e["type"] == "tool_result"][-1]
    assert edit["ok"] and edit["output"].startswith("edited geo.py"), edit["output"]
    assert (ws / "geo.py").read_text() == f"{AREA}\n\n" + VOLUME.replace(
        "    check(width)\n", "    check(width)\n    check(depth)\n")
    chat = sum(e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in got["transcript"] if e["type"] == "model_turn")
    assert used > chat, (used, chat)  # the chat turns and the model's ranking of the readings
