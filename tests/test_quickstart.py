"""The README's main job: `codeplane quickstart` end to end, as a user runs it: a real server,
the real models, the agent in a real sandbox."""

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import make_settings

from codeplane.quickstart import SAMPLE, SEARCH_QUERY, write_sample


def quickstart(home, **env: str) -> subprocess.CompletedProcess:
    """Run it as a user does; past the time box (under the suite's per-test limit) it is
    stopped with SIGTERM, which it turns into a clean exit that stops its server too."""
    proc = subprocess.Popen([sys.executable, "-m", "codeplane", "quickstart"],
                            env={**os.environ, "CODEPLANE_HOME": str(home), "COLUMNS": "200",
                                 "PYTHONPATH": os.pathsep.join(sys.path), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_quickstart_shows_every_step_on_its_sample_project(tmp_path):
    home = make_settings(tmp_path / "home").home
    proc = quickstart(home)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr
    assert "server up at http://127.0.0.1:" in out
    assert re.search(r"✓ index the project privately \(\d+\.\d s\)", out)
    # search by meaning: the discount function, found with none of its words
    assert re.search(r"shop/pricing\.py:4-6 \(score", out.split("search it by meaning")[1])
    # the agent: the failing test before, the fix as a diff, the tests passing in the sandbox
    assert "FAILED (failures=1)" in out and "→ edit_file" in out
    assert "-    return round(price + price * percent / 100, 2)" in out
    assert "+    return round(price - price * percent / 100, 2)" in out
    assert re.search(r"tests in the sandbox after the agent \(\w+, \d+ model turns\): OK", out)
    fixed = (home / "quickstart" / "shop" / "shop" / "pricing.py").read_text()
    assert "price - price * percent" in fixed
    # apply: the sketch merged into the file, shown as a diff
    assert "+    def running_low(self, below: int = 3) -> list[str]:" in out
    assert "def running_low" in (home / "quickstart" / "shop" / "shop" / "inventory.py").read_text()
    # Tab: the suggestion completes the line at the cursor
    assert re.search(r"total = with_tax\(", out.split("a Tab suggestion")[1])
    assert ".pytest_cache" not in out  # the agent's diff shows sources only
    for step in ("index the project privately", "search it by meaning",
                 "the agent fixes the failing test in a sandbox", "apply merges a sketched edit",
                 "a Tab suggestion"):
        assert re.search(rf"✓ {step} \(\d+\.\d s\)", out), step
    assert "codeplane serve" in out.split("next")[-1] and "codeplane lsp" in out
    assert "Traceback" not in proc.stderr


def without_bwrap(bin_dir: Path) -> str:
    """A PATH with every program of this one but bubblewrap: a machine that lacks it."""
    bin_dir.mkdir()
    for folder in os.environ["PATH"].split(os.pathsep):
        for program in Path(folder).glob("*") if Path(folder).is_dir() else ():
            if program.name != "bwrap" and not (bin_dir / program.name).exists():
                (bin_dir / program.name).symlink_to(program)
    return str(bin_dir)


def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path):
    """A machine without bubblewrap: the agent step says why it cannot run, the others still
    run, exit 1, no traceback."""
    home = make_settings(tmp_path / "home").home
    proc = quickstart(home, PATH=without_bwrap(tmp_path / "bin"))
    out = proc.stdout
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + out, proc.stderr
    assert "✗ the agent fixes the failing test in a sandbox failed" in out
    assert "bubblewrap (bwrap) is not installed" in out
    assert "1 step(s) failed: the agent fixes the failing test in a sandbox" in proc.stderr
    for step in ("search it by meaning", "apply merges a sketched edit", "a Tab suggestion"):
        assert re.search(rf"✓ {step} \(\d+\.\d s\)", out), step


def test_the_sample_is_generated_and_the_query_shares_no_word_with_it(tmp_path):
    root = write_sample(tmp_path / "shop")
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == \
        sorted(SAMPLE)
    words = set(re.findall(r"[a-z]+", " ".join(SAMPLE.values()).lower()))
    assert not set(SEARCH_QUERY.lower().split()) & words
