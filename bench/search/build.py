"""Build the three search benchmarks from the history of public Python repositories.

    # mirrors first: `fetch github:pallets/click` etc. (see PINNED); then
    python bench/search/build.py            # writes the sets under CACHE/sets-<version>/

evaluate.py and latency.py call `load`, which builds the sets on first use: they hold text of
third-party repositories (docstrings, commit messages), so they are never committed.

1. localisation: a commit's message (first paragraph) is the query; the non-test source files it
   modified are the answer, searched in the tree of the commit's parent.
2. docstring: the first sentence of a function's docstring is the query; the answer is the chunk
   holding the function, in a HEAD tree whose docstrings are blanked (as in bench/index.py).
3. identifier: a function or class name (snake_case/CamelCase, defined once) is the query; the
   answer is the chunk holding its definition, in the HEAD tree.

Repositories are split by name into tuning (weights are fitted there) and held-out (reported).
Each is read at a pinned commit and sampling is sha-ordered, so every build yields the same
bytes (those of the sets once committed here, measured in docs/search.md).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import CACHE, Snapshots, git, mirror

from codeplane.rl import changes
from codeplane.rl.changes import SOURCE, is_test

TUNING = ["pallets/click", "pallets/flask", "pallets/jinja", "psf/requests"]
HELD_OUT = ["encode/httpx", "marshmallow-code/marshmallow", "python-attrs/attrs",
            "python-poetry/tomlkit"]
# the commit each set is built at (other repositories, `evaluate.py --repos`: their HEAD)
PINNED = {"pallets/click": "2c8cd3ac958a7eb316d67f2d316c27086c4c0369",
          "pallets/flask": "2ac89889f4cc330eabd50f295dcef02828522c69",
          "pallets/jinja": "5ef70112a1ff19c05324ff889dd30405b1002044",
          "psf/requests": "1f6589ec3a1ee910f9a65cc3ceac60b26677bc0e",
          "encode/httpx": "ae1b9f66238f75ced3ced5e4485408435de10768",
          "marshmallow-code/marshmallow": "341b927f219205704728c05cd61f04d7e9727523",
          "python-attrs/attrs": "c1dc5dcba16ed827aa6dcad896b41a3afedb4e32",
          "python-poetry/tomlkit": "d8ed1e3cdb024dfc2c6f12b45a0dfd4d4d91f727"}
HERE = Path(__file__).resolve().parent
SETS = ("localisation", "docstring", "identifier")
PER_REPO = {"localisation": 12, "docstring": 40, "identifier": 30}
def order(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def modified_commits(repo: str, newest: int) -> list[tuple[str, str, list[str]]]:
    """(commit, parent, modified non-test source files) of the `newest` non-merge commits
    (up to the pinned one) that modify 1-4 such existing files: the shared rule
    (codeplane.rl.changes), read from the repository's mirror."""
    return [(c.commit, c.parent, list(c.files))
            for c in changes.modified_commits(mirror(repo), newest, PINNED.get(repo, "HEAD"))]


def change_request(repo: str, sha: str) -> str | None:
    """The commit message's first paragraph when it is a request in words, not a chore."""
    return changes.change_request(changes.message(mirror(repo), sha))


def localisation(repo: str, count: int) -> list[dict]:
    """Requests among the last 400 commits, in a fixed (sha-hashed) order."""
    out = []
    for sha, parent, gold in sorted(modified_commits(repo, 400), key=lambda c: order(c[0])):
        query = change_request(repo, sha)
        if query:
            out.append({"repo": repo, "commit": sha, "parent": parent, "query": query,
                        "gold": gold})
        if len(out) == count:
            break
    return out


def defs(source: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]


def docstring_query(node: ast.AST) -> str | None:
    """The first sentence of a function's docstring when it makes a query: >= 6 words of a
    docstring of >= 8, on a function with a body beyond the docstring (also the training
    pairs' rule, finetune.py)."""
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
        return None
    doc = ast.get_docstring(node)
    if not doc:
        return None
    sentence = re.split(r"(?<=[.!?])\s", " ".join(doc.split()), maxsplit=1)[0]
    return sentence if len(doc.split()) >= 8 and len(sentence.split()) >= 6 else None


def docstring_and_identifier(repo: str, counts: dict[str, int]) -> tuple[list[dict], list[dict]]:
    snaps = Snapshots(repo)
    head = git(repo, "rev-parse", PINNED.get(repo, "HEAD")).strip()
    docs, names = [], {}
    for path in snaps.files(head):
        if not SOURCE.search(path) or is_test(path):
            continue
        for node in defs(snaps.text(head, path)):
            names.setdefault(node.name, []).append((path, node.lineno))
            sentence = docstring_query(node)
            if sentence:
                docs.append({"repo": repo, "commit": head, "query": sentence,
                             "gold": [[path, node.lineno]]})
    seen: dict[str, int] = {}
    for d in docs:
        seen[d["query"]] = seen.get(d["query"], 0) + 1
    docs = [d for d in docs if seen[d["query"]] == 1]
    docs = sorted(docs, key=lambda d: order(d["query"]))[:counts["docstring"]]
    idents = [{"repo": repo, "commit": head, "query": name, "gold": [list(where[0])]}
              for name, where in names.items()
              if len(where) == 1 and not name.startswith("__")
              and ("_" in name.strip("_") or re.search(r"[a-z][A-Z]", name))]
    idents = sorted(idents, key=lambda d: order(d["query"]))[:counts["identifier"]]
    return docs, idents


def folder() -> Path:
    """Where this version of the build rules keeps its sets (a change to them builds anew)."""
    rules = b"".join((HERE / name).read_bytes() for name in ("build.py", "corpus.py")) + \
        Path(changes.__file__).read_bytes()  # the change-request rule lives there
    return CACHE / f"sets-{hashlib.sha256(rules).hexdigest()[:12]}"


def load(name: str) -> list[dict]:
    """One set's rows, built first if this machine has not built it yet."""
    path = folder() / f"{name}.jsonl"
    if not path.exists():
        write_sets(folder())
    return [json.loads(line) for line in path.open()]


def write_sets(dest: Path) -> None:
    """Build every set from the mirrors at their pinned commits; SystemExit naming the
    `fetch` to run when a mirror is missing or lacks its commit."""
    absent = [r for r in TUNING + HELD_OUT if not mirror(r).is_dir() or subprocess.run(
        ["git", "--git-dir", str(mirror(r)), "cat-file", "-e", f"{PINNED[r]}^{{commit}}"],
        capture_output=True, check=False).returncode]
    if absent:
        raise SystemExit("the search sets are built from mirrors of " + ", ".join(absent) +
                         " (at the commits in bench/search/build.py PINNED), missing here: "
                         "run `fetch github:OWNER/NAME` for each first")
    sets: dict[str, list[dict]] = {name: [] for name in SETS}
    for repo in TUNING + HELD_OUT:
        sets["localisation"] += localisation(repo, PER_REPO["localisation"])
        docs, idents = docstring_and_identifier(repo, PER_REPO)
        sets["docstring"] += docs
        sets["identifier"] += idents
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".sets-", dir=dest.parent))
    for name, rows in sets.items():
        with (staging / f"{name}.jsonl").open("w") as fh:
            for row in rows:
                row["split"] = "tuning" if row["repo"] in TUNING else "held-out"
                fh.write(json.dumps(row) + "\n")
        print(f"{name}: {len(rows)} queries", file=sys.stderr)
    shutil.rmtree(dest, ignore_errors=True)  # a rebuild (`build.py` run again) replaces it
    staging.replace(dest)


def main() -> None:
    argparse.ArgumentParser(description="Build the search sets (bench/search/build.py PINNED "
                            "commits of the mirrors; deterministic) into " + str(folder()) +
                            "; evaluate.py builds them on first use itself.").parse_args()
    write_sets(folder())


if __name__ == "__main__":
    main()
