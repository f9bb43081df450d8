"""The rollout manager: many episodes in flight over environment servers, grouped per task,
with bounded staleness, straggler limits and environment faults that never reach the trainer.

An episode is the product's `Agent` (agent/loop.py) on the environment server's workspace with
the policy as its `ChatModel` (`play`): the product's system prompt, tool schemas, tool-call
parsing and repairs, parallel tool execution, compaction and limits - nothing here is a second
agent loop. `Recorder` keeps every `Turn` the policy sampled, so the trainer gets exactly the
tokens, logprobs and policy version of each model turn, whatever the loop made of the reply.

Continuous: `in_flight` workers each own an environment server; a worker takes the next
episode slot the moment its last episode ends, so one long episode never idles the others.

Reproducible data order: the slots are a pure function of the seed. Group g's task is the
g-th task of a per-epoch seeded permutation; training step s gets groups
[s*B, (s+1)*B), whatever order they finish in. Resuming at step s therefore sees exactly the
data an uninterrupted run would have seen.

Bounded staleness by admission, not by discarding: an episode for step s may start only
once the trainer has finished step s-k. So with k = 0 no episode starts before the weights
it is trained against exist (synchronous); with k > 0 workers run up to k steps ahead and
their samples are at most k versions old. A sample that is older anyway (a sampler that
missed an update) is dropped and counted. Discarding slow episodes instead would bias the
data towards short episodes (tinker-cookbook#822).

Stragglers: `max_turns` is the agent's `max_steps`, and `max_seconds` sets the agent's cancel
(which also kills a running command); an episode that ends at either is masked ("compact
filtering", as DeepSWE does): truncated work is neither rewarded nor punished. Faults
(`EnvFault`: sandbox killed, tool timeout, verifier crash; a dead Ray actor is a killed
sandbox) get a fresh environment and a retry; after `retries` the episode is masked. Every
fault is counted; none propagates to the trainer.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field, field_validator

from codeplane.agent.env import Environment
from codeplane.agent.hooks import HOOKS, PRODUCT_HOOKS, UnknownHook
from codeplane.agent.loop import Agent, AgentConfig, Event, StepOutcome, Transcript
from codeplane.agent.toolset import ToolServices
from codeplane.core.chat import ChatModel, ModelError, Sampling, Turn
from codeplane.rl.envserver import EnvFault
from codeplane.rl.tasks import Task
from codeplane.rl.types import Episode, Sample

log = logging.getLogger("codeplane.rl")
# A run that ends at a limit, not at an answer: masked.
TRUNCATED = ("max_steps", "budget", "cancelled")


class Env(Protocol):
    """What a worker needs from an environment server (an in-process `EnvServer`, or a
    `RayEnv`): the episode's workspace as an `Environment`, the verifier, and `fault`, the
    server's own failure latched while the agent's tools turned it into an error result."""

    fault: EnvFault | None

    def open(self, task: Task) -> Environment: ...
    def verify(self, answer: str) -> float: ...
    def close(self) -> None: ...


class RolloutConfig(BaseModel):
    """`[rollout]`: how episodes are made and grouped, and the settings of the product's
    agent that runs them (each an `AgentConfig` field, defaulting to the product's value
    where the product has one)."""

    model_config = {"extra": "forbid", "frozen": True}
    in_flight: int = Field(4, ge=1, le=256, description="episodes running at once (one "
                                                       "environment server each)")
    group_size: int = Field(4, ge=1, description="episodes per task: the advantage baseline")
    groups_per_step: int = Field(2, ge=1, description="groups per trainer step")
    max_staleness: int = Field(1, ge=0, description="k: samples at most k policy versions "
                                                    "old; 0 = synchronous")
    max_turns: int = Field(6, ge=1, description="straggler limit: model turns per episode "
                                                "(the agent's max_steps)")
    max_seconds: float = Field(300.0, gt=0, description="straggler limit: wall clock per "
                                                        "episode (then the agent is cancelled)")
    retries: int = Field(2, ge=0, description="fresh environments for an episode whose "
                                              "environment failed")
    required_steps: int = Field(AgentConfig.required_steps, ge=0, description=(
        "the first N turns must call a tool (tool_choice required: codeplane serve and the "
        "llama.cpp sampler constrain decoding to a call of one of the tools)"))
    answer_turn: bool = Field(AgentConfig.answer_turn, description=(
        "the last of `max_turns` is asked without tools (tool_choice none): an episode ends "
        "with an answer, scored, instead of being cut off and masked"))
    max_tokens: int = Field(256, ge=1, description="per model turn")
    temperature: float = Field(1.0, ge=0)
    toolset: Literal["core", "full"] = Field(AgentConfig.toolset, description=(
        "the product's tools: full (all), or core (8 tools, simpler schemas, codebase_search among them)"))
    max_result_chars: int = Field(AgentConfig.max_result_chars, ge=200, description=(
        "per tool output, cut as the product cuts it"))
    hooks: tuple[str, ...] = Field((), description='the agent loop\'s small-model repairs '
                                   '(agent/hooks.py): "none" (the plain loop: the policy is '
                                   'rewarded for what it did), "product" (all of them, as '
                                   'the product runs), or a list of hook names')
    transcripts: bool = Field(False, description="write each episode's events as the "
                                                 "product's JSONL transcript, under "
                                                 "out/transcripts/")
    seed: int = 0

    @field_validator("hooks", mode="before")
    @classmethod
    def _hooks(cls, value: Any) -> Any:
        """"none" and "product" as names for the two loops; unknown names are errors."""
        if value == "none":
            return ()
        if value == "product":
            return PRODUCT_HOOKS
        if isinstance(value, str):  # pydantic reports only ValueError as a config error
            raise ValueError(  # noqa: TRY004
                f'"none", "product" or a list of hook names, not {value!r}')
        unknown = sorted(set(value) - set(HOOKS)) if isinstance(value, list | tuple) else []
        if unknown:
            raise UnknownHook(f"unknown agent hook(s) {', '.join(unknown)}; available: "
                              f"{', '.join(HOOKS)}")
        return value

    def agent_config(self) -> AgentConfig:
        """The product's agent settings for an episode; the rest are the product's own."""
        return AgentConfig(max_steps=self.max_turns, max_tokens=self.max_tokens,
                           temperature=self.temperature, required_steps=self.required_steps,
                           answer_turn=self.answer_turn, toolset=self.toolset,
                           max_result_chars=self.max_result_chars)


@dataclass
class StepData:
    """What one trainer step gets, and what the run reports about how it was made."""

    step: int
    groups: list[list[Episode]]  # trainable: >= 2 unmasked episodes each
    episodes: list[Episode]  # all of them, masked ones included
    stale_dropped: int = 0
    staleness: Counter = field(default_factory=Counter)  # versions behind -> samples


class TaskOrder:
    """Group g's task: epoch g // len(tasks) is a seeded permutation of the tasks."""

    def __init__(self, tasks: list[Task], seed: int) -> None:
        if not tasks:
            raise ValueError("no tasks to roll out")
        self.tasks, self.seed = tasks, seed
        self._epochs: dict[int, list[Task]] = {}

    def task(self, group: int) -> Task:
        epoch, index = divmod(group, len(self.tasks))
        if epoch not in self._epochs:
            order = list(self.tasks)
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._epochs[epoch] = order
        return self._epochs[epoch][index]


class Recorder:
    """The policy as the agent's `ChatModel`, keeping every `Turn` it sampled (the trainer's
    samples: tokens, logprobs and version as sampled, also of a reply the loop then repaired
    or answered with a hint) and the seconds spent sampling."""

    def __init__(self, model: ChatModel) -> None:
        self.model, self.name = model, model.name
        self.turns: list[Turn] = []
        self.seconds = 0.0

    def describe(self) -> dict[str, Any]:
        return self.model.describe()

    def close(self) -> None:
        """Nothing: the policy belongs to the run."""

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        start = time.monotonic()
        try:
            turn = self.model.complete(messages, tools, sampling, cancel)
        finally:
            self.seconds += time.monotonic() - start
        self.turns.append(turn)
        return turn


@dataclass
class Conduct:
    """What an episode's events say about how the agent worked (issue 31 reports these per
    step and on held-out tasks): model turns, codebase_search calls, and the tool calls of
    each turn (read turns: those that call read_file)."""

    turns: int = 0
    searches: int = 0
    calls: list[int] = field(default_factory=list)  # tool calls per model turn
    read_turn_calls: list[int] = field(default_factory=list)  # calls on turns that read files

    def __call__(self, event: Event) -> None:
        if event["type"] != "model_turn":
            return
        self.turns += 1
        names = [c["function"]["name"] for c in event["message"].get("tool_calls") or []]
        self.calls.append(len(names))
        self.searches += names.count("codebase_search")
        if "read_file" in names:
            self.read_turn_calls.append(len(names))

    def as_dict(self) -> dict[str, Any]:
        return {"turns": self.turns, "searches": self.searches, "calls": self.calls,
                "read_turn_calls": self.read_turn_calls}


def play(model: ChatModel, env: Env, task: Task, group_id: str, config: RolloutConfig,
         cancel: threading.Event | None = None,
         on_event: Callable[[Event], None] | None = None,
         services: ToolServices | None = None) -> Episode:
    """One episode: the product's agent on a fresh copy of the task's repository, `model`
    as its ChatModel, driven a step at a time until an answer or a limit; then the
    verifier's reward. `config.hooks` names the small-model repairs that run (none: the
    policy is rewarded for what it did itself). An answer is verified; a `malformed` end
    (markup instead of an answer) earns 0 unverified; a limit (`max_turns`, `max_seconds`,
    `cancel`, the token budget) masks the episode. An environment fault or a sampler error
    raises. The episode's `info` keeps the status, the answer and the agent's `Conduct`
    (turns, searches, calls per turn). `on_event` gets the agent's events (the product's
    transcript format);
    `services` what its tools reach beyond the workspace (the run's index: rl/index.py;
    default none, and codebase_search answers "index unavailable")."""
    start = time.monotonic()
    cancel = cancel or threading.Event()
    policy, conduct = Recorder(model), Conduct()

    def observe(event: Event) -> None:
        conduct(event)
        if on_event is not None:
            on_event(event)

    agent = Agent(policy, env.open(task), config.agent_config(), observe, cancel,
                  services=services, hooks=config.hooks)
    deadline = threading.Timer(config.max_seconds, cancel.set)
    deadline.daemon = True
    deadline.start()
    try:
        outcome = _drive(agent, task.instruction, env)
    except Exception as exc:
        agent.finish("error", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        deadline.cancel()
        agent.close()
    result = agent.finish(outcome.status or "error", outcome.answer)
    samples = [Sample(t.prompt_ids or [], t.token_ids or [], t.logprobs or [],
                      _version(t.policy_version, model)) for t in policy.turns]
    info: dict[str, Any] = {"hooks": list(config.hooks), "status": result.status,
                            "model_seconds": policy.seconds, "repairs": dict(agent.repairs),
                            "corrections": agent.hints, "answer": result.answer,
                            **conduct.as_dict()}
    reward = 0.0
    if result.status == "completed":
        reward = env.verify(result.answer)
    elif result.status in TRUNCATED:
        info["truncated"] = True
    return Episode(task.id, group_id, samples, reward, steps=result.steps,
                   seconds=time.monotonic() - start, info=info)


def _drive(agent: Agent, task: str, env: Env) -> StepOutcome:
    """`start`, then `step` until a status. A failure of the environment server ends the
    episode as that fault, whatever the agent made of it (the tools turn it into an error
    result; listing the workspace at the start raises it)."""
    outcome = StepOutcome()
    try:
        agent.start(task)
        while env.fault is None and outcome.status is None:
            outcome = agent.step()
    except Exception:
        if env.fault is None:
            raise
    if env.fault is not None:
        raise env.fault
    return outcome


def _version(stamped: int | None, model: ChatModel) -> int:
    """The policy version that sampled a turn: the Turn's stamp, else the model's."""
    return stamped if stamped is not None else int(getattr(model, "version", 0))


def masked(episode: Episode) -> bool:
    """Not trained on: a fault, or a straggler cut off by a limit."""
    return episode.fault is not None or bool(episode.info.get("truncated"))


class RolloutManager:
    """Workers over environment servers filling the steps' groups in a fixed order. With
    `transcripts`, each episode attempt's events go to `<transcripts>/<slot>-<attempt>.jsonl`
    (slot s belongs to step s // (group_size * groups_per_step)). `services(task)`: an
    episode's tool services (`RunIndex.services`: its task snapshot's index)."""

    def __init__(self, model: ChatModel, tasks: list[Task], config: RolloutConfig,
                 make_env: Callable[[int], Env], first_step: int = 0,
                 transcripts: Path | None = None,
                 services: Callable[[Task], ToolServices] | None = None) -> None:
        self.model, self.config, self.make_env = model, config, make_env
        self.transcripts, self.services = transcripts, services
        self.order = TaskOrder(tasks, config.seed)
        self.slot_count = config.group_size * config.groups_per_step  # episodes per step
        self.next_slot = first_step * self.slot_count  # global episode slot index
        self.trained = first_step  # trainer steps done: admission bound
        self.results: dict[int, Episode] = {}
        self.faults: Counter = Counter()
        self.retried = 0
        self.model_seconds = 0.0
        self._cond = threading.Condition()
        self._stopped = False
        self._live: set[threading.Event] = set()  # running episodes' cancels: stop() sets them
        self._workers = [threading.Thread(target=self._work, args=(i,), daemon=True,
                                          name=f"rollout-{i}")
                         for i in range(config.in_flight)]

    def start(self) -> RolloutManager:
        for worker in self._workers:
            worker.start()
        return self

    def advance(self, trained: int) -> None:
        """The trainer finished step `trained - 1` (and the sampler has its weights):
        episodes up to step trained + k may start."""
        with self._cond:
            self.trained = trained
            self._cond.notify_all()

    def collect(self, step: int, version: int) -> StepData:
        """Block until every episode of `step` has ended; its groups, staleness measured
        against the trainer's `version`."""
        first = step * self.slot_count
        slots = range(first, first + self.slot_count)
        with self._cond:
            self._cond.wait_for(lambda: all(s in self.results for s in slots)
                                or self._stopped)
            episodes = [self.results.pop(s) for s in slots if s in self.results]
        data = StepData(step, [], episodes)
        size = self.config.group_size
        for g in range(0, len(episodes), size):
            group = [e for e in episodes[g:g + size] if not masked(e)
                     and self._fresh(e, version, data)]
            if len(group) >= 2:
                data.groups.append(group)
        return data

    def _fresh(self, episode: Episode, version: int, data: StepData) -> bool:
        behind = [version - s.version for s in episode.samples]
        data.staleness.update(behind)
        if behind and max(behind) > self.config.max_staleness:
            data.stale_dropped += 1
            return False
        return True

    def stop(self) -> None:
        """End the workers; episodes still running (for steps nobody will collect) are cut
        short rather than finished."""
        with self._cond:
            self._stopped = True
            for cancel in self._live:
                cancel.set()
            self._cond.notify_all()
        for worker in self._workers:
            worker.join(timeout=self.config.max_seconds + 60)

    def _take(self) -> int | None:
        """The next slot, once admission allows its step; None when stopping."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or self.next_slot // self.slot_count
                                <= self.trained + self.config.max_staleness)
            if self._stopped:
                return None
            slot, self.next_slot = self.next_slot, self.next_slot + 1
            return slot

    def _work(self, index: int) -> None:
        env: Env | None = None
        while (slot := self._take()) is not None:
            group = slot // self.config.group_size
            task = self.order.task(group)
            episode = None
            for attempt in range(self.config.retries + 1):
                try:
                    if env is None:
                        env = self.make_env(index)
                    episode = self._play(env, task, f"g{group}", f"{slot:06d}-{attempt}")
                    break
                except EnvFault as fault:
                    self._count(fault.kind, attempt < self.config.retries)
                    env = _discard(env)
                    episode = Episode(task.id, f"g{group}", [], 0.0, fault=fault.kind)
                except ModelError as exc:  # the sampler failed: mask, never retry blindly
                    self._count("sampler_error", False)
                    episode = Episode(task.id, f"g{group}", [], 0.0, fault="sampler_error",
                                      info={"error": str(exc)})
                    break
                except Exception as exc:  # a bug must mask one episode, not hang the run
                    log.exception("episode of %s failed", task.id)
                    self._count("episode_error", False)
                    env = _discard(env)
                    episode = Episode(task.id, f"g{group}", [], 0.0, fault="episode_error",
                                      info={"error": f"{type(exc).__name__}: {exc}"})
                    break
            with self._cond:
                self.model_seconds += float(episode.info.get("model_seconds", 0.0))
                self.results[slot] = episode
                self._cond.notify_all()
        _discard(env)

    def _play(self, env: Env, task: Task, group_id: str, name: str) -> Episode:
        """One attempt, cancelled with the others when the manager stops."""
        cancel = threading.Event()
        with self._cond:
            if self._stopped:
                cancel.set()
            self._live.add(cancel)
        transcript = Transcript(self.transcripts / f"{name}.jsonl") if self.transcripts else None
        try:
            return play(self.model, env, task, group_id, self.config, cancel, transcript,
                        self.services(task) if self.services else None)
        finally:
            if transcript is not None:
                transcript.close()
            with self._cond:
                self._live.discard(cancel)

    def _count(self, kind: str, retry: bool) -> None:
        with self._cond:
            self.faults[kind] += 1
            self.retried += int(retry)


def _discard(env: Env | None) -> None:
    """Close an environment that may already be dead (a dead sandbox cannot be closed; it is
    gone either way, so nothing `close` raises matters now)."""
    if env is not None:
        with contextlib.suppress(Exception):
            env.close()
