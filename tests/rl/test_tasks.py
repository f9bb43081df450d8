"""The locate task family as the learning-curve run uses it (examples/rl/curve.toml): an
instruction whose recipe (grep a few words of the quoted docstring, answer with the hit's
path:line) earns the full reward through the real sandbox, the product's grep and the
verifier."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import make_repo

from codeplane.agent.env import Environment
from codeplane.agent.tools import default_toolset
from codeplane.rl.envserver import EnvServer
from codeplane.rl.tasks import grep_pattern, locate_tasks, score


@pytest.fixture
def tasks(tmp_path: Path):
    return locate_tasks("shapes", make_repo(tmp_path / "shapes"))


def _grep(env: Environment, pattern: str) -> str:
    return default_toolset().execute(env, "grep", {"pattern": pattern}).output


def test_the_instruction_names_the_tool_and_the_answer_format(tasks) -> None:
    """...and gives no example path to copy (code-small answered with the example's path
    instead of searching)."""
    assert all("grep" in t.instruction and "path:line" in t.instruction for t in tasks)
    assert not any("pkg/mod.py" in t.instruction for t in tasks)


def test_the_instructions_recipe_earns_full_reward_on_every_task(tasks, tmp_path) -> None:
    server = EnvServer(scratch=str(tmp_path))
    for task in tasks:
        env = server.open(task)
        summary = task.instruction.split('"')[1]
        hits = _grep(env, " ".join(summary.split()[:3])).splitlines()
        hit = next(h for h in hits if h.startswith(task.path + ":"))
        assert server.verify(hit) == 1.0  # grep's own path:line:text line is an answer
        assert server.verify(":".join(hit.split(":")[:2])) == 1.0  # and path:line alone
    server.close()


def test_score_reads_the_last_location_of_a_grep_style_answer(tasks) -> None:
    area = next(t for t in tasks if t.start == 7)
    assert score(area, 'pkg/shapes.py:8:        """Compute the area of the circle') == 1.0
    assert score(area, "pkg/shapes.py:8:x\npkg/shapes.py:13:y") == 0.5  # the last one counts


def test_grep_instruction_names_a_pattern_that_finds_the_definition(tmp_path) -> None:
    """The "grep" wording names the call; its pattern, run by the product's grep in the
    sandbox, prints a line inside the definition, so `path:line` of that hit scores 1."""
    tasks = locate_tasks("shapes", make_repo(tmp_path / "shapes"), instruction="grep")
    server = EnvServer(scratch=str(tmp_path))
    for task in tasks:
        named = json.loads(re.search(r"Call grep with (\{.*?\})", task.instruction).group(1))
        env = server.open(task)
        hit = re.match(r"([^:\n]+):(\d+):", _grep(env, named["pattern"]))
        assert score(task, f"{hit.group(1)}:{hit.group(2)}") == 1.0, task.instruction
    server.close()


@pytest.mark.parametrize(("summary", "pattern"), [
    ("Compute the area of the circle from its radius.", "Compute the area of the"),
    ("Like `naturalday`, but append a year", "Like"),
    ('Return "x" (or y) quickly', "Return"),
    ("(internal) helper for it", "(internal)"),
])
def test_grep_pattern_stops_before_regex_syntax_and_quotes(summary, pattern) -> None:
    """At most five words, none with regex syntax or a quote (the model copies the pattern
    into JSON; a regex must match itself); a first word that has some is kept alone."""
    assert grep_pattern(summary) == pattern


def test_split_tasks_are_worded_as_the_run_words_them(tmp_path) -> None:
    """An evaluation outside the run (bench/rl/curve.py --evaluate) reads the held-out tasks
    through `split_tasks`; it once rebuilt them with the default wording and so measured a
    grep-trained checkpoint on another question."""
    from codeplane.rl.config import RunConfig
    from codeplane.rl.run import split_tasks

    config = RunConfig.model_validate({"tasks": {
        "train_dirs": [str(make_repo(tmp_path / "train"))],
        "heldout_dirs": [str(make_repo(tmp_path / "heldout"))], "instruction": "grep"}})
    tasks = split_tasks(config, "heldout")
    assert tasks and all("Call grep with" in t.instruction for t in tasks)


def test_every_seed_of_a_run_samples_the_same_tasks(tmp_path) -> None:
    """Seeds of one experiment (`rl train --seed N`) differ in their rollouts, not in the
    tasks they train on and are evaluated on: their held-out results are compared task by
    task. The sample once followed `[rollout] seed`, so two seeds were evaluated on
    different held-out tasks."""
    from codeplane.rl.config import RunConfig
    from codeplane.rl.run import split_tasks

    tasks = {"train_dirs": [str(make_repo(tmp_path / "train"))],
             "heldout_dirs": [str(make_repo(tmp_path / "heldout"))],
             "max_train": 2, "max_heldout": 2}
    samples = [{split: [t.id for t in split_tasks(RunConfig.model_validate(
        {"tasks": tasks, "rollout": {"seed": seed}}), split)] for split in ("train", "heldout")}
        for seed in range(4)]
    assert all(sample == samples[0] for sample in samples)
    everything = split_tasks(RunConfig.model_validate({"tasks": {**tasks, "max_heldout": 99}}),
                             "heldout")
    assert len(everything) > 2  # a sample, so a seed could have changed it
