"""The one HTTP process: `create_app(settings)` wires compartments' routers onto FastAPI.

Compartments own their routes (`APIRouter`s in their own packages); this module only mounts
them and holds shared state (`settings`, `engine`, `metrics`) on `app.state`.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from codeplane import __version__
from codeplane.agent import routes as agent_routes
from codeplane.apply import routes as apply_routes
from codeplane.config import Settings
from codeplane.gateway import routes as gateway_routes
from codeplane.models.engine import Engine
from codeplane.search import routes as search_routes
from codeplane.core import errors, metrics
from codeplane.tab import routes as tab_routes


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    owns_engine = engine is None
    engine = engine or Engine(settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        settings.server_dir.mkdir(parents=True, exist_ok=True)
        yield
        if owns_engine:  # a shared engine (tests, embedding callers) outlives this app
            engine.close()

    app = FastAPI(title="codeplane", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = engine
    app.state.metrics = metrics.Metrics()
    errors.install(app)
    metrics.install(app, app.state.metrics)
    app.include_router(gateway_routes.router)  # /v1/chat/completions, completions, ...
    app.include_router(agent_routes.router)
    app.include_router(search_routes.router)
    app.include_router(tab_routes.router)
    app.include_router(apply_routes.router)

    @app.get("/healthz")
    def healthz(request: Request) -> dict:
        return {"status": "ok", "version": __version__,
                "models_loaded": request.app.state.engine.loaded()}

    return app


def serve(settings: Settings, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5)
