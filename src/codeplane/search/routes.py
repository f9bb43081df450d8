"""HTTP layer of private search (`/v1/index/...`); `/v1/embeddings` is the gateway's.

The workspace's server key travels in the `X-Codeplane-Key` header of every request and is never
stored; handlers are sync functions (FastAPI runs them on its thread pool) because embedding and
LanceDB calls block.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Request
from fastapi.responses import JSONResponse

from codeplane.core.errors import APIError, unavailable
from codeplane.core.principal import principal_of
from codeplane.models.embed import EmbedderUnavailable
from codeplane.search.schemas import (
    TOKEN,
    KeysRequest,
    NodesRequest,
    PathsRequest,
    SearchRequest,
    TreeRequest,
    UploadRequest,
)
from codeplane.search.service import CacheMiss, SearchError, SearchService

router = APIRouter()
KeyHeader = Annotated[str, Header(alias="X-Codeplane-Key", min_length=16, max_length=128,
                                  pattern=TOKEN)]
WorkspaceId = Annotated[str, Path(pattern=TOKEN, description="client-chosen workspace id")]


def _service(request: Request) -> SearchService:
    return request.app.state.services.search


def _call(request: Request, fn, *args):
    """Run a service call as the request's tenant; its errors leave in the server's one error
    shape."""
    try:
        return fn(principal_of(request).tenant, *args)
    except CacheMiss as exc:
        body = APIError(409, str(exc), code="cache_miss").body()
        body["error"]["missing"] = exc.missing
        return JSONResponse(body, 409)
    except SearchError as exc:
        return JSONResponse(APIError(exc.status, str(exc), code=exc.code).body(), exc.status)
    except EmbedderUnavailable as exc:
        return JSONResponse(unavailable(str(exc), exc.code).body(), 503)


@router.put("/v1/index/workspaces/{ws}")
def open_workspace(ws: WorkspaceId, key: KeyHeader, request: Request):
    return _call(request, _service(request).open_workspace, ws, key)


@router.get("/v1/index/workspaces/{ws}")
def status(ws: WorkspaceId, key: KeyHeader, request: Request):
    return _call(request, _service(request).status, ws, key)


@router.delete("/v1/index/workspaces/{ws}")
def delete_workspace(ws: WorkspaceId, key: KeyHeader, request: Request):
    return _call(request, _service(request).delete_workspace, ws, key)


@router.post("/v1/index/workspaces/{ws}/tree")
def tree(ws: WorkspaceId, body: TreeRequest, key: KeyHeader, request: Request):
    return _call(request, lambda *a: {"nodes": _service(request).tree(*a)}, ws, key, body.paths)


@router.post("/v1/index/workspaces/{ws}/commit")
def commit(ws: WorkspaceId, body: NodesRequest, key: KeyHeader, request: Request):
    return _call(request, lambda *a: {"committed": _service(request).commit(*a)},
                 ws, key, body.nodes)


@router.post("/v1/index/workspaces/{ws}/delete")
def delete(ws: WorkspaceId, body: PathsRequest, key: KeyHeader, request: Request):
    return _call(request, lambda *a: {"deleted": _service(request).delete(*a)},
                 ws, key, body.paths)


@router.post("/v1/index/workspaces/{ws}/missing")
def missing(ws: WorkspaceId, body: KeysRequest, key: KeyHeader, request: Request):
    return _call(request, lambda *a: {"missing": _service(request).missing(*a)},
                 ws, key, body.keys)


@router.post("/v1/index/workspaces/{ws}/files")
def upload(ws: WorkspaceId, body: UploadRequest, key: KeyHeader, request: Request):
    return _call(request, _service(request).upload, ws, key, body.files)


@router.post("/v1/index/workspaces/{ws}/search")
def search(ws: WorkspaceId, body: SearchRequest, key: KeyHeader, request: Request):
    return _call(request, _service(request).search, ws, key, body.query, body.limit,
                 body.prefix, body.vector)
