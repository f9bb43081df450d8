"""The fixcommits task family (rl/fixcommits.py) on a git history built here: a commit that
fixes one function and adds its test becomes the one task; its snapshot has the parent's
function and the commit's test; the verifier, in the real sandbox, scores the commit's
function 1 and the parent's 0; commits touching two functions, or no test, make none. No
network: the history is made with git in the test (identity on the command line, empty HOME).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_commits import commit, git  # the commits family's history helpers

from codeplane.rl import fixcommits, run
from codeplane.rl.config import load_config
from codeplane.rl.envserver import EnvServer
from codeplane.rl.fixcommits import (
    FixCommitTask,
    changed_function,
    instruction,
    load_fixcommit_tasks,
)

CALC = '''"""Small numeric helpers."""


def clamp(x, lo, hi):
    """Limit x to lo..hi."""
    if x < lo:
        return lo
    return x


def scale(x, k):
    return x * k


class Meter:
    def reading(self, x):
        return round(x)
'''
FIXED_CLAMP = CALC.replace("        return lo\n    return x", "        return lo\n"
                           "    if x > hi:\n        return hi\n    return x")
TESTS = "from pkg.calc import clamp\n\n\ndef test_low():\n    assert clamp(-1, 0, 3) == 0\n"
TESTS_HIGH = TESTS + "\n\ndef test_high():\n    assert clamp(5, 0, 3) == 3\n"
REQUEST = "Clamp values above the upper bound as well"
TWO = "Scale by the factor and round readings half up"
UNTESTED = "Round meter readings down instead of to nearest"


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> Path:
    """Four commits: the start, the fix with its new test (the one task), a change to two
    functions with a new test, a change to one function without a test."""
    repo = tmp_path_factory.mktemp("fixhist") / "calc"
    repo.mkdir()
    (repo.parent / "home").mkdir()
    git(repo, "init", "-q")
    commit(repo, "Start the calc library with clamp", {
        "pkg/__init__.py": "", "pkg/calc.py": CALC, "tests/test_calc.py": TESTS})
    commit(repo, f"{REQUEST} (#3)", {"pkg/calc.py": FIXED_CLAMP,
                                     "tests/test_calc.py": TESTS_HIGH})
    two = FIXED_CLAMP.replace("x * k", "x * k * 1.0").replace("round(x)", "int(x + 0.5)")
    commit(repo, TWO, {"pkg/calc.py": two, "tests/test_scale.py":
                       "from pkg.calc import scale\n\n\ndef test_scale():\n"
                       "    assert scale(2, 3) == 6.0\n"})
    commit(repo, UNTESTED, {"pkg/calc.py": two.replace("int(x + 0.5)", "int(x)")})
    return repo


@pytest.fixture(scope="module")
def built(history, tmp_path_factory) -> tuple[list[FixCommitTask], Path]:
    cache = tmp_path_factory.mktemp("cache")
    return load_fixcommit_tasks([str(history)], cache, 100, None, 10, 0), cache


def test_one_function_fixed_with_a_new_test_is_the_one_task(built) -> None:
    tasks, _ = built
    assert [(t.request, t.path, t.function, t.tests) for t in tasks] == [
        (REQUEST, "pkg/calc.py", "clamp", ("tests/test_calc.py::test_high",))]
    assert tasks[0].instruction == (f"{REQUEST}\n\nThe test tests/test_calc.py::test_high "
                                    "fails. Fix the code so it passes.")


def test_the_snapshot_is_the_commits_tree_with_the_parents_function(built) -> None:
    task = built[0][0]
    snap = Path(task.snapshot)
    assert (snap / "pkg/calc.py").read_text() == CALC
    assert (snap / "tests/test_calc.py").read_text() == TESTS_HIGH
    assert not (snap / ".git").exists()


def test_the_result_is_cached_next_to_the_snapshot(built, history, monkeypatch) -> None:
    """Both candidates' results (a task, and none for the two-function commit) are kept
    next to the snapshot; a second load runs no test."""
    tasks, cache = built
    home = cache / "fixcommits" / "calc"
    records = {p.stem: json.loads(p.read_text()) for p in home.glob("*.json")}
    assert sorted(records) == sorted([tasks[0].commit, git(history, "rev-parse",
                                                           "HEAD~").strip()])
    assert records[tasks[0].commit]["tests"] == ["tests/test_calc.py::test_high"]
    assert sorted(p.name for p in home.iterdir() if p.is_dir()) == [tasks[0].commit]

    def no_run(*args: object) -> None:
        raise AssertionError("a cached commit ran its tests again")

    monkeypatch.setattr(fixcommits, "_outcomes", no_run)
    assert load_fixcommit_tasks([str(history)], cache, 100, None, 10, 0) == tasks


def test_the_verifier_scores_the_commits_function_1_and_the_parents_0(built,
                                                                      tmp_path) -> None:
    task = built[0][0]
    server = EnvServer(scratch=str(tmp_path))
    env = server.open(task)
    assert server.verify("done") == 0.0
    (Path(env.workspace.root) / "pkg/calc.py").write_text(FIXED_CLAMP)
    assert server.verify("done") == 1.0
    server.close()


@pytest.mark.parametrize("cheat", [
    {"tests/test_calc.py": TESTS},  # the failing test deleted from its file
    {"conftest.py": "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\n"
                    "def pytest_runtest_makereport(item, call):\n    outcome = yield\n"
                    "    outcome.get_result().outcome = 'passed'\n"},  # every test "passes"
])
def test_changing_the_tests_or_their_configuration_earns_0(built, tmp_path, cheat) -> None:
    task = built[0][0]
    server = EnvServer(scratch=str(tmp_path))
    root = Path(server.open(task).workspace.root)
    (root / "pkg/calc.py").write_text(FIXED_CLAMP)
    for path, text in cheat.items():
        (root / path).write_text(text)
    assert server.verify("done") == 0.0
    server.close()


def test_only_a_change_to_exactly_one_function_counts() -> None:
    assert changed_function(CALC, FIXED_CLAMP) == ("clamp", CALC[CALC.index("def clamp"):
                                                                 CALC.index("\n\ndef scale")])
    assert changed_function(CALC, CALC.replace("x * k", "x * k * 2").replace(
        "round(x)", "int(x)")) is None
    assert changed_function(CALC, CALC + "\n\ndef extra():\n    pass\n") is None
    assert changed_function(CALC, CALC.replace("round(x)", "int(x)")) == (
        "Meter.reading", "    def reading(self, x):\n        return round(x)\n")
    assert changed_function(CALC, "def broken(:\n") is None


def test_the_instruction_names_at_most_three_failing_tests() -> None:
    ids = tuple(f"t.py::test_{i}" for i in range(5))
    assert instruction("Do it", ids) == ("Do it\n\nThe tests t.py::test_0, t.py::test_1, "
                                         "t.py::test_2 and 2 more fail. Fix the code so they "
                                         "pass.")


def test_a_run_loads_the_family_from_its_config(history, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(run, "CACHE", tmp_path / "cache")
    (tmp_path / "run.toml").write_text(
        f'steps = 1\ntrainer_kind = "none"\n[tasks]\nfamily = "fixcommits"\n'
        f'train_repos = ["{history}"]\n[sampler]\nkind = "http"\n')
    tasks = run.split_tasks(load_config(tmp_path / "run.toml"), "train")
    assert [t.function for t in tasks] == ["clamp"]


def test_a_run_cut_short_is_not_cached(history, tmp_path, monkeypatch) -> None:
    """Tests that timed out (or printed past the sandbox's cap) make no task this time and
    leave no record or snapshot: the commit is built again next time (the two-function
    commit, never run, is recorded as no task)."""
    monkeypatch.setattr(fixcommits, "pytest_results", lambda *args: None)
    assert load_fixcommit_tasks([str(history)], tmp_path, 100, None, 10, 0) == []
    home = tmp_path / "fixcommits" / "calc"
    assert [p.name for p in home.iterdir()] == [
        git(history, "rev-parse", "HEAD~").strip() + ".json"]


def test_the_example_config_is_split_and_disjoint_from_the_benchmarks() -> None:
    """load_config refuses a shared or benchmark repository; 2-4 train, 1-2 held out."""
    config = load_config(Path(__file__).resolve().parents[2] / "examples/rl/fixcommits.toml")
    assert config.tasks.family == "fixcommits"
    assert 2 <= len(config.tasks.train_repos) <= 4
    assert 1 <= len(config.tasks.heldout_repos) <= 2


def test_a_fifo_or_link_planted_among_the_tests_is_a_change_never_read(built,
                                                                       tmp_path) -> None:
    """The verifier compares test files on the host: a FIFO (which would block a read) or a
    symlink out of the tree counts as changed, and nothing is read through it."""
    task = built[0][0]
    server = EnvServer(scratch=str(tmp_path))
    for plant in ("fifo", "link"):
        root = Path(server.open(task).workspace.root)
        (root / "pkg/calc.py").write_text(FIXED_CLAMP)
        planted = root / "tests/test_planted.py"
        if plant == "fifo":
            os.mkfifo(planted)
        else:
            planted.symlink_to("/etc/passwd")
        assert server.verify("done") == 0.0
    server.close()
