"""The failing-test task family over a small real package: deterministic mutations chosen so
the function's own doctest fails, a verifier that restores the test file and runs it in the
episode's sandbox, and episodes driven by the scripted model over the product's tools: a
correct fix earns 1; doing nothing, deleting the test or rewriting it earns 0."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from codeplane.core.chat import HttpChatModel
from codeplane.rl.config import RunConfig
from codeplane.rl.envserver import EnvConfig, EnvServer
from codeplane.rl.rollout import RolloutConfig, play
from codeplane.rl.testfix import FixTask, fix_tasks, mutations

OPS = '''"""Small arithmetic helpers."""


def clamp(x, lo, hi):
    """Limit x to the range lo..hi.

    >>> clamp(5, 0, 3)
    3
    >>> clamp(-1, 0, 3)
    0
    >>> clamp(2, 0, 3)
    2
    """
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def total(xs):
    """The sum of xs.

    >>> total([1, 2, 3])
    6
    """
    s = 0
    for x in xs:
        s = s + x
    return s


def shout(s):
    """Upper case with an exclamation mark (its doctest is wrong: never a task).

    >>> shout("hi")
    'HI?'
    """
    return s.upper() + "!"


def undocumented(a, b):
    return a < b
'''


def make_calc(root: Path) -> Path:
    (root / "calc").mkdir(parents=True)
    (root / "calc" / "__init__.py").write_text("")
    (root / "calc" / "ops.py").write_text(OPS)
    (root / "setup.py").write_text("raise SystemExit('never imported')\n")
    return root


@pytest.fixture(scope="module")
def calc_tasks(tmp_path_factory) -> list[FixTask]:
    root = make_calc(tmp_path_factory.mktemp("calc") / "calc-1.0")
    return fix_tasks("calc==1.0", root, tmp_path_factory.mktemp("cache"))


def test_each_doctested_function_gets_the_first_mutation_that_breaks_its_test(
        calc_tasks) -> None:
    by_fn = {t.function: t for t in calc_tasks}
    assert set(by_fn) == {"clamp", "total"}  # shout's doctest fails unbroken; no doctest
    clamp, total = by_fn["clamp"], by_fn["total"]
    assert clamp.mutation == "line 14: < -> >=" and total.mutation == "line 27: 0 -> 1"
    assert clamp.test_path == "doctest_tests/test_calc_ops.py"
    assert clamp.tests == 2 and clamp.test_name == "test_clamp"
    assert "test_clamp" in clamp.instruction and "python doctest_tests/" in clamp.instruction
    broken = (Path(clamp.snapshot) / "calc" / "ops.py").read_text()
    assert broken == OPS.replace("if x < lo:", "if x >= lo:")
    test_file = (Path(clamp.snapshot) / clamp.test_path).read_text()
    assert test_file == clamp.test_source and "test_shout" not in test_file


def test_mutations_are_single_tokens_in_source_order() -> None:
    source = b"def f(a, b):\n    return a <= b and a + 1 != 0\n"
    node = ast.parse(source).body[0]
    found = [(m.old, m.new) for m in mutations(node, source)]
    assert found == [("<=", ">"), ("and", "or"), ("+", "-"), ("1", "0"), ("!=", "=="),
                     ("0", "1")]
    flipped = next(mutations(node, source)).apply(source)
    assert flipped == b"def f(a, b):\n    return a > b and a + 1 != 0\n"


def episode(provider, task: FixTask, tmp_path: Path, script: list[dict]) -> float:
    provider.reset().script = [*script, {"content": "done"}]
    model = HttpChatModel(provider.url, "scripted")
    env = EnvServer(EnvConfig(), scratch=str(tmp_path))
    try:
        ep = play(model, env, task, "g0", RolloutConfig(max_turns=len(script) + 1))
    finally:
        env.close()
        model.close()
    assert ep.fault is None and not ep.info.get("truncated")
    return ep.reward


def test_a_correct_fix_earns_one(provider, calc_tasks, tmp_path) -> None:
    clamp = next(t for t in calc_tasks if t.function == "clamp")
    fix = {"path": "calc/ops.py", "old_string": "if x >= lo:", "new_string": "if x < lo:"}
    run_tests = {"command": f"python {clamp.test_path}"}
    script = [{"calls": [("read_file", {"path": "calc/ops.py"})]},
              {"calls": [("edit_file", fix)]},
              {"calls": [("run_terminal_cmd", run_tests)]}]
    assert episode(provider, clamp, tmp_path, script) == 1.0
    ran = provider.requests[3]["messages"][-1]["content"]
    assert "Ran 2 tests" in ran and "OK" in ran  # the policy's own run saw the fix pass


@pytest.mark.parametrize("cheat", ["nothing", "delete_test", "rewrite_test", "rewrite_doc"])
def test_no_fix_earns_zero_whatever_happens_to_the_test(provider, calc_tasks, tmp_path,
                                                        cheat) -> None:
    clamp = next(t for t in calc_tasks if t.function == "clamp")
    calls = {
        "nothing": [],
        "delete_test": [{"calls": [("delete_file", {"path": clamp.test_path})]}],
        "rewrite_test": [{"calls": [("create_file", {
            "path": clamp.test_path,
            "content": "import unittest\nclass T(unittest.TestCase):\n"
                       "    def test_clamp(self): pass\n    def test_total(self): pass\n"
                       "unittest.main()\n"})]}],
        # the doctest is the test's text, not the docstring's: editing the docstring to
        # match the broken code changes nothing
        "rewrite_doc": [{"calls": [("read_file", {"path": "calc/ops.py"})]},
                        {"calls": [("edit_file", {"path": "calc/ops.py",
                                                  "old_string": ">>> clamp(5, 0, 3)\n    3",
                                                  "new_string": ">>> clamp(5, 0, 3)\n    5"})]}],
    }[cheat]
    assert episode(provider, clamp, tmp_path, calls) == 0.0


def test_the_verifier_runs_the_code_in_the_sandbox_never_on_the_host(provider, calc_tasks,
                                                                     tmp_path) -> None:
    """A 'fix' that also writes to a host path when imported: the verifier imports it, and
    the host path stays untouched (the sandbox shows only the workspace)."""
    clamp = next(t for t in calc_tasks if t.function == "clamp")
    marker = tmp_path / "ran-on-host"
    planted = (f"try:\n    open({str(marker)!r}, 'w').write('x')\nexcept OSError:\n"
               "    pass\n\n\ndef clamp(")
    calls = [{"calls": [("read_file", {"path": "calc/ops.py"})]},
             {"calls": [("edit_file", {"path": "calc/ops.py", "old_string": "if x >= lo:",
                                       "new_string": "if x < lo:"})]},
             {"calls": [("edit_file", {"path": "calc/ops.py", "old_string": "\n\ndef clamp(",
                                       "new_string": "\n\n" + planted})]}]
    assert episode(provider, clamp, tmp_path, calls) == 1.0  # the planted code did run
    assert not marker.exists()


def test_family_is_a_config_key(tmp_path) -> None:
    base = {"tasks": {"train_dirs": ["a"], "family": "testfix"}}
    assert RunConfig.model_validate(base).tasks.family == "testfix"
    assert RunConfig.model_validate({"tasks": {"train_dirs": ["a"]}}).tasks.family == "locate"
    with pytest.raises(ValueError, match="family"):
        RunConfig.model_validate({"tasks": {"train_dirs": ["a"], "family": "quiz"}})
