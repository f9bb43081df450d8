"""Old MD5 password check. Replaced by auth.py; kept only until the migration finished."""
import hashlib


def check(password: str, digest: str) -> bool:
    return hashlib.md5(password.encode()).hexdigest() == digest
