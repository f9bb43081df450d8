"""`/v1/sandboxes`: the fleet over HTTP, behind the auth gate and scoped to the caller's
tenant (another tenant's sandbox is a 404, indistinguishable from one that never existed).

A repo must lie under the caller's workspace roots (`sandbox/roots.py`, the same policy as
agent runs) or be a URL under `serve.repo_urls` (`sandbox/urlfetch.py`); file paths are
resolved by `core/files.py`, so nothing outside the sandbox's tree is read or written, and
git metadata (`.git` at any depth) is neither read nor written through the API.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from codeplane.core import files
from codeplane.core.errors import APIError
from codeplane.core.principal import principal_of
from codeplane.sandbox.fleet import Fleet, FleetError, Sandbox
from codeplane.sandbox.roots import Roots

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])


class CreateBody(BaseModel):
    model_config = {"extra": "forbid"}
    repo: str = Field(..., max_length=4096, description="absolute path of a git directory (or "
                                                         "bundle) under the caller's workspace "
                                                         "roots, or a URL under serve.repo_urls")
    ref: str = Field("HEAD", min_length=1, max_length=256)


class ExecBody(BaseModel):
    model_config = {"extra": "forbid"}
    command: str = Field(..., min_length=1, max_length=64 << 10)
    timeout: float | None = Field(None, gt=0, le=3600)


def _fleet(request: Request) -> Fleet:
    return request.app.state.services.fleet


def _box(request: Request, sandbox_id: str) -> Sandbox:
    try:
        return _fleet(request).get(principal_of(request).tenant, sandbox_id)
    except FleetError as exc:
        raise exc.to_api() from None


@router.post("", status_code=201)
def create(request: Request, body: CreateBody) -> dict:
    tenant = principal_of(request).tenant
    repo = Roots.of(request.app.state.settings.serve, tenant).repo(body.repo)
    try:
        box = _fleet(request).acquire(tenant, repo, body.ref)
    except FleetError as exc:
        raise exc.to_api() from None
    return _fleet(request).view(box)


@router.get("")
def list_(request: Request) -> dict:
    """The tenant's sandboxes on every replica (each with its `state` and `replica`); the
    fleet numbers are this replica's."""
    fleet = _fleet(request)
    tenant = principal_of(request).tenant
    return {"object": "list", "data": fleet.listed(tenant), "fleet": fleet.stats(tenant)}


@router.get("/{sandbox_id}")
def show(request: Request, sandbox_id: str) -> dict:
    try:
        return _fleet(request).describe(principal_of(request).tenant, sandbox_id)
    except FleetError as exc:
        raise exc.to_api() from None


@router.post("/{sandbox_id}/exec")
async def exec_(request: Request, sandbox_id: str, body: ExecBody) -> dict:
    """Runs on the fleet's own workers (`Fleet.start_exec`): a command holds none of the
    server's request threads while it runs, so one tenant's commands cannot starve the
    routes of another; past the tenant's cap, 429."""
    box = await asyncio.to_thread(_box, request, sandbox_id)
    try:
        result = await asyncio.wrap_future(
            _fleet(request).start_exec(box, body.command, body.timeout))
    except FleetError as exc:
        raise exc.to_api() from None
    return result.to_dict()


@router.get("/{sandbox_id}/files")
def read(request: Request, sandbox_id: str,
         path: str = Query(..., min_length=1, max_length=4096)) -> Response:
    box = _box(request, sandbox_id)
    try:
        if files.in_git_metadata(box.workspace, Path(path)):
            raise files.Refused(f"{path} is git metadata (.git), which the API does not serve")
        data = files.read_bytes(box.workspace, Path(path), _fleet(request).settings.max_file_bytes)
    except files.TooLarge as exc:
        raise APIError(413, str(exc), code="file_too_large", param="path") from None
    except files.Refused as exc:
        raise APIError(400, str(exc), code="path_refused", param="path") from None
    except FileNotFoundError:
        raise APIError(404, f"no file {path}", code="file_not_found", param="path") from None
    except (NotADirectoryError, IsADirectoryError, ValueError) as exc:
        raise APIError(400, f"{path}: {exc}", code="path_refused", param="path") from None
    return Response(data, media_type="application/octet-stream")


@router.put("/{sandbox_id}/files")
async def write(request: Request, sandbox_id: str,
                path: str = Query(..., min_length=1, max_length=4096)) -> dict:
    box = _box(request, sandbox_id)
    data = await request.body()  # async for the raw body; the disk work runs on a thread
    fleet = _fleet(request)
    try:
        await asyncio.to_thread(fleet.check_write, box, len(data))
        await asyncio.to_thread(files.write_atomic, box.workspace, Path(path), data)
    except FleetError as exc:
        raise exc.to_api() from None
    except files.Refused as exc:
        raise APIError(400, str(exc), code="path_refused", param="path") from None
    except (NotADirectoryError, IsADirectoryError, FileExistsError, ValueError) as exc:
        raise APIError(400, f"{path}: {exc}", code="path_refused", param="path") from None
    return {"path": path, "bytes": len(data)}


@router.get("/{sandbox_id}/diff")
async def diff(request: Request, sandbox_id: str) -> dict:
    """git runs in the sandbox on the fleet's workers, under the tenant's command cap, as
    `exec` does."""
    box = await asyncio.to_thread(_box, request, sandbox_id)
    try:
        patch = await asyncio.wrap_future(_fleet(request).start_diff(box))
    except FleetError as exc:
        raise exc.to_api() from None
    return {"id": box.id, "commit": box.commit, "diff": patch}


@router.delete("/{sandbox_id}")
def delete(request: Request, sandbox_id: str) -> dict:
    """Remove a sandbox of this replica, or the record of one whose replica died."""
    try:
        _fleet(request).forget(principal_of(request).tenant, sandbox_id)
    except FleetError as exc:
        raise exc.to_api() from None
    return {"id": sandbox_id, "deleted": True}
