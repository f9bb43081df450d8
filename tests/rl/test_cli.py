"""`codeplane rl train CONFIG --json` end to end in a subprocess: real Ray, environment
servers in real sandboxes, the product's tools; the sampler is the scripted loopback model
(the real-model run is examples/rl/smoke.toml) and the trainer is off (trainer_kind none)."""

from __future__ import annotations

import fcntl
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_repo, require_ray, write_config
from helpers import rl_cli as cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "rl"


def test_train_writes_steps_curves_and_the_final_object(provider, tmp_path) -> None:
    require_ray()
    pytest.importorskip("matplotlib")
    make_repo(tmp_path / "train_repo")
    (tmp_path / "held" / "lib").mkdir(parents=True)
    (tmp_path / "held" / "lib" / "text.py").write_text(
        'def shout(s):\n    """Turn a string into upper case with an exclamation."""\n'
        '    return s.upper() + "!"\n')
    provider.reset().script = [{"content": "pkg/shapes.py:8"} for _ in range(12)]
    out = tmp_path / "run"  # --out: not the config's
    config = write_config(tmp_path / "run.toml", f"""
steps = 2
out = "{tmp_path / 'elsewhere'}"
trainer_kind = "none"
[tasks]
train_dirs = ["train_repo"]
heldout_dirs = ["held"]
[rollout]
in_flight = 2
group_size = 2
groups_per_step = 1
max_turns = 2
[sampler]
kind = "http"
model = "scripted"
base_url = "{provider.url}"
[search]
server = "none"  # the scripted answers search nothing (test_index.py runs with the index)
[ray]
num_cpus = 2
""")
    result = cli(str(config), "--json", "--seed", "7", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["seed"] == 7 and not (tmp_path / "elsewhere").exists()
    for key in ("steps", "episodes", "samples_per_second", "reward_first", "reward_last",
                "env_faults", "trainer_restarts", "max_staleness"):
        assert key in summary
    assert summary["steps"] == 2 and summary["episodes"] == 4 and summary["env_faults"] == 0
    assert summary["reward_first"] > 0  # pkg/shapes.py:8 is inside 2 of the 3 definitions
    assert summary["heldout_first"] == 0.0  # the scripted answer is wrong for held-out
    lines = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1]
    assert {"reward_mean", "reward_std", "samples_per_second", "sampler_busy", "trainer_wait",
            "staleness", "mismatch", "faults", "conduct"} <= set(lines[0])
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every request carried the product's tool schemas and its system prompt
    assert all(r["tools"] and r["messages"][0]["role"] == "system" for r in provider.requests)


@pytest.mark.parametrize(("body", "message"), [
    ("steps = 1\n[tasks]\ntrain_dirs = ['a']\n[rollout]\ngroup_sise = 2\n",
     "rollout.group_sise: Extra inputs are not permitted"),
    ("[tasks]\ntrain = ['x==1']\nheldout = ['x==1']\n", "the split is by repository"),
    # bench/tab replays humanize: no family trains or evaluates on a benchmark's code
    ("[tasks]\ntrain = ['toolz==1.0.0']\nheldout = ['humanize==4.11.0']\n",
     "names benchmark projects ['humanize==4.11.0']"),
    ("steps = [", "not valid TOML"),
    # a training-only prompt or toolset is gone: episodes see what the product shows
    ("[tasks]\ntrain_dirs = ['a']\n[env]\nprompt = 'task'\n",
     "env.prompt: Extra inputs are not permitted"),
    ("[tasks]\ntrain_dirs = ['a']\n[env]\ntools = ['grep']\n",
     "env.tools: Extra inputs are not permitted"),
    ("trainer_kind = 'none'\n[tasks]\ntrain_dirs = ['nowhere']\n",
     "not directories"),
    ("[tasks]\ntrain_dirs = ['a']\n[warm_start]\nsteps = 2\n",
     "these task families only: locate (grep instruction), commits"),
    ("init = 'runs/warm'\n[tasks]\ntrain_dirs = ['a']\n[warm_start]\nsteps = 2\n",
     "init starts from another run's policy and [warm_start] makes one"),
    ("init = 'runs/warm'\ntrainer_kind = 'none'\n[tasks]\ntrain_dirs = ['a']\n",
     "init loads a trainer checkpoint"),
    ("init_optimizer = true\n[tasks]\ntrain_dirs = ['a']\n",
     "init_optimizer takes init's optimiser state: it needs init"),
])
def test_bad_config_is_a_clear_error(tmp_path, body, message) -> None:
    result = cli(str(write_config(tmp_path / "bad.toml", body)), timeout=60)
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


class FlakyTrainer:
    """A minimal trainer: counts groups, saves its version, and raises once at `fail_at`
    (a bad batch, an OOM) to show the run reloads the checkpoint instead of dying."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.version, self.fail_at, self.seen = 0, fail_at, []
        self.started_from: str | None = None

    def step(self, groups: list) -> dict[str, float]:
        if self.version == self.fail_at:
            self.fail_at = None
            raise RuntimeError("injected trainer failure")
        self.seen.append([e.task_id for g in groups for e in g])
        self.version += 1
        return {"loss": 0.0, "mismatch_mean": 0.0}

    def weights(self) -> int:
        return self.version

    def save(self, directory: str) -> None:
        (Path(directory) / "flaky.json").write_text(json.dumps({"version": self.version}))

    def load(self, directory: str) -> None:
        self.version = json.loads((Path(directory) / "flaky.json").read_text())["version"]

    def nothing_to_learn(self, groups: list) -> dict[str, float] | None:
        return None

    def start_from(self, directory: str, optimizer: bool = False) -> None:
        self.load(directory)
        self.started_from = directory


def test_a_killed_run_resumes_with_the_same_data_and_a_failing_trainer_restarts(
        tmp_path) -> None:
    require_ray()
    from helpers import GrepPolicy

    from codeplane.rl.config import RunConfig
    from codeplane.rl.run import TrainingRun

    make_repo(tmp_path / "repo")

    def config(steps: int, out: str) -> RunConfig:
        return RunConfig.model_validate({
            "steps": steps, "out": str(tmp_path / out), "trainer_kind": "none",
            "tasks": {"train_dirs": [str(tmp_path / "repo")]}, "search": {"server": "none"},
            "rollout": {"in_flight": 2, "group_size": 2, "groups_per_step": 1,
                        "max_staleness": 0, "seed": 3}})

    whole = FlakyTrainer(fail_at=2)
    summary = TrainingRun(config(4, "whole")).train(GrepPolicy(), whole)
    assert summary["trainer_restarts"] == 1 and whole.version == 4
    first = FlakyTrainer()
    TrainingRun(config(2, "killed")).train(GrepPolicy(), first)  # "killed" after step 2
    policy, resumed = GrepPolicy(), FlakyTrainer()
    summary = TrainingRun(config(4, "killed")).train(policy, resumed)
    assert summary["resumed_from"] == 2 and resumed.version == 4
    assert policy.loads[0] == 2  # the sampler got the checkpoint's weights first
    assert first.seen + resumed.seen == whole.seen


def test_a_run_starts_from_another_runs_policy_then_resumes_its_own(tmp_path) -> None:
    """`init`: the policy of another run's checkpoint is where RL starts (the sampler gets
    it first, and the evaluation before the first step is of it); once the run has written
    its own checkpoint, starting it again resumes there instead."""
    require_ray()
    from helpers import GrepPolicy

    from codeplane.rl.config import ConfigError, RunConfig
    from codeplane.rl.run import TrainingRun

    make_repo(tmp_path / "repo")
    make_repo(tmp_path / "held")

    def config(steps: int, out: str, **top: object) -> RunConfig:
        return RunConfig.model_validate({
            "steps": steps, "out": str(tmp_path / out), **top,
            "tasks": {"train_dirs": [str(tmp_path / "repo")],
                      "heldout_dirs": [str(tmp_path / "held")], "max_heldout": 1},
            "search": {"server": "none"},
            "rollout": {"in_flight": 2, "group_size": 2, "groups_per_step": 1,
                        "max_staleness": 0}})

    TrainingRun(config(3, "warm", eval_before=False)).train(GrepPolicy(), FlakyTrainer())
    init = str(tmp_path / "warm")
    policy, trainer = GrepPolicy(), FlakyTrainer()
    TrainingRun(config(1, "rl", init=init)).train(policy, trainer)
    assert trainer.started_from == str(tmp_path / "warm" / "checkpoint")
    assert policy.loads == [3, 4] and trainer.version == 4
    evaluations = [json.loads(x) for x in (tmp_path / "rl" / "heldout.jsonl").read_text()
                   .splitlines()]
    assert [(e["steps"], e.get("phase")) for e in evaluations] == [(0, "init"), (1, None)]
    policy, again = GrepPolicy(), FlakyTrainer()
    summary = TrainingRun(config(2, "rl", init=init)).train(policy, again)
    assert summary["resumed_from"] == 1 and again.started_from is None
    assert policy.loads[0] == 4 and again.version == 5
    with pytest.raises(ConfigError, match="init: "):
        TrainingRun(config(1, "other", init=str(tmp_path / "nowhere"))).train(
            GrepPolicy(), FlakyTrainer())


class LockedTrainer(FlakyTrainer):
    """Notes whether another holder could take `lock` while it trained."""

    def __init__(self, lock: Path) -> None:
        super().__init__()
        self.lock, self.held = lock, []

    def step(self, groups: list) -> dict[str, float]:
        with self.lock.open("a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.held.append(False)
            except BlockingIOError:
                self.held.append(True)
        return super().step(groups)


def run_with_train_lock(tmp_path: Path, trainer: FlakyTrainer) -> Path:
    """Two steps of GrepPolicy episodes through the real loop, with `train_lock` at
    tmp_path/locks/train.lock; the run's `out`."""
    require_ray()
    from helpers import GrepPolicy

    from codeplane.rl.config import RunConfig
    from codeplane.rl.run import TrainingRun

    make_repo(tmp_path / "repo")
    TrainingRun(RunConfig.model_validate({
        "steps": 2, "out": str(tmp_path / "out"), "trainer_kind": "none",
        "train_lock": str(tmp_path / "locks" / "train.lock"),
        "tasks": {"train_dirs": [str(tmp_path / "repo")]}, "search": {"server": "none"},
        "rollout": {"in_flight": 2, "group_size": 2, "groups_per_step": 1}})
    ).train(GrepPolicy(), trainer)
    return tmp_path / "out"


def test_a_trainer_step_holds_the_train_lock(tmp_path) -> None:
    """`train_lock`: seeds side by side train one at a time (their peak memories add up)."""
    trainer = LockedTrainer(tmp_path / "locks" / "train.lock")
    run_with_train_lock(tmp_path, trainer)
    assert trainer.held == [True, True]


class IdleTrainer(FlakyTrainer):
    """Has nothing to learn from any step (say every group's rewards are equal)."""

    def nothing_to_learn(self, groups: list) -> dict[str, float] | None:
        return {"skipped": 1.0, "groups_kept": 0.0, "version": float(self.version)}


def test_a_step_with_nothing_to_learn_skips_the_trainer_and_its_lock(tmp_path) -> None:
    """A step whose groups the trainer would all drop never reaches `trainer.step`, so it
    never waits on `train_lock` (the sixth run: about 12 minutes waited for nothing); it is
    recorded as skipped, and the run goes on."""
    trainer = IdleTrainer()
    out = run_with_train_lock(tmp_path, trainer)
    assert trainer.seen == [] and trainer.version == 0
    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["trainer"]["skipped"] for s in steps] == [1.0, 1.0]


@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_the_example_configs_are_valid(example) -> None:
    from codeplane.rl.config import load_config

    assert load_config(example).tasks.family


def test_a_run_trains_through_the_loop_its_config_names_and_records_it(tmp_path) -> None:
    """`[rollout] hooks` reaches the episodes, whose agents talk to the Ray environment
    servers, and is recorded per step and in the final object; `transcripts` keeps each
    episode's events in the product's transcript format."""
    require_ray()
    from helpers import GrepPolicy

    from codeplane.agent.hooks import PRODUCT_HOOKS
    from codeplane.rl.config import RunConfig
    from codeplane.rl.run import TrainingRun

    make_repo(tmp_path / "repo")
    config = RunConfig.model_validate({
        "steps": 1, "out": str(tmp_path / "out"), "trainer_kind": "none",
        "tasks": {"train_dirs": [str(tmp_path / "repo")]}, "search": {"server": "none"},
        "rollout": {"in_flight": 2, "group_size": 2, "groups_per_step": 1,
                    "hooks": "product", "transcripts": True}})
    summary = TrainingRun(config).train(GrepPolicy(), None)
    assert summary["hooks"] == list(PRODUCT_HOOKS) and summary["reward_last"] == 1.0
    # the run's config and the agent setup its episodes ran in, for `model add --from-run`
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert RunConfig.model_validate(saved["run"]) == config
    assert saved["agent"] == {"max_steps": 6, "max_tokens": 256, "toolset": "full",
                              "max_result_chars": 6000, "answer_turn": False,
                              "required_steps": 1, "hooks": list(PRODUCT_HOOKS)}
    line = json.loads((tmp_path / "out" / "steps.jsonl").read_text().splitlines()[0])
    assert line["hooks"] == list(PRODUCT_HOOKS) and line["repairs"] == {}
    assert line["statuses"] == {"completed": 2}
    # grep, then the answer: issue 31's numbers per step
    assert {k: v for k, v in line["conduct"].items() if k != "seconds_per_episode"} == {
        "episodes": 2, "success": 1.0, "search_share": 0.0, "searches_per_episode": 0.0,
        "calls_per_turn": 0.5, "calls_per_read_turn": None, "turns_per_episode": 2.0,
        "cut": 0}
    assert line["conduct"]["seconds_per_episode"] > 0
    # step 0's two episodes (workers may have started step 1's: staleness 1)
    transcripts = sorted((tmp_path / "out" / "transcripts").glob("*.jsonl"))
    assert [t.name for t in transcripts][:2] == ["000000-0.jsonl", "000001-0.jsonl"]
    for transcript in transcripts[:2]:
        events = [json.loads(x) for x in transcript.read_text().splitlines()]
        assert events[0]["hooks"] == list(PRODUCT_HOOKS)
        assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed"


def test_held_out_evaluations_keep_what_the_policy_did(tmp_path) -> None:
    """heldout.jsonl keeps, per evaluation and task, the answer, the files it names, the
    reward, turns, codebase_search calls and tool calls per turn; `eval_before = false`
    skips the base policy's evaluation and `steps = 0` runs no RL step."""
    require_ray()
    from helpers import GrepPolicy

    from codeplane.rl.config import RunConfig
    from codeplane.rl.run import TrainingRun

    make_repo(tmp_path / "repo")
    make_repo(tmp_path / "held")

    def run(out: str, **top: object) -> list[dict]:
        TrainingRun(RunConfig.model_validate({
            "out": str(tmp_path / out), "trainer_kind": "none", **top,
            "tasks": {"train_dirs": [str(tmp_path / "repo")],
                      "heldout_dirs": [str(tmp_path / "held")], "max_heldout": 2},
            "search": {"server": "none"},
            "rollout": {"in_flight": 2, "group_size": 2, "groups_per_step": 1}})
        ).train(GrepPolicy(), None)
        return [json.loads(x) for x in (tmp_path / out / "heldout.jsonl").read_text()
                .splitlines()]

    after_one = run("after", steps=1, eval_before=False)
    assert [e["steps"] for e in after_one] == [1]
    episodes = after_one[0]["episodes"]
    assert len(episodes) == 2 and after_one[0]["heldout_success"] == 1.0
    conduct = after_one[0]["conduct"]
    assert conduct["success"] == 1.0 and conduct["calls_per_turn"] == 0.5
    assert conduct["turns_per_episode"] == 2.0 and conduct["cut"] == 0
    for episode in episodes:
        assert episode["status"] == "completed" and episode["reward"] == 1.0
        assert episode["named"] == ["pkg/shapes.py"] and episode["answer"].startswith(
            "pkg/shapes.py:")
        assert episode["turns"] == 2 and episode["searches"] == 0
        assert episode["calls"] == [1, 0] and episode["read_turn_calls"] == []
    only_before = run("none", steps=0)
    assert [e["steps"] for e in only_before] == [0]
    assert not (tmp_path / "none" / "steps.jsonl").exists()


def test_record_setup_writes_an_older_runs_config(tmp_path) -> None:
    """`codeplane rl record-setup CONFIG`: the config.json a run writes at its start, for a
    run from before runs wrote it; a bad config is a clear error."""
    from typer.testing import CliRunner

    from codeplane.rl.cli import rl_app

    config = write_config(tmp_path / "run.toml", f"""
out = "{tmp_path / 'out'}"
[tasks]
train_dirs = ["repo"]
[rollout]
toolset = "core"
max_turns = 4
hooks = "none"
""")
    done = CliRunner().invoke(rl_app, ["record-setup", str(config)])
    assert done.exit_code == 0, done.output
    agent = json.loads((tmp_path / "out" / "config.json").read_text())["agent"]
    assert (agent["toolset"], agent["max_steps"], agent["hooks"]) == ("core", 4, [])
    config.write_text(config.read_text().replace('"core"', '"most"'))
    refused = CliRunner().invoke(rl_app, ["record-setup", str(config)])
    assert refused.exit_code == 2 and "rollout.toolset" in refused.output
