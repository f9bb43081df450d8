"""The one HTTP process: `create_app(settings)` builds the services once, puts the trust
boundary (auth gate, body limit) in front of everything, and mounts compartments' routers.

Compartments own their routes (`APIRouter`s in their own packages) and reach services through
`request.app.state.services`; this module composes, it holds no logic of its own.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi_offline import FastAPIOffline

from codeplane import __version__
from codeplane.agent import routes as agent_routes
from codeplane.apply import routes as apply_routes
from codeplane.background import routes as background_routes
from codeplane.background import web as background_web
from codeplane.config import Settings
from codeplane.core import errors, metrics
from codeplane.gateway import routes as gateway_routes
from codeplane.gateway.keys import KeyStore
from codeplane.models.engine import Engine
from codeplane.sandbox import routes as sandbox_routes
from codeplane.search import routes as search_routes
from codeplane.server.auth import AuthGate, BodyLimit, check_exposure
from codeplane.server.edge import EdgeConfig, raise_fd_limit
from codeplane.server.services import build_services
from codeplane.storage.modes import tighten
from codeplane.tab import routes as tab_routes

# Open without a key: liveness only. /docs and /openapi.json stay behind the gate (deny by
# default; fetch them with a key, or freely on a loopback `auth = "auto"` laptop).
OPEN_PATHS = frozenset({"/healthz"}) | background_web.PUBLIC_PATHS  # + the UI's sign-in


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    services = build_services(settings, engine)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        tighten(settings.server_dir)  # 0700/0600, whatever an older version left
        freeze_startup_objects()
        warming = services.start()  # in the background: the port opens at once
        yield
        warming.cancel()
        await services.aclose()

    # /docs must render air-gapped: FastAPIOffline serves Swagger UI's script and style itself
    # (FastAPI's default page loads them from a CDN and renders blank offline).
    app = FastAPIOffline(title="codeplane", version=__version__, lifespan=lifespan)
    app.state.services = services
    app.state.settings = settings  # read by compartments that need only settings or the
    app.state.engine = services.engine  # engine
    errors.install(app)
    # Starlette runs the last-added middleware first: metrics, then the gate, then the limit.
    app.add_middleware(BodyLimit, limit=settings.serve.max_body_bytes)
    app.add_middleware(AuthGate, keys=services.keys, mode=settings.gateway.auth,
                       serve=settings.serve, open_paths=open_paths(settings))
    metrics.install(app, services.metrics)
    app.include_router(gateway_routes.router)  # /v1/chat/completions, completions, ...
    app.include_router(agent_routes.router)
    app.include_router(search_routes.router)
    app.include_router(tab_routes.router)
    app.include_router(apply_routes.router)
    app.include_router(background_routes.router)
    app.include_router(background_web.ui_router())
    app.include_router(sandbox_routes.router)  # /v1/sandboxes

    @app.get("/healthz")
    def healthz(request: Request) -> dict:
        return {"status": "ok", "version": __version__,
                "models_loaded": request.app.state.engine.loaded()}

    return app


def freeze_startup_objects() -> None:
    """Move everything built so far (modules, the app, services) out of the garbage
    collector's reach. They live until exit anyway, and a full collection that scans them all
    stalls the event loop: that, not the request path, was the gateway's p99 under load
    (docs/gateway.md, "Where the p99 came from"). Later collections scan only objects made
    since; reference cycles among those are still collected."""
    gc.collect()
    gc.freeze()


def open_paths(settings: Settings) -> frozenset[str]:
    """Paths the gate lets through without a key: /healthz, and /metrics if the operator
    opened it for a scraper (`serve.public_metrics`)."""
    return OPEN_PATHS | ({"/metrics"} if settings.serve.public_metrics else set())


def serve(settings: Settings, host: str, port: int, log_level: str = "info",
          workers: int = 1, engine: Engine | None = None) -> None:
    """Build the app (a bad config fails here, before binding), refuse a non-loopback bind
    that could not authenticate anyone, then run uvicorn behind the edge's limits
    (`server/edge.py`): in this process, or in `workers` processes sharing one listening
    socket, each building its own app. `engine`: one the caller started loading models on
    before it imported the server (one process only; the caller closes it)."""
    import functools

    import uvicorn
    from uvicorn.supervisors import Multiprocess

    settings = settings.model_copy(update={"serve": settings.serve.model_copy(
        update={"host": host, "port": port, "workers": workers})})  # the gate decides
    # "loopback" by the real bind; the gateway splits deployment limits between workers
    keys = KeyStore.from_settings(settings)
    check_exposure(settings.serve, host, settings.gateway.auth, keys)
    keys.db.close()
    app = create_app(settings, engine)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    raise_fd_limit()
    options = {"host": host, "port": port, "log_level": log_level,
               "timeout_graceful_shutdown": 5}
    if workers == 1:
        config = EdgeConfig(app, settings.serve, **options)
        logging.getLogger("codeplane.server").info(
            "edge: %s connections at most (%s per client address), headers within %gs",
            config.edge.max_connections, config.edge.max_connections_per_ip,
            config.edge.header_timeout_s)
        uvicorn.Server(config).run()
        return
    # this app only proved the config: each worker builds and owns its own services, so the
    # supervisor holds no lease, warm sandboxes or model of its own
    asyncio.run(app.state.services.aclose())
    # A factory keeps these settings (the CLI's overrides included) for the workers: each
    # worker process builds its own services.
    # The supervisor kills a worker that does not answer its ping in time (uvicorn's
    # default: 5 s). Building the app takes longer than that on a loaded machine, so every
    # worker was killed while starting and the server never came up: allow 30 s.
    config = EdgeConfig(functools.partial(create_app, settings), settings.serve, factory=True,
                        workers=workers, timeout_worker_healthcheck=30, **options)
    Multiprocess(config, sockets=[config.bind_socket()]).run()
