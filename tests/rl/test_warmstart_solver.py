"""The search solver's choice rule (rl/warmstart.py SearchSolver) on a tiny repository
written here: the search it makes, which candidates it reads in one turn, and which file
it names from what the product's tools showed it. The read lines come from the product's
read_file in a sandbox on that repository; the file ranking is written in codebase_search's
output format, so the ranking is fixed (the real index is exercised end to end in
tests/rl/test_commits.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from codeplane.agent.env import local_environment
from codeplane.agent.tools import default_toolset
from codeplane.rl.commits import INSTRUCTION
from codeplane.rl.warmstart import SearchSolver, candidates, choose

REQUEST = "Wait longer between upload retries when the server answers busy"
FILES = {
    # the search's decoy: about uploads, nothing about retrying or waiting
    "pkg/client.py": '"""The HTTP client."""\n\n\ndef upload(session, url, body):\n'
                     '    """Send the body to the server."""\n'
                     '    return session.post(url, data=body)\n',
    # where the change goes: the retry loop and its delay
    "pkg/retry.py": '"""Retrying failed requests."""\n\n\ndef backoff(attempt):\n'
                    '    """Seconds to wait before retry number `attempt`."""\n'
                    '    return 0.1 * attempt\n\n\ndef retry_upload(upload, busy):\n'
                    '    """Retry the upload while the server answers busy."""\n'
                    '    for attempt in range(5):\n        if not busy(upload()):\n'
                    '            return\n        wait(backoff(attempt))\n',
    "pkg/util.py": '"""Small helpers."""\n\n\ndef chunks(data, size):\n'
                   '    return [data[i:i + size] for i in range(0, len(data), size)]\n',
    "tests/test_retry.py": "def test_backoff():\n    assert True\n",
    "docs/retries.md": "# Retries\n\nUploads are retried when the server is busy.\n",
}


def ranking(*paths: str) -> str:
    """A files=True codebase_search output (rank order as given), as the tool prints it."""
    return "\n\n".join(f"{p}:1-6 (score {0.9 - 0.1 * n:.2f})\n{FILES[p][:80]}"
                       for n, p in enumerate(paths))


def messages(*turns: tuple[str, list[tuple[str, str]]]) -> list[dict]:
    """A transcript: the task, then per turn the calls' tool names and outputs."""
    out = [{"role": "system", "content": "..."},
           {"role": "user", "content": INSTRUCTION.format(request=REQUEST)}]
    for reply, results in turns:
        out.append({"role": "assistant", "content": reply})
        out += [{"role": "tool", "name": name, "content": text} for name, text in results]
    return out


def calls(reply: str) -> list[tuple[str, dict]]:
    blocks = reply.split("<tool_call>")[1:]
    return [(c["name"], c["arguments"]) for c in
            (json.loads(b.split("</tool_call>")[0]) for b in blocks)]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for path, text in FILES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    return tmp_path


def test_it_searches_the_request_ranking_files() -> None:
    assert calls(SearchSolver._reply(messages())) == [
        ("codebase_search", {"query": REQUEST, "files": True, "limit": 5})]


def test_it_reads_the_source_candidates_in_one_turn_and_names_the_one_that_says_the_request(
        repo: Path) -> None:
    """The decoy is the search's top file and the right file comes after documentation and
    a test: those are dropped, the three source files read in one turn (from their hits'
    first line), and the file whose read lines hold the request's words is named."""
    search = ranking("pkg/client.py", "docs/retries.md", "tests/test_retry.py", "pkg/util.py",
                     "pkg/retry.py")
    assert [p for p, _ in candidates(search)] == ["pkg/client.py", "pkg/util.py",
                                                  "pkg/retry.py"]
    reads = calls(SearchSolver._reply(messages(("search", [("codebase_search", search)]))))
    assert reads == [("read_file", {"path": p, "start_line": 1, "end_line": 30})
                     for p in ("pkg/client.py", "pkg/util.py", "pkg/retry.py")]
    env, tools = local_environment(repo), default_toolset()
    try:
        shown = [("read_file", tools.execute(env, name, args).output) for name, args in reads]
    finally:
        env.close()
    assert shown[2][1].startswith("pkg/retry.py (lines 1-")
    answer = SearchSolver._reply(messages(("search", [("codebase_search", search)]),
                                          ("read", shown)))
    assert answer == "The change touches pkg/retry.py."


def test_the_rank_breaks_ties_and_a_word_every_candidate_holds_says_nothing() -> None:
    same = ["pkg/a.py (lines 1-3 of 3):\nupload retries busy server",
            "pkg/b.py (lines 1-3 of 3):\nupload retries busy server"]
    assert choose(REQUEST, ["pkg/a.py", "pkg/b.py"], same) == "pkg/a.py"
    assert choose(REQUEST, ["pkg/b.py", "pkg/a.py"], same) == "pkg/b.py"
    # "upload" is in both: only the second's "wait" and "busy" tell them apart
    told = ["pkg/a.py (lines 1-3 of 3):\nupload", "pkg/b.py (lines 1-3 of 3):\nupload wait busy"]
    assert choose(REQUEST, ["pkg/a.py", "pkg/b.py"], told) == "pkg/b.py"
    # a path is evidence too: "retries" names pkg/retry.py
    assert choose(REQUEST, ["pkg/a.py", "pkg/retry.py"], []) == "pkg/retry.py"


def test_no_source_file_among_the_hits_is_answered_not_guessed() -> None:
    assert SearchSolver._reply(messages(("search", [("codebase_search", ranking(
        "docs/retries.md", "tests/test_retry.py"))]))) == "No file matches this change."


@pytest.mark.parametrize(("demos", "steps", "size"), [(17, 9, 2), (17, 6, 3), (5, 4, 2),
                                                      (3, 2, 8)])
def test_the_warm_start_imitates_every_demonstration_before_any_twice(demos, steps, size):
    """steps x batch >= the demonstrations: each is imitated, and none twice while another
    waits (a batch drawn at random each step left some out)."""
    from codeplane.rl.warmstart import batches

    episodes = [[object()] for _ in range(demos)]  # an episode: its list of samples
    planned = batches(episodes, steps, size, seed=0)
    assert len(planned) == steps and all(len(b) == min(size, demos) for b in planned)
    taken = [id(e) for batch in planned for e in batch]
    first_epoch = taken[:demos]
    assert sorted(first_epoch) == sorted(id(e) for e in episodes)
    assert planned == batches(episodes, steps, size, seed=0)  # a function of the seed
