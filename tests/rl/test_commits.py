"""The commits task family (rl/commits.py) on a git history built here: which commits become
tasks, the parent's snapshot, the reward, and the split's refusals. No network: the history
is made with git in the test, with its identity on the command line and an empty HOME."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import helpers

from codeplane.rl import commits, run
from codeplane.rl.commits import (
    BENCHMARK_PROJECTS,
    BENCHMARK_REPOSITORIES,
    INSTRUCTION,
    CommitsError,
    CommitTask,
    check_split,
    commit_tasks,
    export,
    git_dir,
    load_commit_tasks,
    repo_name,
    score,
)
from codeplane.rl.config import ConfigError, load_config
from codeplane.rl.envserver import EnvServer

ROOT = Path(__file__).resolve().parents[2]

SHAPES = "import math\n\n\n" + helpers.SHAPES  # docstrings, a class, a method
UNITS = '''def to_cm(inches):
    return inches * 2.5
'''
REQUEST_AREA = "Use math.pi for the area of a circle instead of a rounded constant"
REQUEST_SQUARE = "Let callers build a square and export it from the package"
REQUEST_UNITS = "Convert inches to centimetres with the exact factor"


def git(repo: Path, *args: str) -> str:
    env = {"PATH": os.environ["PATH"], "HOME": str(repo.parent / "home"),
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    return subprocess.run(["git", "-c", "user.name=Test", "-c", "user.email=test@example.com",
                           "-c", "init.defaultBranch=main", *args], cwd=repo, env=env,
                          check=True, capture_output=True, text=True).stdout


def commit(repo: Path, message: str, files: dict[str, str]) -> str:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    """A repository whose history has three change requests among chores and test-only
    commits; the first commit also plants a symlink out of the tree."""
    repo = tmp_path_factory.mktemp("hist") / "shapes"
    repo.mkdir()
    (repo.parent / "home").mkdir()
    git(repo, "init", "-q")
    (repo / "escape").symlink_to("/etc")
    commit(repo, "Start the shapes library with circles", {
        "pkg/__init__.py": "from pkg.shapes import Circle\n", "pkg/shapes.py": SHAPES,
        "pkg/units.py": UNITS, "tests/test_shapes.py": "def test_x():\n    pass\n"})
    commit(repo, f"{REQUEST_AREA} (#12)\n\nThe old constant drifts.",
           {"pkg/shapes.py": SHAPES.replace("3.14 * self.r", "math.pi * self.r")})
    commit(repo, "Fix typo in the perimeter helper", {
        "pkg/shapes.py": SHAPES.replace("3.14 * self.r", "math.pi * self.r")
        .replace("2 * 3.14 * r", "2 * math.pi * r")})
    commit(repo, "Cover the perimeter with a second case",
           {"tests/test_shapes.py": "def test_x():\n    pass\n\n\ndef test_y():\n    pass\n"})
    shapes = (repo / "pkg/shapes.py").read_text()
    commit(repo, REQUEST_SQUARE, {
        "pkg/__init__.py": "from pkg.shapes import Circle, Square\n",
        "pkg/shapes.py": shapes.replace("\n\ndef perimeter", "\n\nclass Square:\n"
                                        "    def __init__(self, a):\n        self.a = a\n"
                                        "\n\ndef perimeter")})
    commit(repo, REQUEST_UNITS, {"pkg/units.py": UNITS.replace("2.5", "2.54"),
                                 "tests/test_units.py": "def test_cm():\n    pass\n"})
    return repo


@pytest.fixture(scope="module")
def tasks(history, tmp_path_factory) -> list[CommitTask]:
    cache = tmp_path_factory.mktemp("cache")
    return commit_tasks("shapes", history / ".git", cache, 100)


def by_request(tasks: list[CommitTask], request: str) -> CommitTask:
    return next(t for t in tasks if t.request == request)


def test_change_requests_become_tasks_chores_and_test_only_commits_do_not(tasks) -> None:
    """The root commit (no parent), the typo fix (a chore) and the test-only commit are
    left out; the first paragraph is the request, its "(#12)" dropped."""
    assert sorted(t.request for t in tasks) == sorted([REQUEST_AREA, REQUEST_SQUARE,
                                                       REQUEST_UNITS])
    area = by_request(tasks, REQUEST_AREA)
    assert area.instruction == INSTRUCTION.format(request=REQUEST_AREA)
    assert area.instruction.endswith("Which files would this change touch? Answer with "
                                     "their paths.")
    assert "pkg/" not in area.instruction  # the answer is not in the question


def test_the_answer_is_the_changed_source_files_and_definitions(tasks) -> None:
    """Test files are never part of the answer; a change inside a method names the method,
    a class appended between two definitions names none, an import line none."""
    assert by_request(tasks, REQUEST_AREA).files == ("pkg/shapes.py",)
    assert by_request(tasks, REQUEST_AREA).symbols == (("pkg/shapes.py", "Circle.area"),)
    assert by_request(tasks, REQUEST_SQUARE).files == ("pkg/__init__.py", "pkg/shapes.py")
    assert by_request(tasks, REQUEST_SQUARE).symbols == ()
    assert by_request(tasks, REQUEST_UNITS).files == ("pkg/units.py",)
    assert by_request(tasks, REQUEST_UNITS).symbols == (("pkg/units.py", "to_cm"),)


def test_the_snapshot_is_the_parents_tree_without_history_or_links_out(tasks,
                                                                        history) -> None:
    area = by_request(tasks, REQUEST_AREA)
    export(area, history / ".git")
    snap = Path(area.snapshot)
    assert snap.name == area.parent and snap.parent.name == "shapes"
    assert "3.14 * self.r" in (snap / "pkg/shapes.py").read_text()  # before the change
    assert (snap / "tests/test_shapes.py").is_file()
    assert not (snap / ".git").exists()
    assert not (snap / "escape").exists() and not (snap / "escape").is_symlink()
    before = (snap / "pkg/shapes.py").stat().st_mtime_ns
    export(area, history / ".git")  # exported once
    assert (snap / "pkg/shapes.py").stat().st_mtime_ns == before


def test_a_tree_over_the_size_limit_is_not_exported(tasks, history, tmp_path,
                                                     monkeypatch) -> None:
    monkeypatch.setattr(commits, "MAX_SNAPSHOT_BYTES", 100)
    task = dataclasses.replace(by_request(tasks, REQUEST_SQUARE), snapshot=str(tmp_path / "s"))
    with pytest.raises(CommitsError, match="over the limit"):
        export(task, history / ".git")
    assert not (tmp_path / "s").exists()


def test_reward_right_partial_and_wrong_answers(tasks) -> None:
    square = by_request(tasks, REQUEST_SQUARE)
    assert score(square, "It touches `pkg/shapes.py` and pkg/__init__.py.") == 1.0
    assert score(square, "./pkg/shapes.py\n./pkg/__init__.py") == 1.0
    assert score(square, "pkg/shapes.py:5") == pytest.approx(2 / 3)  # one of two files
    assert score(square, "pkg/units.py") == 0.0
    assert score(square, "no files") == 0.0
    area = by_request(tasks, REQUEST_AREA)
    assert score(area, "pkg/shapes.py") == 1.0
    # a wrong file next to the right one: F1 2/3, plus the function's credit x precision
    assert score(area, "pkg/shapes.py, pkg/units.py") == pytest.approx(2 / 3)
    assert score(area, "pkg/shapes.py (Circle.area), pkg/units.py") == pytest.approx(
        2 / 3 + 0.25 * 0.5)
    assert score(area, "area in pkg/units.py") == 0.0  # functions count only with a file


def test_naming_every_file_and_function_earns_little(tasks) -> None:
    units = by_request(tasks, REQUEST_UNITS)
    stuffed = " ".join(f"pkg/m{i}.py" for i in range(20)) + " pkg/units.py to_cm area"
    assert score(units, stuffed) < 0.15


def test_the_environment_verifies_with_the_familys_reward(tasks, history, tmp_path) -> None:
    server = EnvServer(scratch=str(tmp_path))
    units = by_request(tasks, REQUEST_UNITS)
    export(units, history / ".git")
    env = server.open(units)
    assert "2.5" in (Path(env.workspace.root) / "pkg/units.py").read_text()
    assert server.verify("The change is in pkg/units.py (to_cm).") == 1.0
    assert server.verify("pkg/shapes.py") == 0.0
    server.close()


def write(path: Path, tasks_table: str) -> Path:
    path.write_text(f"steps = 1\ntrainer_kind = \"none\"\n[tasks]\n{tasks_table}\n"
                    "[sampler]\nkind = \"http\"\n")
    return path


def test_a_run_loads_the_family_from_a_path_relative_to_its_config(history, tmp_path,
                                                                   monkeypatch) -> None:
    monkeypatch.setattr(run, "CACHE", tmp_path / "cache")
    link = tmp_path / "cfg" / "shapes"
    link.parent.mkdir()
    link.symlink_to(history)
    config = load_config(write(tmp_path / "cfg" / "run.toml",
                               'family = "commits"\ntrain_repos = ["./shapes"]\nmax_train = 2'))
    loaded = run.split_tasks(config, "train")
    assert len(loaded) == 2 and {t.repo for t in loaded} == {"shapes"}
    assert all((Path(t.snapshot) / t.files[0]).is_file() for t in loaded)
    assert all(Path(t.snapshot).parent == tmp_path / "cache" / "commits" / "shapes"
               for t in loaded)
    assert run.split_tasks(config, "heldout") == []
    sampled = load_commit_tasks([str(history)], tmp_path / "cache", 100, None, 2,
                                config.rollout.seed)
    assert [t.id for t in sampled] == [t.id for t in loaded]  # the same seeded sample


@pytest.mark.parametrize("table, says", [
    ('train_repos = ["acme/shapes", "acme/units"]\nheldout_repos = ["acme/units"]',
     "share ['acme+units']"),
    ('train_repos = ["/m/acme+shapes/repo"]\nheldout_repos = ["https://github.com/acme/shapes"]',
     "share ['acme+shapes']"),
    ('train_repos = ["pallets/click"]', "benchmark repositories ['pallets/click']"),
    ('train_repos = ["acme/shapes"]\nheldout_repos = ["/work/.mirror/python-attrs+attrs/repo"]',
     "benchmark repositories"),
    ('train_repos = ["someone/werkzeug"]', "benchmark repositories"),  # a tab benchmark's
    ('train = ["toolz==1.0.0"]\ntrain_repos = ["acme/shapes"]', "commits family's"),
    ('family = "commits"\ntrain = ["toolz==1.0.0"]', "train_repos and heldout_repos only"),
])
def test_the_config_refuses_a_shared_or_benchmark_repository(tmp_path, table, says) -> None:
    family = "" if "family" in table or "train =" in table else 'family = "commits"\n'
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(write(tmp_path / "run.toml", family + table))


def test_the_cli_refuses_it_with_exit_2(tmp_path) -> None:
    config = write(tmp_path / "run.toml", 'family = "commits"\ntrain_repos = ["psf/requests"]')
    done = subprocess.run([sys.executable, "-m", "codeplane", "rl", "train", str(config)],
                          capture_output=True, text=True, check=False, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 2
    assert "benchmark repositories" in done.stderr


def test_repository_names() -> None:
    assert repo_name("pytoolz/toolz") == "pytoolz+toolz"
    assert repo_name("https://github.com/pytoolz/toolz.git") == "pytoolz+toolz"
    assert repo_name("/work/.mirror/pytoolz+toolz/repo") == "pytoolz+toolz"
    assert repo_name("/srv/git/toolz.git") == "toolz"
    assert repo_name("./here/toolz") == "toolz"
    with pytest.raises(ValueError, match="share"):
        check_split(["pytoolz/toolz"], ["/work/.mirror/pytoolz+toolz/repo"])


def test_a_repository_is_a_git_history_or_an_https_url(tmp_path) -> None:
    with pytest.raises(CommitsError, match="only https"):
        git_dir("http://example.com/acme/shapes", tmp_path, None)
    with pytest.raises(CommitsError, match="not a git repository"):
        git_dir(str(tmp_path), tmp_path, None)


def test_every_benchmark_repository_is_refused() -> None:
    """The list in rl/commits.py covers what the benchmarks read today: bench/search's
    repositories, bench/apply's sets, bench/tab's and bench/agent's sdists, bench/nextedit's
    held-out repositories."""
    source = (ROOT / "bench/search/build.py").read_text()
    search = re.findall(r'"([\w.-]+/[\w.-]+)"', source.split("\nPINNED")[0])
    apply = {line.split("\t")[0] for f in (ROOT / "bench/apply/sets").glob("*.txt")
             for line in f.read_text().splitlines() if line and not line.startswith("#")}
    tab = re.findall(r'"([\w.-]+)==', (ROOT / "bench/tab.py").read_text())
    agent = re.findall(r'Sdist\("([\w.-]+)==', (ROOT / "bench/agent/snapshots.py").read_text())
    nextedit = [r for held in ("HELDOUT", "HELDOUT2", "HELDOUT3")
                for r in re.findall(r'"([\w.-]+/[\w.-]+)"', (ROOT / "bench/nextedit.py").read_text()
                                    .split(f"\n{held} = ")[1].split("\n")[0])]
    assert len(search) == 8 and apply and tab and agent and len(nextedit) == 9
    assert {r.lower() for r in [*search, *apply, *nextedit]} <= BENCHMARK_REPOSITORIES
    assert {p.lower() for p in [*tab, *agent]} <= BENCHMARK_PROJECTS


def test_the_example_config_is_disjoint_from_the_benchmarks() -> None:
    config = load_config(ROOT / "examples/rl/commits.toml")
    assert config.tasks.family == "commits"
    assert len(config.tasks.train_repos) >= 3 and len(config.tasks.heldout_repos) >= 2
    assert tomllib.loads((ROOT / "examples/rl/commits.toml").read_text())["tasks"]


@pytest.mark.model
def test_the_search_solver_searches_reads_in_parallel_and_names_the_file(
        tasks, history, tmp_path) -> None:
    """The warm start's solver for this family (rl/warmstart.py), through a real episode on
    the product's index: one codebase_search for the request (files ranked), the source
    files among its hits read in ONE turn, then the file whose lines hold the request's
    words named; its three turns are what is imitated."""
    pytest.importorskip("torch")
    from conftest import make_settings
    from test_trainer import CONFIG

    from codeplane.rl.index import RunIndex, SearchConfig
    from codeplane.rl.rollout import RolloutConfig, play
    from codeplane.rl.trainer import PolicyTrainer, rows_of
    from codeplane.rl.warmstart import SearchSolver, demonstrations, solver_for

    assert solver_for("commits", "search") is SearchSolver
    area = by_request(tasks, REQUEST_AREA)
    export(area, history / ".git")
    make_settings(tmp_path / "index")
    index = RunIndex(SearchConfig(home=str(tmp_path / "index"))).open()
    policy = PolicyTrainer(CONFIG, make_settings(tmp_path / "home")).policy
    server, turns = EnvServer(scratch=str(tmp_path)), []
    try:
        index.index([area.snapshot])
        episode = play(SearchSolver(policy), server, area, "g",
                       RolloutConfig(max_turns=4, answer_turn=True, temperature=0.0,
                                     toolset="core"),
                       on_event=lambda e: e["type"] == "model_turn" and turns.append(
                           e["message"]), services=index.services(area))
    finally:
        server.close()
        index.close()
    assert episode.reward == 1.0, turns
    calls = [[(c["function"]["name"], json.loads(c["function"]["arguments"]))
              for c in t.get("tool_calls") or []] for t in turns]
    assert calls[0] == [("codebase_search", {"query": REQUEST_AREA, "files": True,
                                                    "limit": 5})]
    assert {name for name, _ in calls[1]} == {"read_file"} and len(calls[1]) >= 2
    assert "pkg/shapes.py" in {args["path"] for _, args in calls[1]} and calls[2] == []
    assert turns[2]["content"] == "The change touches pkg/shapes.py."
    [demos] = demonstrations([episode])
    assert [policy.decode(s.completion_ids).count("<tool_call>") for s in demos] == [
        1, len(calls[1]), 0]
    # each turn's prompt re-renders the turns before it token for token: the trainer scores
    # the whole episode in one forward pass (rl/trainer.py rows_of)
    assert [len(r.spans) for r in rows_of(demos)] == [3]
