"""The rollout manager over real environment servers (bwrap sandboxes, the product's tools):
data order from the seed, admission that bounds staleness (k = 0 is synchronous), stragglers
masked, and faults in Ray actors counted and retried without reaching the trainer. Every
episode is the product's agent loop: one scripted model gives the same transcript through
`codeplane agent` and through a rollout."""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import GrepPolicy, make_repo, require_ray
from pydantic import ValidationError
from typer.testing import CliRunner

from codeplane.agent.hooks import PRODUCT_HOOKS
from codeplane.cli import app
from codeplane.core.chat import HttpChatModel
from codeplane.rl.actor import RayEnv
from codeplane.rl.envserver import EnvConfig, EnvServer
from codeplane.rl.rollout import RolloutConfig, RolloutManager, TaskOrder, masked, play
from codeplane.rl.run import start_ray
from codeplane.rl.tasks import locate_tasks


@pytest.fixture
def tasks(tmp_path: Path):
    return locate_tasks("shapes", make_repo(tmp_path / "shapes"))


def local_envs(tmp_path: Path):
    return lambda index: EnvServer(EnvConfig(), scratch=str(tmp_path))


def train(manager: RolloutManager, policy: GrepPolicy, first: int, steps: int) -> list:
    """What a run does between steps: collect, 'train' (the version moves on), ship weights."""
    out = []
    for step in range(first, first + steps):
        data = manager.collect(step, version=step)
        out.append(data)
        policy.load_weights(None, step + 1)
        manager.advance(step + 1)
    manager.stop()
    return out


def test_episodes_are_grouped_rewarded_and_synchronous_at_k0(tasks, tmp_path) -> None:
    policy = GrepPolicy()
    config = RolloutConfig(in_flight=3, group_size=2, groups_per_step=2, max_staleness=0)
    manager = RolloutManager(policy, tasks, config, local_envs(tmp_path)).start()
    steps = train(manager, policy, 0, 3)
    for step, data in enumerate(steps):
        assert len(data.episodes) == 4 and len(data.groups) == 2
        assert all(e.reward == 1.0 and e.steps == 2 for e in data.episodes)
        assert all(len({e.task_id for e in g}) == 1 for g in data.groups)
        assert {s.version for e in data.episodes for s in e.samples} == {step}
        assert dict(data.staleness) == {0: 8}
        assert data.episodes[0].samples[0].completion_ids == [7, 8]
    assert not manager.faults


def test_data_order_is_a_function_of_the_seed_and_resumes(tasks, tmp_path) -> None:
    config = RolloutConfig(in_flight=2, group_size=2, groups_per_step=1, max_staleness=1,
                           seed=7)
    full = train(RolloutManager(GrepPolicy(), tasks, config, local_envs(tmp_path)).start(),
                 GrepPolicy(), 0, 4)
    resumed = train(RolloutManager(GrepPolicy(), tasks, config, local_envs(tmp_path),
                                   first_step=2).start(), GrepPolicy(), 2, 2)
    order = [[e.task_id for e in d.episodes] for d in full]
    assert order[2:] == [[e.task_id for e in d.episodes] for d in resumed]
    other = TaskOrder(tasks, seed=8)
    seven = TaskOrder(tasks, seed=7)
    assert [seven.task(g).id for g in range(4)] == [o[0] for o in order]
    assert [seven.task(g).id for g in range(9)] != [other.task(g).id for g in range(9)]
    # every task once per epoch
    assert sorted(seven.task(g).id for g in range(3)) == sorted(t.id for t in tasks)


def test_admission_bounds_staleness(tasks, tmp_path) -> None:
    """Nothing trains for a while: with k = 1 the workers run one step ahead and stop."""
    policy = GrepPolicy()
    config = RolloutConfig(in_flight=4, group_size=2, groups_per_step=1, max_staleness=1)
    manager = RolloutManager(policy, tasks, config, local_envs(tmp_path)).start()
    manager.collect(0, 0)
    manager.collect(1, 0)  # both admitted while the trainer is still at step 0
    assert manager.next_slot == 4  # step 2's slots wait for the trainer
    manager.advance(1)
    data = manager.collect(2, 2)  # a trainer two versions on: version-0 samples are too old
    manager.stop()
    assert data.stale_dropped == 2 and data.groups == []
    assert data.staleness == {2: 4}


def test_stragglers_are_cut_and_masked(tasks, tmp_path) -> None:
    config = RolloutConfig(in_flight=2, group_size=2, groups_per_step=1, max_turns=3)
    manager = RolloutManager(GrepPolicy(stall=True), tasks, config,
                             local_envs(tmp_path)).start()
    data = manager.collect(0, 0)
    manager.stop()
    assert [e.steps for e in data.episodes] == [3, 3]
    assert all(e.info["truncated"] and e.reward == 0 for e in data.episodes)
    assert data.groups == []


@pytest.fixture(scope="module")
def ray_local():
    ray = require_ray()
    start_ray(2)
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    yield ray
    ray.shutdown()


def test_faults_in_ray_actors_are_counted_retried_and_never_raise(ray_local, tasks,
                                                                  tmp_path) -> None:
    """Injected faults take their real paths: the actor process exits (sandbox killed) or a
    call raises (tool timeout, verifier crash). The manager replaces the actor and retries."""
    seeds = itertools.count()

    def envs(index: int) -> RayEnv:
        return RayEnv(EnvConfig(fault_rate=0.25, seed=next(seeds)), call_timeout=60,
                      scratch=str(tmp_path))

    config = RolloutConfig(in_flight=2, group_size=2, groups_per_step=2, max_staleness=1,
                           retries=3)
    policy = GrepPolicy()
    manager = RolloutManager(policy, tasks, config, envs).start()
    steps = train(manager, policy, 0, 3)
    episodes = [e for d in steps for e in d.episodes]
    assert len(episodes) == 12
    assert manager.faults["sandbox_killed"] > 0 and sum(manager.faults.values()) >= 3
    assert manager.retried > 0
    ok = [e for e in episodes if e.fault is None]
    assert ok and all(e.reward == 1.0 for e in ok)  # retried episodes are whole episodes


def test_the_deadline_kills_the_command_in_the_actor_and_masks_the_episode(
        ray_local, provider, tasks, tmp_path) -> None:
    """`max_seconds` sets the agent's cancel: the command running in the environment actor
    is killed (as cancelling `codeplane agent` kills one), and the episode ends `cancelled`,
    masked."""
    provider.reset().script = [{"calls": [("run_terminal_cmd",
                                           {"command": "sleep 40; touch late"})]}]
    env = RayEnv(EnvConfig(timeout=60), call_timeout=90, scratch=str(tmp_path))
    model = HttpChatModel(provider.url, "scripted")
    results: list[dict] = []
    try:
        episode = play(model, env, tasks[0], "g0", RolloutConfig(max_seconds=3),
                       on_event=lambda e: results.append(e) if e["type"] == "tool_result"
                       else None)
        copies = list(tmp_path.glob("rl-*/repo"))
    finally:
        env.close()
        model.close()
    assert episode.info["status"] == "cancelled" and masked(episode)
    assert results[0]["data"]["killed"] == "cancelled"
    assert copies and not any((c / "late").exists() for c in copies)


class BuggyPolicy(GrepPolicy):
    """Raises an unexpected error on its second turn for the perimeter task (a bug)."""

    def complete(self, messages, tools, sampling, cancel=None):
        tool_ran = any(m["role"] == "tool" for m in messages)
        if tool_ran and "border of a circle" in messages[1]["content"]:
            raise TypeError("a sampler bug")
        return super().complete(messages, tools, sampling, cancel)


def test_an_unexpected_error_masks_the_episode_and_the_run_goes_on(tasks, tmp_path) -> None:
    policy = BuggyPolicy()
    config = RolloutConfig(in_flight=2, group_size=2, groups_per_step=3, seed=0)
    manager = RolloutManager(policy, tasks, config, local_envs(tmp_path)).start()
    data = manager.collect(0, 0)  # all three tasks, one of them hits the bug
    manager.stop()
    broken = [e for e in data.episodes if e.fault]
    assert len(broken) == 2 and {e.fault for e in broken} == {"episode_error"}
    assert "a sampler bug" in broken[0].info["error"]
    assert len(data.groups) == 2 and manager.faults == {"episode_error": 2}


INVENTED = '{"name": "open_shapes", "arguments": {"path": "pkg/shapes.py", "start_line": 1}}'


def scripted_episode(provider, task, tmp_path: Path, config: RolloutConfig, on_event=None):
    model = HttpChatModel(provider.url, "scripted")
    env = EnvServer(EnvConfig(), scratch=str(tmp_path))
    try:
        return play(model, env, task, "g0", config, on_event=on_event)
    finally:
        env.close()
        model.close()


@pytest.mark.parametrize("hooks", ["none", "product"])
def test_product_hooks_repair_a_turn_the_plain_loop_only_hints_at(provider, tasks, tmp_path,
                                                                  hooks) -> None:
    """code-small's habit: a call to an invented tool name, written as text. The plain loop
    never takes it as the answer: it gets the loop's hint and the next turn answers; with the
    product's hooks call_repair turns it into the read_file call it fits, the tool runs in
    the sandbox, and the next turn answers."""
    provider.reset().script = [{"content": INVENTED}, {"content": "pkg/shapes.py:8"}]
    area = next(t for t in tasks if t.start == 7)
    episode = scripted_episode(provider, area, tmp_path, RolloutConfig(hooks=hooks, max_turns=3))
    assert episode.reward == 1.0 and episode.steps == 2 and len(episode.samples) == 2
    history = provider.requests[1]["messages"]
    if hooks == "none":
        assert episode.info["hooks"] == [] and episode.info["repairs"] == {}
        assert episode.info["corrections"] == 1
        assert history[-1]["content"].startswith("error: open_shapes is not a tool")
        return
    assert episode.info["hooks"] == list(PRODUCT_HOOKS)
    assert episode.info["repairs"] == {"call_repair": 1}
    assert history[2]["tool_calls"][0]["function"]["name"] == "read_file"
    assert history[2]["content"] in ("", None)  # rewritten to the call that ran
    assert "def perimeter" in history[3]["content"]  # the real tool's output


def test_product_hooks_hint_instead_of_ending_an_episode(provider, tasks, tmp_path) -> None:
    """An answer before any tool call gets the product's nudge (a user message), not the
    verifier; the plain loop would have scored it."""
    provider.reset().script = [{"content": "no idea"},
                               {"calls": [("grep", {"pattern": "Compute the area"})]},
                               {"content": "pkg/shapes.py:8"}]
    area = next(t for t in tasks if t.start == 7)
    episode = scripted_episode(provider, area, tmp_path,
                               RolloutConfig(hooks=["corrections"], max_turns=4))
    assert episode.reward == 1.0 and episode.steps == 3 and episode.info["corrections"] == 1
    assert provider.requests[1]["messages"][-1]["role"] == "user"


def test_markup_never_completes_an_episode(provider, tasks, tmp_path) -> None:
    """A policy that writes a tool result as its answer, again after every hint: the episode
    ends `malformed` with reward 0 - scored, not masked, and the verifier never read the
    markup as an answer (it holds a right path:line)."""
    fake = "<tool_response>\npkg/shapes.py:8:    def area(self):\n</tool_response>"
    provider.reset().script = [{"content": fake}] * 4
    area = next(t for t in tasks if t.start == 7)
    episode = scripted_episode(provider, area, tmp_path, RolloutConfig(max_turns=6))
    assert episode.info["status"] == "malformed" and episode.reward == 0.0
    assert episode.info["corrections"] == 3 and episode.steps == 4 and not masked(episode)
    assert len(provider.requests) == 4


@pytest.mark.parametrize(("hooks", "message"), [
    (["call_repair", "nope"], "unknown agent hook(s) nope; available: preread"),
    ("some", '"none", "product" or a list of hook names'),
])
def test_unknown_hooks_are_config_errors(hooks, message) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RolloutConfig(hooks=hooks)
    assert RolloutConfig(hooks="product").hooks == PRODUCT_HOOKS
    assert RolloutConfig().hooks == ()


class Recording(GrepPolicy):
    """GrepPolicy that records the tool_choice of every request."""

    def __init__(self, stall: bool = False) -> None:
        super().__init__(stall)
        self.choices: list[str] = []

    def complete(self, messages, tools, sampling, cancel=None):
        self.choices.append(sampling.tool_choice)
        return super().complete(messages, tools, sampling, cancel)


def test_the_answer_turn_scores_an_episode_the_turn_limit_would_mask(tasks, tmp_path) -> None:
    """A policy that only ever calls tools: without an answer turn the episode is cut at
    max_turns and masked (no signal); with it (the agent's `answer_turn`), the last turn is
    asked without tools, and a call there is no answer: `malformed`, reward 0, scored."""
    env = EnvServer(EnvConfig(), scratch=str(tmp_path))
    policy = Recording(stall=True)
    cut = play(policy, env, tasks[0], "g", RolloutConfig(max_turns=2))
    assert cut.info["status"] == "max_steps" and masked(cut)
    policy = Recording(stall=True)
    episode = play(policy, env, tasks[0], "g", RolloutConfig(max_turns=2, answer_turn=True))
    assert policy.choices == ["required", "none"]  # the product's required first call
    assert episode.info["status"] == "malformed" and not masked(episode)
    assert episode.steps == 2 and episode.reward == 0.0
    solver = Recording()
    solved = play(solver, env, tasks[0], "g",
                  RolloutConfig(max_turns=2, answer_turn=True, required_steps=0))
    assert solver.choices == ["auto", "none"] and solved.reward == 1.0
    env.close()


def normalised(text: str) -> str:
    """A transcript or request log without what differs between two runs of the same
    conversation: repaired calls' generated ids."""
    return re.sub(r"call_[0-9a-f]{24}", "call_*", text)


TRANSCRIPT_SCRIPT = [
    {"content": "Looking.", "calls": [("grep", {"pattern": "Compute the area"}),
                                      ("read_file", {"path": "pkg/shapes.py", "start_line": 7,
                                                     "end_line": 9}),
                                      ("read_file", {"path": "nope.py"})]},
    {"content": '<tool_call>\n{"name": "list_dir", "arguments": {"path": "pkg"}}\n</tool_call>'},
    {"content": "<tool_response>\npkg/shapes.py:8\n</tool_response>"},
    {"calls": [("create_file", {"path": "notes.txt", "content": "area: line 8\n"}),
               ("run_terminal_cmd", {"command": "cat notes.txt; ls pkg"})]},
    {"content": "pkg/shapes.py:8"},
]
VOLATILE = {"t", "run_id", "time", "seconds", "environment", "transcript"}


def events_of(path: Path) -> list[dict]:
    """A JSONL transcript without timings, run ids and the workspace's location, a turn's
    tool events in call order (its calls run in parallel: they finish in any order)."""
    events = [{k: v for k, v in json.loads(normalised(line)).items() if k not in VOLATILE}
              for line in path.read_text().splitlines()]
    for event in events:
        event.get("data", {}).pop("seconds", None)  # a command's run time
    last = len(events)
    return sorted(events, key=lambda e: (
        0 if e["type"] == "run_start" else last if e["type"] == "run_end" else e["step"],
        e["index"] if e["type"] in ("tool_start", "tool_result") else -1))


def test_codeplane_agent_and_a_rollout_give_the_same_transcript(ray_local, provider, tasks,
                                                                tmp_path) -> None:
    """One scripted model, the same task and repository: `codeplane agent` and an RL
    episode (the rollout manager, its environment server in a Ray actor) send the model the
    same requests and record the same events - messages, tool calls (parallel ones, one
    written as text and parsed, a made-up tool result refused), tool outputs (a missing
    file, a write, a sandboxed command), the hooks and the agent settings."""
    area = next(t for t in tasks if t.start == 7)
    cli_repo = make_repo(tmp_path / "cli")
    provider.reset().script = list(TRANSCRIPT_SCRIPT)
    product = tmp_path / "product.jsonl"
    res = CliRunner().invoke(app, ["agent", area.instruction, "--path", str(cli_repo),
                                   "--base-url", provider.url, "--model", "scripted",
                                   "--transcript", str(product), "--json"],
                             env={"CODEPLANE_HOME": str(tmp_path / "home")})
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["status"] == "completed"
    cli_requests = list(provider.requests)
    provider.reset().script = list(TRANSCRIPT_SCRIPT)
    config = RolloutConfig(in_flight=1, group_size=1, groups_per_step=1, max_turns=25,
                           max_tokens=1024, temperature=0.0, hooks="product")
    model = HttpChatModel(provider.url, "scripted")
    manager = RolloutManager(model, [area], config, lambda i: RayEnv(
        EnvConfig(), call_timeout=60, scratch=str(tmp_path)), transcripts=tmp_path / "rl")
    data = manager.start().collect(0, 0)
    manager.stop()
    model.close()
    episode = data.episodes[0]
    assert episode.fault is None and episode.reward == 1.0, episode.info
    assert episode.info["repairs"] == {"parser": 1} and episode.info["corrections"] == 1
    assert normalised(json.dumps(provider.requests)) == normalised(json.dumps(cli_requests))
    rollout = events_of(tmp_path / "rl" / "000000-0.jsonl")
    assert rollout == events_of(product)
    kinds = [e["type"] for e in rollout]
    assert kinds.count("tool_result") == 6 and "call_repair" in kinds
    assert "user_message" in kinds and kinds[-1] == "run_end"
    missing = next(e for e in rollout if e["type"] == "tool_result" and e["index"] == 2)
    assert missing["output"].startswith("error: nope.py does not exist")
