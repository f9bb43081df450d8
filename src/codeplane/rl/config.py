"""`codeplane rl train CONFIG`: the TOML file, validated by pydantic.

One file says everything a run does, so a run is reproducible from its config and seed:
which repositories make the tasks (train and held-out split by repository), how episodes are
rolled out (`[rollout]`), what the environment servers run (`[env]`), which sampler and which
trainer (`[sampler]`, `[trainer]`: the trainer's own pydantic config, embedded as a table),
how Ray is started (`[ray]`, local and small by default) and where the index that episodes'
codebase_search ranks lives (`[search]`, rl/index.py). Unknown keys are errors: a typo
must not silently train with defaults.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from codeplane.rl.commits import check_split, is_benchmark, is_path
from codeplane.rl.envserver import EnvConfig
from codeplane.rl.index import SearchConfig
from codeplane.rl.rollout import RolloutConfig
from codeplane.rl.warmstart import SOLVERS, solver_for

_STRICT = {"extra": "forbid"}


class TasksConfig(BaseModel):
    """`[tasks]`: repositories as PyPI sdists ("name==version", fetched once into
    `~/.codeplane/rl/`) or local directories; train and held-out never share one."""

    model_config = _STRICT
    train: list[str] = Field(default_factory=list, description="sdists for training")
    heldout: list[str] = Field(default_factory=list, description="sdists for held-out eval")
    train_dirs: list[str] = Field(default_factory=list, description="local repositories")
    heldout_dirs: list[str] = Field(default_factory=list, description="local repositories")
    max_train: int = Field(64, ge=1, description="tasks sampled from the train repositories")
    max_heldout: int = Field(16, ge=1, description="tasks sampled from the held-out ones")
    seed: int = Field(0, description="draws the two samples; not `[rollout] seed`, so every "
                                     "seed of an experiment trains and is evaluated on the "
                                     "same tasks")
    instruction: Literal["search", "grep"] = Field(
        "search", description='locate only: "search" asks the question; "grep" also names '
                              'the grep call that finds the answer (rl/tasks.py)')
    family: Literal["locate", "testfix", "commits", "fixcommits"] = Field(
        "locate", description='locate: "where is X implemented? answer path:line" '
                              '(rl/tasks.py); testfix: "make the failing test pass", one '
                              'function broken, its doctests as the test (rl/testfix.py); '
                              'commits: a real change request -> the files its commit '
                              'changed (rl/commits.py); fixcommits: a real commit\'s change '
                              'to one function removed, its tests to pass (rl/fixcommits.py)')
    train_repos: list[str] = Field(default_factory=list, description=(
        "commits only: git histories, as owner/name, an https URL or a path (/, ~, ./ or "
        "../); never a benchmark repository"))
    heldout_repos: list[str] = Field(default_factory=list, description="commits only")
    commits: int = Field(400, ge=1, description="commits only: the newest non-merge commits "
                                                "read per repository")
    mirrors: str | None = Field(None, description="commits only: a folder of mirrors "
                                                  "(owner+name/repo) found before cloning")

    @model_validator(mode="after")
    def _split(self) -> TasksConfig:
        if self.family in ("commits", "fixcommits"):
            if not self.train_repos or self.train or self.train_dirs:
                raise ValueError(f"[tasks] family \"{self.family}\" reads train_repos and "
                                 "heldout_repos only (train_repos is required)")
            check_split(self.train_repos, self.heldout_repos)
            return self
        if self.train_repos or self.heldout_repos:
            raise ValueError("[tasks] train_repos and heldout_repos are the commits family's "
                             "and the fixcommits family's")
        if not (self.train or self.train_dirs):
            raise ValueError("[tasks] needs train or train_dirs")
        shared = set(self.train) & set(self.heldout) | set(self.train_dirs) & set(
            self.heldout_dirs)
        if shared:
            raise ValueError(f"[tasks] train and held-out share {sorted(shared)}: the split "
                             "is by repository")
        benchmarks = sorted(s for s in [*self.train, *self.heldout]
                            if is_benchmark(re.split(r"[=<>!~\[; ]", s, maxsplit=1)[0]))
        if benchmarks:
            raise ValueError(f"[tasks] names benchmark projects {benchmarks}: tasks come from "
                             "code disjoint from every benchmark (rl/commits.py)")
        return self


class SamplerConfig(BaseModel):
    """`[sampler]`: the policy that generates rollouts."""

    model_config = _STRICT
    kind: Literal["torch", "llama", "http"] = Field(
        "llama", description="torch: the trainer's policy in torch; llama: llama.cpp with the "
                             "current LoRA; http: any OpenAI-compatible server (rollouts and "
                             "evaluation only: no token ids to train on)")
    model: str = Field("code-small", description="registry name (torch, llama) or the "
                                                 "server's model name (http)")
    base_url: str = Field("http://127.0.0.1:8000/v1", description="http only")
    threads: int | None = Field(None, ge=1, description="llama only: the engine's CPU threads "
                                                        "(default: the engine's, all cores). "
                                                        "1 leaves a core to the trainer, which "
                                                        "runs at the same time with staleness "
                                                        ">= 1")


class RayConfig(BaseModel):
    """`[ray]`: a local Ray, loopback only, with few CPUs (the machine is shared)."""

    model_config = _STRICT
    num_cpus: int = Field(2, ge=1)
    env_cpus: float = Field(0.0, ge=0, description="CPUs Ray reserves per environment actor "
                                                   "(0: none; the processes share the "
                                                   "machine, and evaluation actors never wait "
                                                   "for training ones)")
    call_timeout: float = Field(120.0, gt=0, description="seconds for one environment call "
                                                         "before it counts as a tool timeout")


class WarmStartConfig(BaseModel):
    """`[warm_start]`: imitation steps on a scripted solver's solved train episodes before
    RL (rl/warmstart.py; 0 steps: none)."""

    model_config = _STRICT
    steps: int = Field(0, ge=0, description="supervised steps on the solver's episodes")
    episodes: int = Field(16, ge=1, description="solver episodes on train tasks (those "
                                                "scoring min_reward or more are imitated)")
    min_reward: float = Field(1.0, gt=0, le=1, description="the least reward of an imitated "
                                                           "episode (1: solved only)")
    batch: int = Field(4, ge=1, description="episodes per step (all their turns)")
    lr: float | None = Field(None, gt=0, description="learning rate of these steps "
                                                     "(default: the trainer's)")


class RunConfig(BaseModel):
    """The whole file."""

    model_config = _STRICT
    steps: int = Field(3, ge=0, description="RL steps (0: the warm start and its held-out "
                                            "evaluation only)")
    out: str = Field("~/.codeplane/rl/runs/default", description="JSONL, PNG, checkpoints")
    eval_every: int = Field(0, ge=0, description="held-out evaluation every N steps "
                                                 "(0: before the first and after the last)")
    eval_before: bool = Field(True, description="held-out evaluation of the policy before "
                                                "any training (false: skip it; "
                                                "bench/rl/product.py measures the base model "
                                                "through the product)")
    trainer_kind: Literal["torch", "none"] = Field(
        "torch", description="none: rollouts and evaluation only (a baseline)")
    init: str | None = Field(None, description=(
        "another run's `out`: the policy starts from its checkpoint's LoRA and version (RL "
        "after that run's warm start) instead of the base model, with RNGs (and unless "
        "init_optimizer, an optimiser) of its own; once this run has a checkpoint, a "
        "resume starts there"))
    init_optimizer: bool = Field(False, description=(
        "with init: also take that run's AdamW moments (with this run's lr), so the first "
        "update follows the gradients' size instead of moving every LoRA weight by lr "
        "(a fresh AdamW's first step; docs/rl.md, after the sixth run)"))
    train_lock: str | None = Field(None, description=(
        "a file whose lock every RL trainer step holds: runs that name the same file (seeds "
        "side by side on one machine) train one at a time, so their peak memories never "
        "add up (docs/rl.md, the fifth product-environment run)"))
    tasks: TasksConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    search: SearchConfig = Field(default_factory=SearchConfig)
    trainer: dict[str, Any] = Field(default_factory=dict,
                                    description="the trainer's own config (rl/trainer.py)")

    @property
    def out_dir(self) -> Path:
        return Path(self.out).expanduser()

    @property
    def train_lock_path(self) -> Path | None:
        return Path(self.train_lock).expanduser() if self.train_lock else None

    @property
    def init_dir(self) -> Path | None:
        """The checkpoint directory `init` names."""
        return Path(self.init).expanduser() / "checkpoint" if self.init else None

    @model_validator(mode="after")
    def _one_starting_policy(self) -> RunConfig:
        if self.init and self.warm_start.steps:
            raise ValueError("init starts from another run's policy and [warm_start] makes "
                             "one: set one of them")
        if self.init_optimizer and not self.init:
            raise ValueError("init_optimizer takes init's optimiser state: it needs init")
        if self.init and self.trainer_kind != "torch":
            raise ValueError('init loads a trainer checkpoint: it needs trainer_kind "torch"')
        return self

    @model_validator(mode="after")
    def _warm_start_fits_the_tasks(self) -> RunConfig:
        if self.warm_start.steps and solver_for(self.tasks.family,
                                                self.tasks.instruction) is None:
            known = ", ".join(f"{f} ({i} instruction)" if i else f for f, i in SOLVERS)
            raise ValueError("[warm_start] imitates a scripted solver, and there is one for "
                             f"these task families only: {known}")
        return self


def _beside(config: Path, path: str) -> str:
    """A path of the config, relative to the config's folder."""
    return str((config.parent / Path(path).expanduser()).resolve())


class ConfigError(ValueError):
    """The config file cannot be read or is invalid; the message says where."""


def load_config(path: Path) -> RunConfig:
    """Read and validate a run's TOML; relative directories are relative to the file."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    tasks = raw.get("tasks")
    if isinstance(tasks, dict):
        for key in ("train_dirs", "heldout_dirs", "train_repos", "heldout_repos"):
            if isinstance(tasks.get(key), list):
                tasks[key] = [_beside(path, d) if isinstance(d, str) and (
                    key.endswith("_dirs") or is_path(d)) else d for d in tasks[key]]
        if isinstance(tasks.get("mirrors"), str):
            tasks["mirrors"] = _beside(path, tasks["mirrors"])
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(file)'}: {e['msg']}"
                           for e in exc.errors())
        raise ConfigError(f"{path}: {errors}") from None
