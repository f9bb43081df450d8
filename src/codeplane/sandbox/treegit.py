"""git over a sandbox's tree, run inside the sandbox: the diff of its changes, the commit of
its result (a patch and a branch bundle) and the checkout of a kept branch.

The tree is the tenant's, and so is everything git would read from it as configuration: a
`.git/config` with a clean filter, `diff.external` or `include.path`, a nested repository's
hooks. So git never runs over it on the host. It runs in the sandbox (the runner's `exec`
for a read-only tree, `run` where it writes one), with a private repository in the sandbox's
own /tmp as its git directory: an empty config of ours (no system or global config, no
hooks, no fsmonitor), a private index, the tree's objects borrowed read-only through
alternates. The tree's own `.git/config` and hooks are never read; `.gitattributes` may name a
filter or diff driver, but none is defined, so none runs. Whatever a tenant planted would at
worst run inside its own sandbox.

What comes back to the host is data: the first line of output (sizes, a digest, a commit
id), a patch up to a cap, and files the host copies out as bytes (`files.copy_out`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from codeplane.sandbox.runner import BwrapRunner, Limits

GIT_TIMEOUT = 120.0
STAT_LINES = 50  # files a summary names when a diff is over its cap
_GIT_DIR = "/tmp/codeplane-git"
_ERROR = "codeplane-git-error"
# A private repository whose work tree is the sandbox's tree; failures print the marker and
# the tail of git's stderr (kept apart so warnings never mix into the output).
_PRELUDE = f"""set -e
exec 2>/tmp/codeplane-git.err
trap 'st=$?; [ $st -eq 0 ] || {{ echo {_ERROR}; tail -c 2000 /tmp/codeplane-git.err; }}' EXIT
export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null HOME=/tmp XDG_CONFIG_HOME=/tmp/none
export GIT_AUTHOR_NAME=codeplane GIT_AUTHOR_EMAIL=agent@codeplane.invalid
export GIT_COMMITTER_NAME=codeplane GIT_COMMITTER_EMAIL=agent@codeplane.invalid
git init -q --bare --template= {_GIT_DIR}
printf '[core]\\n\\thooksPath = /dev/null\\n\\tfsmonitor = false\\n\\tuntrackedCache = false\\n\
\\tautocrlf = false\\n\\tquotePath = false\\n[gc]\\n\\tauto = 0\\n' >> {_GIT_DIR}/config
echo "$PWD/.git/objects" > {_GIT_DIR}/objects/info/alternates
export GIT_DIR={_GIT_DIR} GIT_WORK_TREE="$PWD" GIT_INDEX_FILE={_GIT_DIR}/index
"""
# the index starts as the tree's own (its stat data saves hashing unchanged files)
_INDEX = 'cp "$PWD/.git/index" "$GIT_INDEX_FILE" 2>/dev/null || git read-tree {base}\n'
_ADD = "git add -A --ignore-errors -- . {excluded} >/dev/null\n"
_DIFF_OPTIONS = "--no-ext-diff --no-textconv --no-color"


class TreeGitError(RuntimeError):
    """git in the sandbox failed; the message is git's (or the runner's) reason."""


@dataclass(frozen=True)
class TreeDiff:
    """A tree's changes: the whole patch's size and digest (equal patches, equal digests),
    the patch itself when it is at most the cap, else a `--stat` summary."""

    size: int
    digest: str
    patch: str | None
    summary: str = ""


@dataclass(frozen=True)
class Commit:
    """A committed result: its commit id, and (when it differs from the base) the names of
    the patch and bundle files written into the tree, for the host to copy out."""

    head: str
    patch_file: str | None
    bundle_file: str | None


def diff(runner: BwrapRunner, workspace: Path, base: str, cap: int) -> TreeDiff:
    """The tree's changes against commit `base`, new files included (binary as git's binary
    patches), over a read-only tree."""
    script = (_PRELUDE + _INDEX.format(base=shlex.quote(base)) + _ADD.format(excluded="")
              + f"git diff --cached --binary {_DIFF_OPTIONS} {shlex.quote(base)} > /tmp/d\n"
              "set -- $(wc -c < /tmp/d) $(sha256sum < /tmp/d)\n"
              'echo "$1 $2"\n'
              f'if [ "$1" -le {int(cap)} ]; then cat /tmp/d; else '
              f"git diff --cached --stat=100 --stat-count={STAT_LINES} {_DIFF_OPTIONS} "
              f"{shlex.quote(base)}; fi\n")
    out = _run(runner, workspace, script, cap + (64 << 10), writable=False)
    first, _, rest = out.partition("\n")
    size, digest = first.split()
    if int(size) <= cap:
        return TreeDiff(int(size), digest, rest)
    return TreeDiff(int(size), digest, None, rest)


def commit(runner: BwrapRunner, workspace: Path, base: str, branch: str, message: str,
           tag: str, previous: tuple[str, str] | None = None) -> Commit:
    """Commit the tree on `branch` on top of `base`, or of `previous` (a commit and the name
    of a bundle of it the host wrote into the tree: a result made in an earlier sandbox).
    When the result differs from base, `git format-patch` from base and a bundle of
    `branch ^base` are written into the tree as `.codeplane-<tag>.patch` and `.bundle`."""
    patch, bundle = f".codeplane-{tag}.patch", f".codeplane-{tag}.bundle"
    ref = shlex.quote(f"refs/heads/{branch}")
    parent = shlex.quote(previous[0] if previous else base)
    excluded = [f":(exclude){name}" for name in (patch, bundle)]
    script = _PRELUDE
    if previous:
        script += f'git fetch -q --no-tags "$PWD/{previous[1]}" {ref}:{ref}\n'
        excluded.append(f":(exclude){previous[1]}")
    script += (_INDEX.format(base=shlex.quote(base))
               + _ADD.format(excluded=" ".join(shlex.quote(e) for e in excluded))
               + f"printf '%s\\n' {shlex.quote(message)} > /tmp/msg\n"
               "tree=$(git write-tree)\n"
               f'if [ "$tree" = "$(git rev-parse {parent}^{{tree}})" ]; then head={parent}; '
               f"else head=$(git commit-tree \"$tree\" -p {parent} -F /tmp/msg); fi\n"
               'echo "head $head"\n'
               f'if [ "$head" != {shlex.quote(base)} ]; then\n'
               f'  git update-ref {ref} "$head"\n'
               f'  git format-patch --stdout --no-color {shlex.quote(base)}.."$head" '
               f'> "$PWD/{patch}"\n'
               f'  git bundle create -q "$PWD/{bundle}" {ref} ^{shlex.quote(base)}\n'
               "fi\n")
    out = _run(runner, workspace, script, 64 << 10, writable=True)
    head = next((line[5:].strip() for line in out.splitlines() if line.startswith("head ")),
                None)
    if not head:
        raise TreeGitError(f"the commit printed no result: {out[-500:]}")
    if head == base:
        return Commit(head, None, None)
    return Commit(head, patch, bundle)


def check_out(runner: BwrapRunner, workspace: Path, base: str, branch: str,
              bundle: str) -> None:
    """Bring the tree from `base` to `branch`, fetched from the bundle file the host wrote
    into the tree (then removed): a sandbox made at the base continues a kept result."""
    ref = shlex.quote(f"refs/heads/{branch}")
    script = (_PRELUDE + f'git fetch -q --no-tags "$PWD/{bundle}" {ref}:{ref}\n'
              + _INDEX.format(base=shlex.quote(base))
              + f"git read-tree -m -u {shlex.quote(base)} {ref}\n"
              + f'rm -f "$PWD/{bundle}"\n')
    _run(runner, workspace, script, 64 << 10, writable=True)


def _run(runner: BwrapRunner, workspace: Path, script: str, output_bytes: int,
         writable: bool) -> str:
    """The script's output; TreeGitError if it failed, was killed or was cut."""
    limits = Limits(timeout=GIT_TIMEOUT, output_bytes=output_bytes,
                    drain_bytes=max(output_bytes * 2, 64 << 20))
    if writable:
        result = runner.run(script, workspace, limits)
    else:
        result = runner.exec(["/bin/sh", "-c", script], workspace, limits)
    if result.killed or result.exit_code != 0:
        reason = result.output.rpartition(_ERROR)[2].strip() or result.killed or "failed"
        raise TreeGitError(f"git in the sandbox: {reason[-500:]}")
    if result.truncated:
        raise TreeGitError("git in the sandbox printed more than expected")
    return result.output
