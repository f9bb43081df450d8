"""HTTP layer of private search (`/v1/index/...`); `/v1/embeddings` is the gateway's.

The workspace's server key travels in the `X-Codeplane-Key` header of every request and is never
stored; handlers are sync functions (FastAPI runs them on its thread pool) because embedding and
LanceDB calls block.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from codeplane.search.embed import EmbedderUnavailable
from codeplane.search.service import CacheMiss, SearchError, SearchService
from codeplane.core.errors import APIError, unavailable

router = APIRouter()
KeyHeader = Annotated[str, Header(alias="X-Codeplane-Key", min_length=16, max_length=128)]


class TreeRequest(BaseModel):
    paths: list[str] = Field(max_length=1000)


class NodesRequest(BaseModel):
    nodes: list[dict] = Field(max_length=100_000)


class PathsRequest(BaseModel):
    paths: list[str] = Field(max_length=10_000)


class KeysRequest(BaseModel):
    keys: list[str] = Field(max_length=10_000)


class UploadRequest(BaseModel):
    files: list[dict] = Field(max_length=1000)


class SearchRequest(BaseModel):
    query: str = Field(min_length=1, max_length=8000)
    limit: int = Field(10, ge=1, le=200)
    prefix: str | None = None


def _service(request: Request) -> SearchService:
    return request.app.state.services.search


def _call(fn, *args):
    """Run a service call; its errors leave in the server's one error shape."""
    try:
        return fn(*args)
    except CacheMiss as exc:
        body = APIError(409, str(exc), code="cache_miss").body()
        body["error"]["missing"] = exc.missing
        return JSONResponse(body, 409)
    except SearchError as exc:
        return JSONResponse(APIError(exc.status, str(exc)).body(), exc.status)
    except EmbedderUnavailable as exc:
        return JSONResponse(unavailable(str(exc), "embedder_unavailable").body(), 503)


@router.put("/v1/index/workspaces/{ws}")
def open_workspace(ws: str, key: KeyHeader, request: Request):
    return _call(_service(request).open_workspace, ws, key)


@router.get("/v1/index/workspaces/{ws}")
def status(ws: str, key: KeyHeader, request: Request):
    return _call(_service(request).status, ws, key)


@router.post("/v1/index/workspaces/{ws}/tree")
def tree(ws: str, body: TreeRequest, key: KeyHeader, request: Request):
    return _call(lambda: {"nodes": _service(request).tree(ws, key, body.paths)})


@router.post("/v1/index/workspaces/{ws}/commit")
def commit(ws: str, body: NodesRequest, key: KeyHeader, request: Request):
    return _call(lambda: {"committed": _service(request).commit(ws, key, body.nodes)})


@router.post("/v1/index/workspaces/{ws}/delete")
def delete(ws: str, body: PathsRequest, key: KeyHeader, request: Request):
    return _call(lambda: {"deleted": _service(request).delete(ws, key, body.paths)})


@router.post("/v1/index/workspaces/{ws}/missing")
def missing(ws: str, body: KeysRequest, key: KeyHeader, request: Request):
    return _call(lambda: {"missing": _service(request).missing(ws, key, body.keys)})


@router.post("/v1/index/workspaces/{ws}/files")
def upload(ws: str, body: UploadRequest, key: KeyHeader, request: Request):
    return _call(_service(request).upload, ws, key, body.files)


@router.post("/v1/index/workspaces/{ws}/search")
def search(ws: str, body: SearchRequest, key: KeyHeader, request: Request):
    return _call(_service(request).search, ws, key, body.query, body.limit, body.prefix)
