"""Shared server storage: the database (SQLite or PostgreSQL, `database.py`) and the object
store (a local directory or an S3 bucket, `objects.py`), each behind one API.

Names are resolved on first use (PEP 562): every `codeplane` command imports modules that
import this package, and pyarrow plus SQLAlchemy are slow to load (docs/deployment.md, "Event
lake").
"""

from importlib import import_module
from typing import Any

_HOME = {"Database": "database", "DatabaseError": "database", "Replica": "database",
         "ObjectInfo": "objects", "ObjectNotFound": "objects", "ObjectStore": "objects",
         "StorageError": "objects"}
__all__ = ["Database", "DatabaseError", "ObjectInfo", "ObjectNotFound", "ObjectStore",
           "Replica", "StorageError"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
