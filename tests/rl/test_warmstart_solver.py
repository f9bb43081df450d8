"""The search solver's choice rule (rl/warmstart.py SearchSolver) on a tiny repository
written here: which searches it makes, which candidates it reads in one turn, and which file
it names from what the product's tools showed it. The read lines come from the product's
read_file in a sandbox on that repository; the file rankings are written in codebase_search's
output format, so the ranking is fixed (the real index is exercised end to end in
tests/rl/test_commits.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from codeplane.agent.env import local_environment
from codeplane.agent.tools import default_toolset
from codeplane.rl.commits import INSTRUCTION
from codeplane.rl.warmstart import SearchSolver, candidates, choose, queries

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


def test_it_searches_the_request_and_its_words_in_one_turn() -> None:
    first = calls(SearchSolver._reply(messages()))
    assert first == [("codebase_search", {"query": REQUEST, "files": True, "limit": 5}),
                     ("codebase_search", {"query": "Wait longer between upload retries "
                                          "server answers busy", "files": True, "limit": 5})]
    assert queries("fix it") == ["fix it"]  # nothing but filler: one search


def test_it_reads_the_source_candidates_in_one_turn_and_names_the_one_that_says_the_request(
        repo: Path) -> None:
    """The decoy is the search's top file and the right file is third of four: tests and
    documentation are dropped, both source files read in one turn (from their hits' first
    line), and the file whose read lines hold the request's words is named."""
    searches = [("codebase_search", ranking("docs/retries.md", "pkg/client.py",
                                            "tests/test_retry.py", "pkg/retry.py")),
                ("codebase_search", ranking("pkg/client.py", "pkg/retry.py", "pkg/util.py"))]
    assert [p for p, _ in candidates([t for _, t in searches])] == [
        "pkg/client.py", "pkg/retry.py", "pkg/util.py"]
    reads = calls(SearchSolver._reply(messages(("search", searches))))
    assert reads == [("read_file", {"path": p, "start_line": 1, "end_line": 30})
                     for p in ("pkg/client.py", "pkg/retry.py", "pkg/util.py")]
    env, tools = local_environment(repo), default_toolset()
    try:
        shown = [("read_file", tools.execute(env, name, args).output) for name, args in reads]
    finally:
        env.close()
    assert shown[1][1].startswith("pkg/retry.py (lines 1-")
    answer = SearchSolver._reply(messages(("search", searches), ("read", shown)))
    assert answer == "The change touches pkg/retry.py."


def test_a_close_second_is_named_too_and_a_weak_one_is_not() -> None:
    """Naming two files costs a third of the reward when one is right (F1 2/3), so the
    second is named only when its evidence is close to the first's."""
    both = ["pkg/a.py (lines 1-3 of 3):\nupload retries busy server",
            "pkg/b.py (lines 1-3 of 3):\nupload retries busy server"]
    assert choose(REQUEST, ["pkg/a.py", "pkg/b.py"], both) == ["pkg/a.py", "pkg/b.py"]
    weak = [both[0], "pkg/b.py (lines 1-3 of 3):\nnothing related"]
    assert choose(REQUEST, ["pkg/a.py", "pkg/b.py"], weak) == ["pkg/a.py"]
    assert SearchSolver._reply(messages(("search", [("codebase_search", ranking(
        "docs/retries.md", "tests/test_retry.py"))]))) == "No file matches this change."
