"""Shared server storage: the object store (a local directory or an S3 bucket) behind one API."""

from codeplane.storage.objects import ObjectInfo, ObjectNotFound, ObjectStore, StorageError

__all__ = ["ObjectInfo", "ObjectNotFound", "ObjectStore", "StorageError"]
