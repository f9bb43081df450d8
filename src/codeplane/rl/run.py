"""The training loop: rollouts on Ray feed the trainer, the trainer's weights go back to the
sampler, and every step is measured.

    collect step s (blocks until its groups are done; workers meanwhile run up to k steps
    ahead) -> trainer.step(groups) -> sampler.load_weights(weights, version) -> advance

Written per step to `out/steps.jsonl`: reward mean/std, held-out success when evaluated,
samples/s (model turns), sampler busy % (model-call seconds / wall; above 100 % when several
calls overlap), trainer wait % (time blocked on rollouts / wall), the staleness histogram,
the trainer's metrics (log-prob mismatch among them) and faults. `out/curves.png` plots the
reward and held-out curves. After every step the trainer's checkpoint and the step number go
to `out/checkpoint/`; a killed run started again resumes there, with the same data order.

Ray, torch and the trainer are imported here, lazily: nothing in the default install does.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from codeplane.agent import setup as agent_setup
from codeplane.agent.toolset import ToolServices
from codeplane.core.chat import ChatModel
from codeplane.indexing.remote import RemoteError
from codeplane.rl.actor import RayEnv
from codeplane.rl.commits import CommitsError, load_commit_tasks, named_files
from codeplane.rl.config import ConfigError, RunConfig
from codeplane.rl.envserver import EnvConfig
from codeplane.rl.fixcommits import load_fixcommit_tasks
from codeplane.rl.index import RunIndex
from codeplane.rl.rollout import RolloutConfig, RolloutManager, StepData, masked
from codeplane.rl.tasks import Task, fetch_sdist, locate_tasks, sample_tasks
from codeplane.rl.testfix import fix_tasks
from codeplane.rl.types import Episode, Trainer
from codeplane.sandbox import DEFAULT_BACKEND

CACHE = Path("~/.codeplane/rl").expanduser()


@dataclass
class Progress:
    """What the run reports as it goes and at the end (`--json`)."""

    seed: int = 0  # the run's ([rollout] seed): its data order, sampling and trainer
    steps: int = 0
    episodes: int = 0
    samples: int = 0
    seconds: float = 0.0
    rewards: list[tuple[int, float]] = field(default_factory=list)  # (step, mean reward)
    heldout: list[tuple[int, float]] = field(default_factory=list)  # (step, success)
    env_faults: Counter = field(default_factory=Counter)
    trainer_restarts: int = 0
    max_staleness: int = 0
    resumed_from: int = 0
    hooks: list[str] = field(default_factory=list)  # the loop the episodes ran ([]: plain)
    repairs: Counter = field(default_factory=Counter)  # hook name -> turns it repaired
    corrections: int = 0  # hints the product's loop gave instead of ending an episode
    index: dict[str, Any] = field(default_factory=dict)  # what indexing the snapshots cost

    def summary(self) -> dict[str, Any]:
        return {"seed": self.seed, "steps": self.steps, "episodes": self.episodes,
                "samples": self.samples,
                "seconds": round(self.seconds, 1),
                "samples_per_second": round(self.samples / self.seconds, 3)
                if self.seconds else 0.0,
                "reward_first": self.rewards[0][1] if self.rewards else None,
                "reward_last": self.rewards[-1][1] if self.rewards else None,
                "heldout_first": self.heldout[0][1] if self.heldout else None,
                "heldout_last": self.heldout[-1][1] if self.heldout else None,
                "env_faults": sum(self.env_faults.values()),
                "faults": dict(self.env_faults), "trainer_restarts": self.trainer_restarts,
                "max_staleness": self.max_staleness, "resumed_from": self.resumed_from,
                "hooks": self.hooks, "repairs": dict(self.repairs),
                "corrections": self.corrections, "index": self.index}


def load_tasks(specs: list[str], dirs: list[str], limit: int, seed: int,
               family: str = "locate", backend: str = DEFAULT_BACKEND,
               instruction: str = "search") -> list[Task]:
    """Tasks from sdists (fetched once into the cache) and local repositories, of the
    configured family (testfix tasks are built in `backend` sandboxes, then cached)."""
    missing = [d for d in dirs if not Path(d).is_dir()]
    if missing:
        raise ConfigError(f"[tasks] names repositories that are not directories: {missing}")
    roots = [(spec, fetch_sdist(spec, CACHE)) for spec in specs]
    roots += [(Path(d).name, Path(d)) for d in dirs]
    if family == "testfix":
        tasks: list[Any] = [t for name, root in roots
                            for t in fix_tasks(name, root, CACHE, backend)]
    else:
        tasks = [t for name, root in roots for t in locate_tasks(name, root, instruction)]
    return sample_tasks(tasks, limit, seed)


Parts = tuple[ChatModel, "Trainer | None", Callable[[], None]]


def make_parts(config: RunConfig, out: Path) -> Parts:
    """The sampler, the trainer and what closes them, as the config names them (the torch
    side lives in rl/policy.py, rl/adapter.py and rl/trainer.py). The torch sampler shares
    the trainer's model (one copy in memory); the llama.cpp sampler gets the trainer's LoRA
    written as a GGUF adapter and swapped into the engine this run owns."""
    trainer = None
    tcfg: Any = None
    if config.trainer_kind == "torch":
        from codeplane.config import load_settings
        from codeplane.rl.trainer import PolicyTrainer, TrainerConfig

        try:
            tcfg = TrainerConfig.model_validate({
                "model": config.sampler.model, "seed": config.rollout.seed,
                "temperature": config.rollout.temperature or 1.0, **config.trainer})
        except ValueError as exc:
            raise ConfigError(f"[trainer]: {exc}") from None
        if config.rollout.temperature and tcfg.temperature != config.rollout.temperature:
            raise ConfigError("[trainer] temperature must equal [rollout] temperature: the "
                              "trainer scores tokens under the distribution they came from")
        trainer = PolicyTrainer(tcfg, load_settings())
    kind = config.sampler.kind
    if kind == "http":
        from codeplane.core.chat import HttpChatModel

        http = HttpChatModel(config.sampler.base_url, config.sampler.model)
        return http, trainer, http.close
    if trainer is None:
        raise ConfigError(f"[sampler] kind {kind!r} samples from the trainer's policy: set "
                          "trainer_kind = \"torch\" (or kind = \"http\" for rollouts only)")
    if kind == "torch":
        from codeplane.rl.policy import TorchSampler

        torch_sampler = TorchSampler(trainer.policy, config.sampler.model, config.rollout.seed)
        return torch_sampler, trainer, torch_sampler.close
    from codeplane.config import load_settings
    from codeplane.models.engine import Engine
    from codeplane.rl.adapter import LlamaSampler

    settings = load_settings()
    if config.sampler.threads:
        settings = settings.model_copy(update={"engine": settings.engine.model_copy(
            update={"n_threads": config.sampler.threads})})
    engine = Engine(settings)
    sampler = LlamaSampler(engine, config.sampler.model, out / "adapters", tcfg.lora_alpha,
                           config.rollout.seed)
    return sampler, trainer, engine.close


def env_factory(config: RunConfig, scratch: Path) -> Callable[[int], RayEnv]:
    """Environment servers as Ray actors; each new one gets its own fault seed."""
    seeds = itertools.count(config.env.seed)

    def make(index: int) -> RayEnv:
        env = config.env.model_copy(update={"seed": next(seeds)})
        return RayEnv(EnvConfig.model_validate(env.model_dump()), config.ray.call_timeout,
                      str(scratch), config.ray.env_cpus)

    return make


def split_tasks(cfg: RunConfig, split: Literal["train", "heldout"]) -> list[Task]:
    """The run's train or fixed held-out tasks, worded as the run words them: one place, so
    an evaluation outside the run (bench/rl/curve.py) measures the same tasks."""
    tc = cfg.tasks
    specs, dirs, limit = ((tc.train, tc.train_dirs, tc.max_train) if split == "train"
                          else (tc.heldout, tc.heldout_dirs, tc.max_heldout))
    if tc.family in ("commits", "fixcommits"):
        repos = tc.train_repos if split == "train" else tc.heldout_repos
        mirrors = tc.mirrors and Path(tc.mirrors)
        try:
            if tc.family == "fixcommits":
                return load_fixcommit_tasks(repos, CACHE, tc.commits, mirrors, limit, tc.seed,
                                            cfg.env.backend)
            return load_commit_tasks(repos, CACHE, tc.commits, mirrors, limit, tc.seed)
        except CommitsError as exc:
            raise ConfigError(str(exc)) from None
    return load_tasks(specs, dirs, limit, tc.seed, tc.family, cfg.env.backend, tc.instruction)


@dataclass
class Evaluation:
    """A held-out evaluation: the share of tasks solved, what the policy did on each
    (`held_out_record`): a success rate alone cannot say why a policy fails, and its
    `conduct` over them."""

    success: float
    episodes: list[dict[str, Any]] = field(default_factory=list)
    conduct: dict[str, Any] = field(default_factory=dict)


def save_config(config: RunConfig) -> Path:
    """`out/config.json`, written at the run's start: the run's config and the agent setup
    its episodes run in (`agent`), which `codeplane model add --from-run` serves a checkpoint
    of this run with."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    path = config.out_dir / "config.json"
    setup = agent_setup.record(config.rollout.agent_config(), config.rollout.hooks)
    path.write_text(json.dumps({"agent": setup, "run": config.model_dump(mode="json")},
                               indent=2) + "\n")
    return path


def evaluate(model: ChatModel, tasks: list[Task], config: RunConfig,
             make_env: Callable[[int], RayEnv], version: int,
             services: Callable[[Task], ToolServices] | None = None) -> Evaluation:
    """Held-out success: one greedy episode per task, the share with full reward;
    `services` as the run's episodes get them (`RunIndex.services`)."""
    if not tasks:
        return Evaluation(math.nan)
    greedy = config.rollout.model_copy(update={"group_size": 1, "groups_per_step": len(tasks),
                                               "temperature": 0.0, "max_staleness": 0})
    manager = RolloutManager(model, tasks, RolloutConfig.model_validate(greedy.model_dump()),
                             make_env, services=services).start()
    try:
        data = manager.collect(0, version)
    finally:
        manager.stop()
    by_id = {t.id: t for t in tasks}
    return Evaluation(sum(e.reward == 1.0 for e in data.episodes) / len(tasks),
                      [held_out_record(e, by_id[e.task_id]) for e in data.episodes],
                      conduct(data.episodes))


def conduct(episodes: list[Episode]) -> dict[str, Any]:
    """How the policy worked, over the episodes an agent ran (a faulted one did not): issue
    31's numbers per step and per evaluation. Success (the share with reward 1), the share
    that called codebase_search and its calls per episode, tool calls per model turn (and on
    turns that read files), turns and seconds per episode, and `cut`, the episodes the
    wall-clock limit cancelled (`[rollout] max_seconds`)."""
    ran = [e for e in episodes if e.fault is None]
    if not ran:
        return {}
    calls = [n for e in ran for n in e.info.get("calls", [])]
    reads = [n for e in ran for n in e.info.get("read_turn_calls", [])]
    searches = [e.info.get("searches", 0) for e in ran]
    return {"episodes": len(ran),
            "success": round(statistics.fmean(e.reward == 1.0 for e in ran), 3),
            "search_share": round(statistics.fmean(n > 0 for n in searches), 3),
            "searches_per_episode": round(statistics.fmean(searches), 3),
            "calls_per_turn": round(statistics.fmean(calls), 3) if calls else None,
            "calls_per_read_turn": round(statistics.fmean(reads), 3) if reads else None,
            "turns_per_episode": round(statistics.fmean(e.info.get("turns", 0) for e in ran), 3),
            "seconds_per_episode": round(statistics.fmean(e.seconds for e in ran), 1),
            "cut": sum(e.info.get("status") == "cancelled" for e in ran)}


def held_out_record(episode: Episode, task: Task) -> dict[str, Any]:
    """What the policy did on one held-out task: its end status, final answer (the last 400
    characters), the files it named and those the task wanted (commit tasks), the reward, its
    turns, codebase_search calls, tool calls per turn and on read turns, and seconds."""
    info, answer = episode.info, episode.info.get("answer") or ""
    return {"task": episode.task_id, "status": info.get("status"), "fault": episode.fault,
            "answer": answer[-400:], "named": named_files(answer),
            "files": list(getattr(task, "files", ())), "reward": round(episode.reward, 3),
            **{k: info.get(k) for k in ("turns", "searches", "calls", "read_turn_calls")},
            "seconds": round(episode.seconds, 1)}


def step_record(data: StepData, metrics: dict[str, Any], wall: float, waited: float,
                model_seconds: float, faults: Counter) -> dict[str, Any]:
    """One JSONL line."""
    rewards = [e.reward for e in data.episodes if not masked(e)]
    samples = sum(len(e.samples) for e in data.episodes)
    repairs: Counter = Counter()
    for e in data.episodes:
        repairs.update(e.info.get("repairs", {}))
    return {"step": data.step, "episodes": len(data.episodes), "groups": len(data.groups),
            "repairs": dict(repairs),
            "statuses": dict(Counter(e.info["status"] for e in data.episodes
                                     if "status" in e.info)),
            "corrections": sum(e.info.get("corrections", 0) for e in data.episodes),
            "masked": sum(masked(e) for e in data.episodes),
            "reward_mean": statistics.fmean(rewards) if rewards else None,
            "reward_std": statistics.pstdev(rewards) if rewards else None,
            "samples": samples, "samples_per_second": round(samples / wall, 3) if wall else 0,
            "sampler_busy": round(100 * model_seconds / wall, 1) if wall else 0,
            "trainer_wait": round(100 * waited / wall, 1) if wall else 0,
            "staleness": {str(k): v for k, v in sorted(data.staleness.items())},
            "stale_dropped": data.stale_dropped, "faults": dict(faults),
            "mismatch": {k: v for k, v in metrics.items() if "mismatch" in k},
            "conduct": conduct(data.episodes), "trainer": metrics}


def start_ray(num_cpus: int) -> None:
    """A local Ray on loopback only: Ray's single-machine mode (its default on macOS and
    Windows) binds every port to 127.0.0.1 instead of the host's network address. Ray reads
    the switch when it is first imported, so a process that imported ray earlier without it
    is refused rather than exposed."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    addresses = {node["NodeManagerAddress"] for node in ray.nodes()}
    if addresses != {"127.0.0.1"}:
        ray.shutdown()
        raise RuntimeError(f"Ray listens on {sorted(addresses)}, not only 127.0.0.1: ray was "
                           "imported before start_ray; set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 "
                           "before importing it")


class TrainingRun:
    """One training run: Ray, environment servers, sampler, trainer, the step loop."""

    def __init__(self, config: RunConfig, on_step: Callable[[dict], None] | None = None
                 ) -> None:
        self.config, self.on_step = config, on_step or (lambda record: None)
        self.out = config.out_dir
        self.progress = Progress(config.rollout.seed, hooks=list(config.rollout.hooks))
        self.warm_started = False  # the warm start ran (read back from a checkpoint)
        self.index = RunIndex(config.search)

    def train(self, sampler: ChatModel | None = None, trainer: Trainer | None = None
              ) -> dict[str, Any]:
        """The whole run. `sampler` and `trainer` replace the configured ones (benchmarks
        drive the real loop with a scripted policy and a stand-in trainer)."""
        cfg = self.config
        tc = cfg.tasks
        train_tasks = split_tasks(cfg, "train")
        heldout = split_tasks(cfg, "heldout")
        if not train_tasks:
            raise ConfigError("the train repositories make no tasks of the family "
                              f"{tc.family!r} (locate: documented definitions; testfix: "
                              "functions with doctests that pass)")
        save_config(cfg)
        (self.out / "scratch").mkdir(exist_ok=True)
        start_ray(cfg.ray.num_cpus)
        import ray  # only after start_ray: the loopback switch is read at ray's first import

        close: Callable[[], None] = lambda: None
        try:
            self._index(train_tasks + heldout)
            if sampler is None:
                sampler, trainer, close = make_parts(cfg, self.out)
            return self._loop(sampler, trainer, train_tasks, heldout)
        finally:
            close()
            self.index.close()
            ray.shutdown()

    def _index(self, tasks: list[Task]) -> None:
        """Index every task snapshot (rl/index.py); each sync's report goes to
        `out/index.jsonl`, the totals to the summary."""
        started = time.monotonic()
        try:
            reports = self.index.open().index(t.snapshot for t in tasks)
        except RemoteError as exc:  # a [search] server that is down, or refuses us
            raise ConfigError(f"search.server: cannot index the task snapshots: {exc}"
                              ) from None
        with (self.out / "index.jsonl").open("a", encoding="utf-8") as log:
            for report in reports:
                log.write(json.dumps(report.as_dict() | {"time": time.time()}) + "\n")
        self.progress.index = {
            "server": self.config.search.server, "snapshots": len(reports),
            "files_changed": sum(r.files_changed for r in reports),
            "chunks_embedded": sum(r.chunks_embedded for r in reports),
            "chunks_reused": sum(r.chunks_reused for r in reports),
            "seconds": round(time.monotonic() - started, 1)}

    def _loop(self, sampler: ChatModel, trainer: Trainer | None, train_tasks: list[Task],
              heldout: list[Task]) -> dict[str, Any]:
        cfg, progress = self.config, self.progress
        make_env = env_factory(cfg, self.out / "scratch")
        first = self._resume(sampler, trainer)
        version = trainer.version if trainer else 0
        warm = cfg.warm_start.steps > 0 and trainer is not None
        if heldout and cfg.eval_before and first == 0 and not (warm and self.warm_started):
            self._heldout(0, evaluate(sampler, heldout, cfg, make_env, version,
                                      self.index.services), "init" if cfg.init else "")
        if warm and first == 0 and not self.warm_started:
            self._warm_start(sampler, trainer, train_tasks, heldout, make_env)
        if first < cfg.steps:  # steps = 0: the warm start (and its evaluation) only
            self._steps(first, sampler, trainer, train_tasks, heldout, make_env)
        plot(progress, self.out / "curves.png")
        return progress.summary()

    def _steps(self, first: int, sampler: ChatModel, trainer: Trainer | None,
               train_tasks: list[Task], heldout: list[Task],
               make_env: Callable[[int], RayEnv]) -> None:
        """The RL steps from `first` on, then the held-out evaluation after the last."""
        cfg, progress = self.config, self.progress
        transcripts = self.out / "transcripts" if cfg.rollout.transcripts else None
        manager = RolloutManager(sampler, train_tasks, cfg.rollout, make_env, first,
                                 transcripts, self.index.services).start()
        start = time.monotonic()
        log = (self.out / "steps.jsonl").open("a", encoding="utf-8")
        try:
            for step in range(first, cfg.steps):
                record = self._step(step, manager, sampler, trainer, heldout, make_env)
                record["time"] = time.time()  # wall clock of the step's end (curves by time)
                log.write(json.dumps(record) + "\n")
                log.flush()
                self.on_step(record)
        finally:
            manager.stop()
            log.close()
        progress.seconds = time.monotonic() - start
        progress.env_faults = manager.faults
        if heldout and (not cfg.eval_every or cfg.steps % cfg.eval_every):
            version = trainer.version if trainer else 0
            self._heldout(cfg.steps, evaluate(sampler, heldout, cfg, make_env, version,
                                              self.index.services))

    def _step(self, step: int, manager: RolloutManager, sampler: ChatModel,
              trainer: Trainer | None, heldout: list[Task],
              make_env: Callable[[int], RayEnv]) -> dict[str, Any]:
        cfg, progress = self.config, self.progress
        t0, busy0 = time.monotonic(), manager.model_seconds
        data = manager.collect(step, trainer.version if trainer else 0)
        waited = time.monotonic() - t0
        metrics = self._train(trainer, data) if trainer and data.groups else {}
        if trainer is not None:
            sync_sampler(sampler, trainer)
            self._checkpoint(trainer, step + 1)
        manager.advance(step + 1)
        wall = time.monotonic() - t0
        record = step_record(data, metrics, wall, waited, manager.model_seconds - busy0,
                             manager.faults)
        record["hooks"] = list(cfg.rollout.hooks)
        progress.steps = step + 1
        progress.episodes += len(data.episodes)
        progress.repairs.update(record["repairs"])
        progress.corrections += record["corrections"]
        progress.samples += record["samples"]
        if record["reward_mean"] is not None:
            progress.rewards.append((step + 1, record["reward_mean"]))
        progress.max_staleness = max([progress.max_staleness,
                                      *(k for k, n in data.staleness.items() if n)])
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and heldout:
            record["heldout_success"] = self._heldout(step + 1, evaluate(
                sampler, heldout, cfg, make_env, trainer.version if trainer else 0,
                self.index.services))
        return record

    def _warm_start(self, sampler: ChatModel, trainer: Any, tasks: list[Task],
                    heldout: list[Task], make_env: Callable[[int], RayEnv]) -> None:
        """Imitation steps on the scripted solver's solved train episodes (rl/warmstart.py),
        then the weights to the sampler, a checkpoint and a held-out evaluation; each step's
        numbers go to `out/warmstart.jsonl`."""
        from codeplane.rl.warmstart import batches, demonstrations, solver_for

        cfg, ws = self.config, self.config.warm_start
        solver = solver_for(cfg.tasks.family, cfg.tasks.instruction)(trainer.policy)
        greedy = cfg.rollout.model_copy(update={"group_size": 1, "groups_per_step": ws.episodes,
                                                "temperature": 0.0, "max_staleness": 0,
                                                "hooks": ()})
        manager = RolloutManager(solver, tasks, RolloutConfig.model_validate(
            greedy.model_dump()), make_env, services=self.index.services).start()
        try:
            data = manager.collect(0, 0)
        finally:
            manager.stop()
        demos = demonstrations(data.episodes, ws.min_reward)
        if not demos:
            raise ConfigError(f"no {solver.name} episode scored {ws.min_reward} or more")
        with (self.out / "warmstart.jsonl").open("a", encoding="utf-8") as log:
            for step, batch in enumerate(batches(demos, ws.steps, ws.batch,
                                                 cfg.rollout.seed)):
                metrics = trainer.imitate([s for turns in batch for s in turns], ws.lr)
                log.write(json.dumps({"step": step, "imitated": len(demos),
                                      "solved": sum(e.reward == 1.0 for e in data.episodes),
                                      "episodes": len(data.episodes), **metrics,
                                      "time": time.time()}) + "\n")
                log.flush()
        sync_sampler(sampler, trainer)
        self.warm_started = True  # before the checkpoint: a resume must not warm-start again
        self._checkpoint(trainer, 0)
        if heldout:
            self._heldout(0, evaluate(sampler, heldout, cfg, make_env, trainer.version,
                                      self.index.services),
                          "warm_start")

    def _heldout(self, steps: int, evaluation: Evaluation, phase: str = "") -> float:
        """Record an evaluation, also in `out/heldout.jsonl` (with the time and what the
        policy did on each task): the one before the first step and the one after the last
        are in no step's line, and a run that is stopped never prints its summary. `phase`
        "warm_start": after the warm start, "init": `init`'s policy before this run's first step.
        Returns the success."""
        self.progress.heldout.append((steps, evaluation.success))
        record = {"steps": steps, "heldout_success": evaluation.success, "time": time.time(),
                  "conduct": evaluation.conduct, "episodes": evaluation.episodes}
        with (self.out / "heldout.jsonl").open("a", encoding="utf-8") as log:
            log.write(json.dumps(record | ({"phase": phase} if phase else {})) + "\n")
        return evaluation.success

    def _train(self, trainer: Trainer, data: StepData) -> dict[str, Any]:
        """One trainer step. If the trainer raises, it is restarted from its last checkpoint
        and the step retried once: a bad batch must not end a long run. A step with nothing
        to learn from is recorded as skipped without taking `train_lock`."""
        skipped = trainer.nothing_to_learn(data.groups)
        if skipped is not None:
            return skipped
        with train_lock(self.config.train_lock_path):
            try:
                return trainer.step(data.groups)
            except Exception:
                ckpt = self.out / "checkpoint"
                if not (ckpt / "run.json").exists():
                    raise
                self.progress.trainer_restarts += 1
                trainer.load(str(ckpt))
                return trainer.step(data.groups)

    def _checkpoint(self, trainer: Trainer, next_step: int) -> None:
        ckpt = self.out / "checkpoint"
        ckpt.mkdir(exist_ok=True)
        trainer.save(str(ckpt))
        (ckpt / "run.json").write_text(json.dumps({"next_step": next_step,
                                                   "seed": self.config.rollout.seed,
                                                   "warm_started": self.warm_started}))

    def _resume(self, sampler: ChatModel, trainer: Trainer | None) -> int:
        """The step to start at: 0, or where a killed run's checkpoint left off. A run that
        has none yet starts from `init`'s policy when the config names one."""
        state = self.out / "checkpoint" / "run.json"
        if trainer is None:
            return 0
        if not state.exists():
            if self.config.init_dir is not None:
                self._start_from(self.config.init_dir, sampler, trainer)
            return 0
        saved = json.loads(state.read_text())
        if saved.get("seed") != self.config.rollout.seed:
            raise ConfigError(f"{state.parent} was written with seed {saved.get('seed')}; "
                              "resume with the same seed or choose another `out`")
        trainer.load(str(state.parent))
        sync_sampler(sampler, trainer)
        self.warm_started = bool(saved.get("warm_started"))
        self.progress.resumed_from = int(saved["next_step"])
        return self.progress.resumed_from


    def _start_from(self, init: Path, sampler: ChatModel, trainer: Trainer) -> None:
        try:
            trainer.start_from(str(init), self.config.init_optimizer)
        except (OSError, ValueError) as exc:  # no checkpoint there, or another LoRA shape
            raise ConfigError(f"init: {exc}") from None
        sync_sampler(sampler, trainer)


@contextlib.contextmanager
def train_lock(path: Path | None) -> Iterator[None]:
    """Hold `path`'s file lock (`train_lock`) while a trainer step runs, so runs that share
    it train one at a time: side by side on one machine, their peak memories never add up.
    None: no lock."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def sync_sampler(sampler: ChatModel, trainer: Trainer) -> None:
    """Give a sampler that takes weights (not the http one) the trainer's policy."""
    load = getattr(sampler, "load_weights", None)
    if load is not None:
        load(trainer.weights(), trainer.version)


def plot(progress: Progress, path: Path) -> None:
    """Reward per step and held-out success per evaluation, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for series, marker, label in ((progress.rewards, "o", "train reward (mean)"),
                                  (progress.heldout, "s", "held-out success")):
        if series:
            steps, values = zip(*series, strict=True)
            ax.plot(steps, values, marker=marker, label=label)
    ax.set_xlabel("trainer step")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
