"""Host-side file access to a workspace a sandboxed command may have rigged: the one resolver
every read and write by the harness goes through (file tools, the grep fallback, search
snippets, the client-side indexer), and the text codec that lets an edit change some lines
without touching the bytes of the others. It lives in `core/` because the sandbox and the
indexer both read files and neither may depend on the other.

Reading: the path's real location must lie in the workspace; it is then opened one
component at a time from the workspace's directory fd with O_NOFOLLOW, so a directory
swapped for a symlink between the check and the open fails instead of leading out. The file
itself is opened with O_NOFOLLOW|O_NONBLOCK (a FIFO cannot block the open) and the *fd* is
fstat'ed: anything but a regular file (FIFO, device, socket) is refused, and so is a file
larger than the limit, before a byte is read (a sparse file reports its full size).

Writing: into a temporary file in the same directory (same walk, same fd), fsync'ed, given the
old file's mode and owner, then renamed over the name. Readers and a killed writer see the old
file or the new one, never a mix; a symlink swapped in at the name is replaced, not followed.
The temporary name has a fixed length, so any name the filesystem takes can be written.

Git metadata is never written or removed here: a path with a component git would take for
`.git` (in any case, with the trailing dots and spaces NTFS drops, or as its 8.3 short name
`git~1`, as git's own `core.protectNTFS` check does) is refused at any depth. A repository's
config is code the host's git would run; nothing the harness writes on a tenant's behalf may
create one.

A name longer than the filesystem allows (ENAMETOOLONG), a symlink loop (ELOOP) or a path
that changes kind under the walk are refused (Refused), not raised as OS errors.

Python's standard library has no openat2(RESOLVE_BENEATH); the walk does by hand what it
would do.
"""

from __future__ import annotations

import codecs
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket",
          stat.S_IFLNK: "a symlink", stat.S_IFDIR: "a directory"}


class Refused(Exception):
    """The path is not a regular file inside the workspace (or changed while in use)."""


class TooLarge(Refused):
    def __init__(self, path: Path, size: int, limit: int) -> None:
        super().__init__(f"{path.name} is too large ({size} bytes; the limit is {limit})")
        self.size, self.limit = size, limit


_REFUSED_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR)


def is_git_name(name: str) -> bool:
    """Would git take this path component for `.git`?"""
    return name.rstrip(". ").lower() in (".git", "git~1")


def in_git_metadata(root: Path, path: Path) -> bool:
    """Does `path` (resolved, symlinks included) name `.git` or something inside one?"""
    real = confine(root, path)
    return any(is_git_name(part) for part in real.relative_to(os.path.realpath(root)).parts)


def confine(root: Path, path: Path) -> Path:
    """The real location of `path` (absolute, or relative to root); Refused outside root."""
    candidate = path if path.is_absolute() else root / path
    real = Path(_realpath(str(candidate)))
    if not _under(str(real), str(root)):
        via = " (through a symlink)" if Path(os.path.abspath(candidate)) != real else ""
        raise Refused(f"{path} is outside the workspace{via}")
    return real


def _realpath(path: str) -> str:
    """os.path.realpath, resolved by the kernel when the path exists: one open(O_PATH)
    instead of an lstat per component in Python (walks call this per directory, so a deep
    tree, which any sandboxed command can make, made that quadratic: docs/fleet.md, "Git and
    the host")."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (OSError, ValueError):  # absent (a file to create), a loop, a NUL: Python's way
        return os.path.realpath(path)
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc
        return os.path.realpath(path)
    finally:
        os.close(fd)


def _under(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip("/") + "/")


def read_bytes(root: Path, path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular file inside root, at most max_bytes of them (TooLarge)."""
    with _parent(root, path) as (dir_fd, name, real):
        fd = _open_regular(dir_fd, name, real)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if st.st_size > max_bytes:
                raise TooLarge(real, st.st_size, max_bytes)
            data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew since the fstat
        raise TooLarge(real, len(data), max_bytes)
    return data


def copy_out(root: Path, path: Path, dest: Path, max_bytes: int) -> int:
    """Copy a regular file inside root to a host path (created, never followed), streamed:
    the bytes a sandbox produced reach the host as data, never whole in memory. TooLarge
    past max_bytes (dest is then removed); the number of bytes copied."""
    with _parent(root, path) as (dir_fd, name, real):
        src = os.fdopen(_open_regular(dir_fd, name, real), "rb")
    copied = 0
    with src, open(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600),
                   "wb") as out:
        while chunk := src.read(1 << 20):
            copied += len(chunk)
            if copied > max_bytes:
                out.close()
                dest.unlink()
                raise TooLarge(real, copied, max_bytes)
            out.write(chunk)
    return copied


def _open_regular(dir_fd: int, name: str, real: Path) -> int:
    """An fd of the regular file `name` in dir_fd (no symlink followed, no FIFO blocking)."""
    _check_kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), real)
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise Refused(f"{real.name} is not a regular file") from None
        raise
    try:
        _check_kind(os.fstat(fd), real)
    except Refused:
        os.close(fd)
        raise
    return fd


def write_atomic(root: Path, path: Path, data: bytes) -> None:
    """Replace (or create, with its directories) a file inside root atomically, keeping the
    old file's mode and owner. Refused for git metadata."""
    with _parent(root, path, create=True, writing=True) as (dir_fd, name, real):
        try:
            old = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            _check_kind(old, real)
        except FileNotFoundError:
            old = None
        tmp = f".codeplane-tmp-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600 if old else 0o666, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if old is not None:
                    os.fchmod(fd, stat.S_IMODE(old.st_mode))
                    if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                        try:
                            os.fchown(fd, old.st_uid, old.st_gid)
                        except PermissionError:
                            pass  # not ours to give away: the mode is kept, the owner is us
                os.fsync(fd)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        os.fsync(dir_fd)


def remove(root: Path, path: Path) -> None:
    """Delete a regular file inside root (never what a swapped-in symlink points to, never
    git metadata)."""
    with _parent(root, path, writing=True) as (dir_fd, name, real):
        _check_kind(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), real)
        os.unlink(name, dir_fd=dir_fd)


@contextmanager
def _parent(root: Path, path: Path, create: bool = False,
            writing: bool = False) -> Iterator[tuple[int, str, Path]]:
    """An fd of the real parent directory reached from root without following any symlink,
    the final name, and the real path. OS errors that say the path itself is unusable
    (a name too long, a symlink loop, a file where a directory was) become Refused."""
    root = Path(os.path.realpath(root))
    try:
        real = confine(root, path)
    except OSError as exc:
        raise _refusal(path, exc) from None
    parts = real.relative_to(root).parts
    if not parts:
        raise Refused("the workspace root is a directory, not a file")
    if writing and any(is_git_name(part) for part in parts):
        raise Refused(f"{path} is git metadata (.git), which is never written from outside the "
                      "sandbox: git would run its config and hooks on the host")
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            fd = _descend(fd, name, create, real)
        yield fd, parts[-1], real
    except OSError as exc:
        if exc.errno in _REFUSED_ERRNOS:
            raise _refusal(path, exc) from None
        raise
    finally:
        os.close(fd)


def _refusal(path: Path, exc: OSError) -> Refused:
    return Refused(f"{str(path)[:200]}: {exc.strerror or exc}")


def _descend(fd: int, name: str, create: bool, real: Path) -> int:
    """The fd of directory `name` in fd (made if `create`), never through a symlink; fd is
    closed when its child is open."""
    try:
        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, dir_fd=fd)
        except FileExistsError:
            pass
        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refused(f"{real}: {name} changed into a symlink or a file while in use; "
                          "refusing to follow it") from None
        raise
    os.close(fd)
    return child


def _check_kind(st: os.stat_result, real: Path) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise Refused(f"{real.name} is {kind}, not a regular file")


# ---------------------------------------------------------------- lossless text

_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16-le"),
         (codecs.BOM_UTF16_BE, "utf-16-be"))
_ESCAPED = re.compile("[\udc80-\udcff]")
_LABELS = {"utf-8": "UTF-8", "utf-8-sig": "UTF-8 with BOM", "utf-16-le": "UTF-16 LE with BOM",
           "utf-16-be": "UTF-16 BE with BOM", "latin-1": "Latin-1",
           "utf-8-escaped": "UTF-8 with invalid bytes"}


@dataclass(frozen=True)
class TextFile:
    """A file's text in the form edits are made on ("\\n" line ends), and how to turn an
    edited text back into bytes so that every untouched byte comes back unchanged.

    Formats: UTF-8; UTF-8 and UTF-16 with a BOM (kept); UTF-8 with a few invalid bytes (kept
    as surrogate escapes, shown as U+FFFD); anything else without NUL bytes as Latin-1, which
    maps every byte to one character and back; a file whose every line ends in CRLF is edited
    with LF and written back with CRLF. NUL bytes without a UTF-16 BOM: binary, refused."""

    text: str
    encoding: str
    crlf: bool = False

    @property
    def label(self) -> str:
        return _LABELS[self.encoding] + (", CRLF line endings" if self.crlf else "")

    @property
    def shown(self) -> str:
        return self.show(self.text)

    def show(self, text: str) -> str:
        """Text as the model sees it: stray bytes as U+FFFD (escapes cannot be sent)."""
        return _ESCAPED.sub("\ufffd", text) if self.encoding == "utf-8-escaped" else text

    def incoming(self, text: str) -> str:
        """Text from the model in this file's line-end convention (CRLF files are edited in
        LF)."""
        return text.replace("\r\n", "\n") if self.crlf else text

    def encode(self, text: str) -> bytes:
        """Bytes for an edited text; ValueError naming what the encoding cannot hold."""
        if self.crlf:
            text = text.replace("\n", "\r\n")
        if self.encoding == "utf-8-escaped":
            return text.encode("utf-8", "surrogateescape")
        bom = {"utf-8-sig": codecs.BOM_UTF8, "utf-16-le": codecs.BOM_UTF16_LE,
               "utf-16-be": codecs.BOM_UTF16_BE}.get(self.encoding, b"")
        codec = "utf-8" if self.encoding == "utf-8-sig" else self.encoding
        try:
            return bom + text.encode(codec)
        except UnicodeEncodeError as exc:
            bad = "".join(sorted(set(exc.object[exc.start:exc.end])))[:10]
            raise ValueError(f"the file is {_LABELS[self.encoding]} and cannot hold "
                             f"{bad!r}") from None


def decode(data: bytes, name: str) -> TextFile:
    """The TextFile for a file's bytes; Refused for binary data."""
    text, encoding = _decode(data, name)
    crlf = "\r\n" in text and text.count("\r\n") == text.count("\n")
    return TextFile(text.replace("\r\n", "\n") if crlf else text, encoding, crlf)


def _decode(data: bytes, name: str) -> tuple[str, str]:
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data[len(bom):].decode(encoding.removesuffix("-sig")), encoding
            except UnicodeDecodeError:
                raise Refused(f"{name} starts with a {_LABELS[encoding]} mark but is not "
                              "valid in it; refusing to rewrite it") from None
    if b"\0" in data:
        raise Refused(f"{name} is a binary file")
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        pass
    escaped = data.decode("utf-8", "surrogateescape")
    if any(ord(c) > 0x7F and not 0xDC80 <= ord(c) <= 0xDCFF for c in escaped):
        return escaped, "utf-8-escaped"  # real UTF-8 with a few stray bytes
    return data.decode("latin-1"), "latin-1"
