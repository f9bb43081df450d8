"""Localisation-shaped training pairs for the embedder (issue 19): a commit message -> the code it
changed, from the git histories of projects disjoint from the search benchmark.

    # mirrors first: `fetch github:owner/name` for each line of commit_projects.txt; then
    python bench/search/commit_pairs.py     # -> /tmp/codeplane-finetune/commit_{pairs,validation}.jsonl
    python bench/search/finetune.py train --side both --extra commit ...   # mixes them in

The docstring pairs (finetune.py) teach "what a function does -> the function"; the benchmark's
localisation requests are commit messages, which name a symptom or an option as often as
behaviour. A pair here is what the product sees for such a request: the query is the commit
message's first paragraph under the benchmark's own rule (build.localisation: 1-4 modified
non-test source files, >= 4 words, not a chore); the document is the `Chunk.embed_text` of the
chunk, in the commit's parent, that holds most of the lines the commit changed. One pair per
commit, so no batch holds one query twice with two answers.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from build import change_request, modified_commits, order
from corpus import git
from finetune import listed, unique_pairs, write_split

from codeplane.indexing.chunker import chunk_text

PROJECTS = HERE / "commit_projects.txt"
COMMITS = 3000  # the newest non-merge commits read per project
PER_PROJECT = 300
VALIDATION = 300
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", re.MULTILINE)


def changed_lines(repo: str, parent: str, sha: str, path: str) -> list[int]:
    """Lines of `path` in the parent that the commit removed or rewrote; a pure insertion
    counts the line it follows."""
    diff = git(repo, "diff", "-U0", "--no-color", parent, sha, "--", path)
    lines = []
    for start, count in HUNK.findall(diff):
        first, n = int(start), 1 if count == "" else int(count)
        lines += range(first, first + n) if n else [max(first, 1)]
    return lines


def changed_chunk(repo: str, parent: str, sha: str, files: list[str]) -> str | None:
    """embed_text of the parent's chunk holding most changed lines (ties: the first file)."""
    best, best_count = None, 0
    for path in files:
        lines = changed_lines(repo, parent, sha, path)
        for chunk in chunk_text(path, git(repo, "show", f"{parent}:{path}")):
            count = sum(chunk.start_line <= n <= chunk.end_line for n in lines)
            if count > best_count:
                best, best_count = chunk.embed_text(path), count
    return best


def project_pairs(repo: str) -> list[dict]:
    rows = []
    for sha, parent, files in sorted(modified_commits(repo, COMMITS), key=lambda c: order(c[0])):
        query = change_request(repo, sha)
        text = query and changed_chunk(repo, parent, sha, files)
        if text:
            rows.append({"query": query, "text": text, "project": repo, "commit": sha})
        if len(rows) == PER_PROJECT:
            break
    return rows


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                            epilog=f"projects: {PROJECTS}").parse_args()
    repos = listed(PROJECTS)
    rows: list[dict] = []
    for repo in repos:
        found = project_pairs(repo)
        print(f"{repo}: {len(found)} pairs", file=sys.stderr, flush=True)
        rows += found
    write_split(unique_pairs(sorted(rows, key=lambda r: order(r["commit"]))), "commit_",
                VALIDATION)


if __name__ == "__main__":
    main()
