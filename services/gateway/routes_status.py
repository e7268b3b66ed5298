"""The operator's view: `GET /status` (a page shipped in the package, no CDN) and its data,
`GET /status.json` (status_view.py). The gateway samples core's token counters every few
seconds while it runs, so the page's tok/s chart has the last minutes as soon as it opens."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from services.common.logging import get_logger
from services.common.version import moe_mesh_version
from services.gateway.core_client import CoreClient
from services.gateway.errors import OpenAIError
from services.gateway.served_model import served_model_name
from services.gateway.status_view import SAMPLE_EVERY_S, ThroughputHistory, status_json

log = get_logger(__name__)
router = APIRouter()
STATIC = Path(__file__).with_name("static")
ASSETS = {"status.css": "text/css", "status.js": "text/javascript"}


@router.get("/status", include_in_schema=False)
async def status_page() -> FileResponse:
    return FileResponse(STATIC / "status.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/static/{name}", include_in_schema=False)
async def status_asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise OpenAIError(404, f"no such file: {name}", code="not_found")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


async def _core_stats(core: CoreClient, request_id: str = ""):
    try:
        return await core.stats(request_id)
    except grpc.aio.AioRpcError as error:
        log.debug("core stats unavailable for the status page", grpc_code=error.code().name)
        return None


@router.get("/status.json", include_in_schema=False)
async def status_data(request: Request) -> JSONResponse:
    app = request.app
    core: CoreClient = app.state.core
    stats, health = await asyncio.gather(_core_stats(core, request.state.request_id), core.health())
    history: ThroughputHistory = app.state.throughput
    if stats is not None:
        history.add(stats)
    server = request.scope.get("server") or ("", 0)
    body = status_json(
        stats,
        health=health,
        model=await served_model_name(request) if stats is not None else (app.state.model_name_hint or ""),
        version=moe_mesh_version(),
        core_address=core.config.target,
        gateway_address=f"{server[0]}:{server[1]}",
        history=history,
    )
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


@contextlib.asynccontextmanager
async def throughput_sampler(app: FastAPI):
    """Samples core's counters into app.state.throughput every SAMPLE_EVERY_S while the app runs."""

    async def sample() -> None:
        while True:
            stats = await _core_stats(app.state.core)
            if stats is not None:
                app.state.throughput.add(stats)
            await asyncio.sleep(SAMPLE_EVERY_S)

    task = asyncio.create_task(sample())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
