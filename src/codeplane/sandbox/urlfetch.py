"""Repositories fetched by URL: which URLs server policy lets the fleet fetch, and a git fetch
hardened against everything a URL or a git server could try.

Policy (`serve.repo_urls`, default empty: no URL is ever fetched) lists URL prefixes; a URL is
allowed when its scheme, host and port equal a prefix's and its path lies under the prefix's
path at a `/` boundary. Only `https`, `http` and `git` are spoken: never `file://` (a read of
the server's own disk), `ext::` (a command), `ssh` (its options are a command line), or any
`transport::address` form. URLs carry no credentials, query, dot segments or escapes, so
what is checked is what git fetches.

The fetch runs git with no user or system config (an `insteadOf` there could rewrite the URL
into a `file://` path), `protocol.allow` limited to the URL's own scheme, no redirects, no
credential helper and no prompt (a server asking for a password fails the fetch at once),
`GIT_PROTOCOL_FROM_USER=0`, no submodules, objects checked (`transfer.fsckObjects`), under a
time limit that kills its whole process group and a file-size limit (`prlimit --fsize`; the
objects arrive as one pack file, `unpackLimit=1`). The result is a bare mirror under the
fleet's directory, which the fleet then treats as a local repository (bases cached per
commit, warm pools).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

SCHEMES = ("https", "http", "git")
MAX_URL = 2048


class URLRefused(ValueError):
    """The URL is malformed or speaks a transport the fleet never uses (`status` 400), or
    policy does not list it (403)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class FetchFailed(RuntimeError):
    """git could not fetch the repository (`status`: 413 too large, 504 too slow, 502 else)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def is_url(repo: str) -> bool:
    """Does `repo` name a remote (any `scheme://` or git's `transport::address`) rather than a
    path? Anything that is one is checked as a URL, so an odd transport cannot pass as a path."""
    return "://" in repo or "::" in repo


def check(url: str, allowed: list[str]) -> str:
    """`url` if it is well-formed and under one of the `allowed` prefixes; URLRefused if not."""
    if len(url) > MAX_URL or any(c.isspace() or ord(c) < 32 or c in "\\%" for c in url):
        raise URLRefused(400, "the repo URL has spaces, control characters, backslashes or "
                              "%-escapes", "invalid_repo_url")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or not parts.hostname or "::" in url:
        raise URLRefused(400, f"repo URLs must be {', '.join(SCHEMES)} URLs (never file, ext, "
                              "ssh or another transport)", "invalid_repo_url")
    if parts.username is not None or parts.password is not None or parts.query \
            or parts.fragment or "@" in parts.netloc:
        raise URLRefused(400, "repo URLs carry no credentials, query or fragment",
                         "invalid_repo_url")
    segments = parts.path.split("/")
    if any(s in (".", "..") for s in segments) or parts.path.startswith("//"):
        raise URLRefused(400, "repo URLs have no `.` or `..` segments", "invalid_repo_url")
    try:
        port = parts.port
    except ValueError:
        raise URLRefused(400, "the repo URL's port is invalid", "invalid_repo_url") from None
    for prefix in allowed:
        if _under(parts.scheme, parts.hostname, port, parts.path, prefix):
            return url
    if not allowed:
        raise URLRefused(403, "this server fetches no repositories by URL (an operator allows "
                              "some with serve.repo_urls = [\"https://git.example.com/team/\"])",
                         "repo_url_not_allowed")
    raise URLRefused(403, f"{url} is not under an allowed repo URL ({', '.join(allowed)})",
                     "repo_url_not_allowed")


def _under(scheme: str, host: str, port: int | None, path: str, prefix: str) -> bool:
    """Is (scheme, host, port, path) inside `prefix`? Hosts compare exactly (no suffix
    match), paths at a `/` boundary (`/team/` does not admit `/teamX`)."""
    allowed = urlsplit(prefix)
    if (allowed.scheme, (allowed.hostname or "").lower(), allowed.port) != \
            (scheme, host.lower(), port):
        return False
    top = allowed.path.rstrip("/")
    return path == top or path.startswith(top + "/")


def fetch(url: str, mirror: Path, tmp: Path, max_bytes: int, timeout: float) -> None:
    """Make or update the bare mirror of `url` at `mirror`: its branches, tags and HEAD (kept
    detached, as the commit the server's HEAD named). A first fetch goes to `tmp`, renamed
    into place only when it is whole and within `max_bytes`; a mirror that grew past the
    limit is dropped."""
    first = not mirror.is_dir()
    where = tmp if first else mirror
    if first:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        if first:
            _git(["init", "--bare", "--quiet", str(tmp)], url, tmp, max_bytes, timeout)
        _git(["-C", str(where), "fetch", "--quiet", "--prune", "--no-recurse-submodules", "--",
              url, "+HEAD:refs/codeplane/head", "+refs/heads/*:refs/heads/*",
              "+refs/tags/*:refs/tags/*"], url, where, max_bytes, timeout)
        _git(["-C", str(where), "update-ref", "--no-deref", "HEAD", "refs/codeplane/head"],
             url, where, max_bytes, timeout)
        if _size(where) > max_bytes:
            raise FetchFailed(413, f"{url} is larger than the fetch limit ({max_bytes} bytes)",
                              "repo_too_large")
        if first:
            os.replace(tmp, mirror)
    except FetchFailed as exc:
        if exc.status == 413:
            shutil.rmtree(mirror, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _git(args: list[str], url: str, where: Path, max_bytes: int, timeout: float) -> None:
    scheme = urlsplit(url).scheme
    home = where.parent.parent / "git-home"  # an empty HOME: no ~/.gitconfig, no ~/.netrc
    home.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LC_ALL": "C",
           "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_PROTOCOL_FROM_USER": "0", "GIT_TERMINAL_PROMPT": "0",
           "GIT_ASKPASS": "/bin/false", "SSH_ASKPASS": "/bin/false"}
    config = ["protocol.allow=never", f"protocol.{scheme}.allow=always",
              "http.followRedirects=false", "credential.helper=", "core.askPass=/bin/false",
              "core.hooksPath=/dev/null", "core.fsmonitor=false", "transfer.fsckObjects=true",
              "fetch.unpackLimit=1", "transfer.unpackLimit=1", "submodule.recurse=false",
              "http.lowSpeedLimit=1024", f"http.lowSpeedTime={max(1, int(timeout))}"]
    argv = ["prlimit", f"--fsize={max_bytes}", "--", "git",
            *(arg for item in config for arg in ("-c", item)), *args]
    # a session of its own: on timeout the whole group (git-remote-http, index-pack) dies
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise FetchFailed(504, f"fetching {url} took longer than {timeout:.0f}s",
                          "repo_fetch_timeout") from None
    if proc.returncode == 0:
        return
    if _size(where) >= max_bytes:  # index-pack was killed at the limit: its partial pack
        raise FetchFailed(413, f"{url} is larger than the fetch limit ({max_bytes} bytes)",
                          "repo_too_large")
    raise FetchFailed(502, f"could not fetch {url}: {stderr.strip()[-300:] or proc.returncode}",
                      "repo_fetch_failed")


def _size(top: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(top):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total
