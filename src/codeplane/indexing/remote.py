"""The client's HTTP view of the search server: one method per `/v1/index` endpoint."""

from __future__ import annotations

import httpx

from codeplane.indexing.vectors import ClientVectors


class RemoteError(Exception):
    """The server refused a request or cannot be reached; the message says which."""

    def __init__(self, message: str, status: int | None = None, body: dict | None = None):
        super().__init__(message)
        self.status, self.body = status, body or {}


class Remote:
    def __init__(self, server: str, workspace: str, server_key: str,
                 client: httpx.Client | None = None, timeout: float = 300.0,
                 vectors: ClientVectors | None = None) -> None:
        self.base = f"/v1/index/workspaces/{workspace}"
        self.server = server.rstrip("/")
        self.http = client or httpx.Client(timeout=timeout)
        self.http.headers["X-Codeplane-Key"] = server_key
        self.vectors = vectors  # client-side embedding mode: queries leave as vectors
        self.round_trips = 0
        self.bytes_sent = 0

    def _send(self, method: str, suffix: str = "", body: dict | None = None) -> dict:
        url = f"{self.server}{self.base}{suffix}"
        try:
            resp = self.http.request(method, url, json=body)
        except httpx.TransportError as exc:
            raise RemoteError(f"cannot reach the codeplane server at {self.server} ({exc}); "
                              "start it with `codeplane serve` or pass --server") from exc
        self.round_trips += 1
        self.bytes_sent += len(resp.request.content)
        if resp.status_code >= 400:
            try:
                data = resp.json()
            except ValueError:
                data = {}
            message = (data.get("error") or {}).get("message") or resp.text[:200]
            raise RemoteError(f"server: {message} (HTTP {resp.status_code})",
                              resp.status_code, data)
        return resp.json()

    def open(self) -> dict:
        return self._send("PUT")

    def drop(self) -> dict:
        """Delete the server's copy of the workspace (vectors, tree, registration)."""
        return self._send("DELETE")

    def status(self) -> dict:
        return self._send("GET")

    def tree(self, paths: list[str]) -> dict:
        return self._send("POST", "/tree", {"paths": paths})["nodes"]

    def commit(self, nodes: list[dict]) -> None:
        self._send("POST", "/commit", {"nodes": nodes})

    def delete(self, paths: list[str]) -> None:
        self._send("POST", "/delete", {"paths": paths})

    def missing(self, keys: list[str]) -> set[str]:
        return set(self._send("POST", "/missing", {"keys": keys})["missing"])

    def upload(self, files: list[dict]) -> dict:
        return self._send("POST", "/files", {"files": files})

    def search(self, query: str, limit: int, prefix: str | None) -> dict:
        body: dict = {"limit": limit, "prefix": prefix}
        if self.vectors is None:
            body["query"] = query
        else:
            body["vector"] = self.vectors.encode([query])[0]
        return self._send("POST", "/search", body)

    def close(self) -> None:
        self.http.close()
