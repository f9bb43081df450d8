"""The rollout manager: many episodes in flight over environment servers, grouped per task,
with bounded staleness, straggler limits and environment faults that never reach the trainer.

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

Stragglers: an episode that exceeds `max_turns` or `max_seconds` ends and is masked
("compact filtering", as DeepSWE does): truncated work is neither rewarded nor punished.
Faults (`EnvFault`: sandbox killed, tool timeout, verifier crash; a dead Ray actor is a
killed sandbox) get a fresh environment and a retry; after `retries` the episode is masked.
Every fault is counted; none propagates to the trainer.
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
from typing import Any, Protocol

from pydantic import BaseModel, Field, field_validator

from codeplane.agent.hooks import HOOKS, PRODUCT_HOOKS, UnknownHook
from codeplane.agent.loop import AgentConfig
from codeplane.core.chat import Cancelled, ChatModel, ModelError, Sampling
from codeplane.rl.env import EnvConfig, EnvFault, EnvServer
from codeplane.rl.tasks import Task
from codeplane.rl.types import Episode, Sample

log = logging.getLogger("codeplane.rl")


class Env(Protocol):
    """What a worker needs from an environment server (an `EnvServer` or a Ray actor)."""

    def tools(self) -> list[dict[str, Any]]: ...
    def reset(self, task: Task, hooks: tuple[str, ...] = ()) -> list[dict[str, Any]]: ...
    def step(self, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]: ...
    def repair(self, content: str) -> tuple[str, list[dict[str, Any]]] | None: ...
    def correct(self, content: str) -> tuple[str | None, bool]: ...
    def verify(self, answer: str) -> float: ...
    def close(self) -> None: ...


class RolloutConfig(BaseModel):
    """`[rollout]`: how episodes are made and grouped."""

    model_config = {"extra": "forbid", "frozen": True}
    in_flight: int = Field(4, ge=1, le=256, description="episodes running at once (one "
                                                       "environment server each)")
    group_size: int = Field(4, ge=1, description="episodes per task: the advantage baseline")
    groups_per_step: int = Field(2, ge=1, description="groups per trainer step")
    max_staleness: int = Field(1, ge=0, description="k: samples at most k policy versions "
                                                    "old; 0 = synchronous")
    max_turns: int = Field(6, ge=1, description="straggler limit: model turns per episode")
    max_seconds: float = Field(300.0, gt=0, description="straggler limit: wall clock per "
                                                        "episode")
    retries: int = Field(2, ge=0, description="fresh environments for an episode whose "
                                              "environment failed")
    first_call: bool = Field(False, description="the first turn must call a tool "
                                                "(tool_choice required: the sampler constrains "
                                                "decoding to a call of one of the tools)")
    answer_turn: bool = Field(False, description="the last of `max_turns` is sampled without "
                                                 "tools (tool_choice none): an episode ends "
                                                 "with an answer, scored, instead of being "
                                                 "cut off and masked")
    max_tokens: int = Field(256, ge=1, description="per model turn")
    temperature: float = Field(1.0, ge=0)
    hooks: tuple[str, ...] = Field((), description='the agent loop\'s small-model repairs '
                                   '(agent/hooks.py): "none" (the plain loop: the policy is '
                                   'rewarded for what it did), "product" (all of them, as '
                                   'the product runs), or a list of hook names')
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


def run_episode(model: ChatModel, env: Env, tools: list[dict[str, Any]], task: Task,
                group_id: str, config: RolloutConfig,
                cancel: threading.Event | None = None) -> Episode:
    """Model turn, the environment runs its tool calls, until an answer or a limit.
    `config.hooks` empty is the plain loop (the policy is rewarded for what it did); with
    hooks it is the product's loop: a reply without tool calls may be repaired into calls
    (the history then shows the calls that ran, as `Agent` rewrites it) or answered with a
    hint, at most `AgentConfig.corrections` times. The sample is always what the policy
    sampled. `cancel` ends the episode early as a truncated (masked) one."""
    start = time.monotonic()
    messages = env.reset(task, config.hooks)
    tool_choice, corrections = "required" if config.first_call else "auto", 0
    samples: list[Sample] = []
    info: dict[str, Any] = {"hooks": list(config.hooks), "model_seconds": 0.0,
                            "repairs": {}, "corrections": 0}
    for turn_no in range(1, config.max_turns + 1):
        if time.monotonic() - start > config.max_seconds or (cancel and cancel.is_set()):
            break
        last = config.answer_turn and turn_no == config.max_turns
        if last:
            tool_choice = "none"
        t0 = time.monotonic()
        try:
            turn = model.complete(messages, tools, Sampling(config.max_tokens,
                                                            config.temperature, tool_choice),
                                  cancel)
        except Cancelled:
            break
        info["model_seconds"] += time.monotonic() - t0
        samples.append(Sample(turn.prompt_ids or [], turn.token_ids or [], turn.logprobs or [],
                              _version(turn.policy_version, model)))
        message = {k: v for k, v in turn.message.items() if k in ("role", "content",
                                                                  "tool_calls")}
        messages.append(message)
        tool_choice = "auto"
        content = message.get("content") or ""
        if last:  # the answer turn: whatever the policy wrote is its answer, never a call
            message.pop("tool_calls", None)
        elif not message.get("tool_calls") and config.hooks:
            repaired = env.repair(content)
            if repaired:
                info["repairs"][repaired[0]] = info["repairs"].get(repaired[0], 0) + 1
                message.update(content="", tool_calls=repaired[1])
            elif corrections < AgentConfig.corrections:
                note, force = env.correct(content)
                if note:
                    corrections += 1
                    messages.append({"role": "user", "content": note})
                    tool_choice = "required" if force else "auto"
                    continue
        if not message.get("tool_calls"):
            reward = env.verify(content)
            return Episode(task.id, group_id, samples, reward, steps=turn_no,
                           seconds=time.monotonic() - start,
                           info={**info, "corrections": corrections, "answer": content})
        messages += env.step(message["tool_calls"])
    info["corrections"] = corrections
    info["truncated"] = True
    return Episode(task.id, group_id, samples, 0.0, steps=len(samples),
                   seconds=time.monotonic() - start, info=info)


def _version(stamped: int | None, model: ChatModel) -> int:
    """The policy version that sampled a turn: the Turn's stamp, else the model's."""
    return stamped if stamped is not None else int(getattr(model, "version", 0))


def masked(episode: Episode) -> bool:
    """Not trained on: a fault, or a straggler cut off by a limit."""
    return episode.fault is not None or bool(episode.info.get("truncated"))


class RolloutManager:
    """Workers over environment servers filling the steps' groups in a fixed order."""

    def __init__(self, model: ChatModel, tasks: list[Task], config: RolloutConfig,
                 make_env: Callable[[int], Env], first_step: int = 0) -> None:
        self.model, self.config, self.make_env = model, config, make_env
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
        self._cancel = threading.Event()  # set by stop(): running episodes end early
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
        self._cancel.set()
        with self._cond:
            self._stopped = True
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
        tools: list[dict[str, Any]] = []
        while (slot := self._take()) is not None:
            group = slot // self.config.group_size
            task = self.order.task(group)
            episode = None
            for attempt in range(self.config.retries + 1):
                try:
                    if env is None:
                        env = self.make_env(index)
                        tools = env.tools()
                    episode = run_episode(self.model, env, tools, task, f"g{group}",
                                          self.config, self._cancel)
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


class RayEnv:
    """An `EnvServer` in its own Ray actor process. A dead actor (the sandbox or its process
    killed) or a call past `call_timeout` surfaces as `EnvFault`, so the manager treats it
    like any environment fault; the actor is killed on close."""

    def __init__(self, config: EnvConfig, call_timeout: float, scratch: str | None = None,
                 num_cpus: float = 0.0) -> None:
        import ray

        self._ray = ray
        self.call_timeout = call_timeout
        self.actor = ray.remote(num_cpus=num_cpus, max_restarts=0)(EnvServer).remote(
            config, scratch)

    def _call(self, method: str, *args: Any) -> Any:
        ray = self._ray
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.call_timeout)
        except ray.exceptions.GetTimeoutError:
            raise EnvFault("tool_timeout", f"{method} took over {self.call_timeout}s") from None
        except ray.exceptions.RayActorError as exc:
            raise EnvFault("sandbox_killed", type(exc).__name__) from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, EnvFault):
                raise EnvFault(cause.kind, str(cause)) from None
            raise EnvFault("verifier_crash" if method == "verify" else "sandbox_killed",
                           str(cause)[:200]) from None

    def tools(self) -> list[dict[str, Any]]:
        return self._call("tools")

    def reset(self, task: Task, hooks: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        return self._call("reset", task, hooks)

    def step(self, tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self._call("step", tool_calls)

    def repair(self, content: str) -> tuple[str, list[dict[str, Any]]] | None:
        return self._call("repair", content)

    def correct(self, content: str) -> tuple[str | None, bool]:
        return self._call("correct", content)

    def verify(self, answer: str) -> float:
        return self._call("verify", answer)

    def close(self) -> None:
        try:
            self._call("close")
        finally:
            self._ray.kill(self.actor)
