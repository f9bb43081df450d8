"""The apply benchmarks' case sets, built at run time from public git histories.

A case is one modified Python file of one real commit: (parent version, commit version).
The repository commits only each set's manifest (`bench/apply/sets/NAME.txt`: repository,
commit and path a line, and the sha256 of the built set); the files themselves are
third-party code and are read from the repositories' histories when a benchmark first
needs them, into a cache directory (`$CODEPLANE_BENCH_CACHE`, default
`~/.cache/codeplane-bench`). A commit id pins its files, so a build is byte-identical to the
set the manifest was made from; the build checks the sha256 and refuses a mismatch.

Repositories come from bare mirrors under `$CODEPLANE_MIRRORS` (default `/work/.mirror`,
`owner+name/repo` as the `fetch` tool lays them out), else they are cloned from GitHub into
the cache (`git clone --bare --filter=blob:none`; where the network allows it).

Usage:
  python bench/apply/sets.py build [NAME...]        # build (or check) the sets' caches
  python bench/apply/sets.py select OWNER/NAME... --name NAME [--per-bucket 24]
                                                    # pick a new set from histories
  python bench/apply/sets.py list                   # the sets, their repositories, sizes
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

MANIFESTS = Path(__file__).resolve().with_name("sets")
MIRRORS = Path(os.environ.get("CODEPLANE_MIRRORS", "/work/.mirror"))
CACHE = Path(os.environ.get("CODEPLANE_BENCH_CACHE", Path.home() / ".cache/codeplane-bench"))
BUCKETS = ((50, 200), (200, 1000), (1000, 3000), (3000, 10**9))  # file lines


class SetError(Exception):
    """A set cannot be built here (no manifest, no repository, a mismatching build)."""


def names() -> list[str]:
    return sorted(p.stem for p in MANIFESTS.glob("*.txt"))


# -- repositories ----------------------------------------------------------------------------

def git_dir(repo: str) -> Path:
    """owner/name -> a git directory holding its history: the mirror, else a clone in the
    cache (made on first use)."""
    mirror = MIRRORS / repo.replace("/", "+") / "repo"
    for path in (mirror / ".git", mirror):
        if (path / "HEAD").is_file():
            return path
    clone = CACHE / "repos" / repo.replace("/", "+")
    if not (clone / "HEAD").is_file():
        print(f"cloning {repo} into {clone}", file=sys.stderr)
        done = subprocess.run(["git", "clone", "--quiet", "--bare", "--filter=blob:none",
                               f"https://github.com/{repo}.git", str(clone)],
                              check=False, capture_output=True, text=True)
        if done.returncode:
            raise SetError(f"{repo}: no mirror under {MIRRORS} and cloning failed "
                           f"({done.stderr.strip()[:200]}); fetch github:{repo} first")
    return clone


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git_dir(repo)), *args], check=True,
                          capture_output=True, text=True, errors="strict").stdout


# -- building a set from its manifest --------------------------------------------------------

def read_manifest(name: str) -> tuple[str | None, list[tuple[str, str, str]]]:
    """The recorded sha256 of the built set, and its (repo, commit, path) rows."""
    path = MANIFESTS / f"{name}.txt"
    if not path.is_file():
        raise SetError(f"no set {name!r} (have: {', '.join(names())})")
    digest, rows = None, []
    for line in path.read_text().splitlines():
        if line.startswith("# sha256 "):
            digest = line.split()[2]
        elif line.strip() and not line.startswith("#"):
            repo, commit, file = line.split("\t")
            rows.append((repo, commit, file))
    return digest, rows


def case_of(repo: str, commit: str, path: str) -> dict:
    """One case as the benchmarks read it (`repo` spelt owner+name, as the sets always were)."""
    return {"repo": repo.replace("/", "+"), "commit": commit, "path": path,
            "original": git(repo, "show", f"{commit}^:{path}"),
            "expected": git(repo, "show", f"{commit}:{path}")}


def serialise(cases: list[dict]) -> str:
    return "".join(json.dumps(case) + "\n" for case in cases)


def build(name: str) -> Path:
    """Build set `name` into the cache (once) and return its path; checked against the
    manifest's sha256."""
    out = CACHE / "apply" / f"{name}.jsonl"
    digest, rows = read_manifest(name)
    if out.is_file() and hashlib.sha256(out.read_bytes()).hexdigest() == digest:
        return out
    try:
        text = serialise([case_of(*row) for row in rows])
    except subprocess.CalledProcessError as exc:
        raise SetError(f"set {name}: {' '.join(exc.cmd[3:])} failed: "
                       f"{exc.stderr.strip()[:200]}") from exc
    got = hashlib.sha256(text.encode()).hexdigest()
    if digest is not None and got != digest:
        raise SetError(f"set {name}: the build's sha256 {got[:16]} is not the manifest's "
                       f"{digest[:16]} (a rewritten history?)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    tmp.write_text(text)
    tmp.replace(out)
    return out


def load(name: str) -> list[dict]:
    """The cases of set `name`, built first if the cache lacks them."""
    with build(name).open() as fh:
        return [json.loads(line) for line in fh]


# -- selecting a new set ---------------------------------------------------------------------

def candidates(repo: str) -> list[tuple[str, str]]:
    """(commit, path) of every non-merge commit's modified Python file, newest first."""
    log = git(repo, "log", "--no-merges", "--diff-filter=M", "--format=@%H", "--name-only",
              "--", "*.py")
    out, commit = [], ""
    for line in log.splitlines():
        if line.startswith("@"):
            commit = line[1:]
        elif line.strip():
            out.append((commit, line.strip()))
    return out


def bucket_of(n: int) -> int | None:
    return next((b for b, (lo, hi) in enumerate(BUCKETS) if lo <= n < hi), None)


def usable(old: str, new: str) -> bool:
    """A real, moderate edit of a file that parses before and after."""
    from codeplane.core.languages import first_error_line

    a, b = old.splitlines(), new.splitlines()
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    changed = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in matcher.get_opcodes()
                  if tag != "equal")
    hunks = list(matcher.get_grouped_opcodes(3))
    return (0 < changed <= 120 and len(hunks) <= 8 and "\r" not in old
            and first_error_line(old, "python") is None
            and first_error_line(new, "python") is None)


def select(repos: list[str], per_bucket: int, seed: int = 7) -> list[tuple[str, str, str]]:
    """Up to `per_bucket` cases per file-size bucket and repository, in a seeded shuffle of
    the history (at most 3 per file below the largest bucket). The history grows, so a
    later selection differs: the manifest pins the one made."""
    rng = random.Random(seed)
    rows = []
    for repo in repos:
        found: dict[int, int] = defaultdict(int)
        per_file: dict[str, int] = defaultdict(int)
        pool = candidates(repo)
        rng.shuffle(pool)
        for commit, path in pool:
            if all(found[b] >= per_bucket for b in range(len(BUCKETS))):
                break
            try:
                old = git(repo, "show", f"{commit}^:{path}")
                new = git(repo, "show", f"{commit}:{path}")
            except (subprocess.CalledProcessError, UnicodeDecodeError):
                continue
            bucket = bucket_of(len(old.splitlines()))
            if bucket is None or found[bucket] >= per_bucket or per_file[path] >= (
                    per_bucket if bucket == len(BUCKETS) - 1 else 3) or not usable(old, new):
                continue
            per_file[path] += 1
            found[bucket] += 1
            rows.append((repo, commit, path))
        print(f"{repo}: {dict(found)}", file=sys.stderr)
    return rows


def write_manifest(name: str, rows: list[tuple[str, str, str]], about: str) -> Path:
    text = serialise([case_of(*row) for row in rows])
    path = MANIFESTS / f"{name}.txt"
    MANIFESTS.mkdir(exist_ok=True)
    path.write_text(f"# {about}\n# sha256 {hashlib.sha256(text.encode()).hexdigest()}\n"
                    + "".join("\t".join(row) + "\n" for row in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    builder = sub.add_parser("build", help="build the sets' caches from the histories")
    builder.add_argument("sets", nargs="*", help="set names (default: all)")
    picker = sub.add_parser("select", help="pick a new set from repositories' histories")
    picker.add_argument("repos", nargs="+", help="owner/name")
    picker.add_argument("--name", required=True)
    picker.add_argument("--per-bucket", type=int, default=24)
    picker.add_argument("--about", default="", help="the manifest's first comment line")
    sub.add_parser("list", help="the sets and their repositories")
    args = parser.parse_args()
    try:
        if args.command == "build":
            for name in args.sets or names():
                print(f"{name}: {len(load(name))} cases, {build(name)}")
        elif args.command == "select":
            if any(r.count("/") != 1 for r in args.repos):
                parser.error("repositories are owner/name")
            path = write_manifest(args.name, select(args.repos, args.per_bucket),
                                  args.about or f"selected from {', '.join(args.repos)}")
            print(f"{path}: {len(read_manifest(args.name)[1])} cases")
        else:
            for name in names():
                rows = read_manifest(name)[1]
                repos = sorted({r for r, _, _ in rows})
                print(f"{name}: {len(rows)} cases from {', '.join(repos)}")
    except SetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
