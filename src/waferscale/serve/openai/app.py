"""The FastAPI application: routes, the OpenAI error envelope for every failure, API-key check, rate-limit
headers, request metrics, and the playground page at `/`."""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from waferscale.serve.openai.metrics import Metrics
from waferscale.serve.openai.protocol import APIError
from waferscale.serve.openai.routes import RateLimiter, ServerState, router

__all__ = ["bearer_token", "create_app", "error_response", "install_error_handlers"]

PLAYGROUND = Path(__file__).resolve().parent.parent / "playground"
_STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
           "style.css": "text/css; charset=utf-8"}
_GENERATION = ("/v1/chat/completions", "/v1/completions")


def create_app(engine: Any, aengine: Any, tokenizer: Any, *, model_id: str, aliases: set[str] | None = None,
               api_key: str | None = None, projection: dict[str, Any] | None = None,
               rate_limits: RateLimiter | None = None) -> FastAPI:
    """An app serving `aengine` (an AsyncEngine over `engine`). The AsyncEngine starts and stops with the app.

    projection: the compiler's `plan_json` for `--target` (adds `wafer_projection` to answers), or None.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await aengine.start()
        try:
            yield
        finally:
            await aengine.stop()

    app = FastAPI(title="waferscale", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    state = ServerState(engine=engine, aengine=aengine, tokenizer=tokenizer, model_id=model_id,
                        aliases=set(aliases or ()), api_key=api_key, projection=projection,
                        limits=rate_limits or RateLimiter(), metrics=Metrics(aengine.stats))
    app.state.wsc = state
    app.include_router(router)

    app.add_middleware(_Guard, state=state)
    install_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        return FileResponse(PLAYGROUND / "index.html", media_type=_STATIC["index.html"])

    @app.get("/playground/{name}", include_in_schema=False)
    async def playground_file(name: str) -> Response:
        if name not in _STATIC:
            raise APIError(404, f"no playground file {name!r}", code="not_found")
        return FileResponse(PLAYGROUND / name, media_type=_STATIC[name])

    return app


class _Guard:
    """Every request passes here: the API-key check (401), the rate limit of generation requests (429), the
    in-flight gauge, the rate-limit headers on API answers and the request counts by status.

    A pure ASGI middleware, not Starlette's function-style one (`@app.middleware("http")`): that one hands the
    route a `receive` that never reports `http.disconnect`, so a non-streaming generation whose client gave up
    ran to its end. This one passes every message through untouched.
    """

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        s, path = self.state, scope["path"]
        api = path.startswith("/v1/") and path != "/v1/tcp_warming"
        if api and s.api_key is not None and not _authorized(Request(scope), s.api_key):
            await error_response(APIError(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer "
                                          "KEY'.", type="invalid_request_error", code="invalid_api_key"))(
                scope, receive, send)
            return
        generation = scope["method"] == "POST" and path in _GENERATION
        if generation and not s.limits.admit():
            s.metrics.request_done(path, 429)
            await error_response(APIError(429, "Rate limit reached: requests per day or tokens per minute.",
                                          type="rate_limit_error", code="rate_limit_exceeded"))(scope, receive, send)
            return
        status = 500  # what the server answers when the route raises and no response was started

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if api:
                    MutableHeaders(scope=message).update(s.limits.headers())
            await send(message)

        if generation:
            s.metrics.in_flight += 1
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            if generation:
                s.metrics.in_flight -= 1
                s.metrics.request_done(path, status)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure of `app` answers in the OpenAI error envelope: APIError as raised, a request that does not
    validate as 400, unknown routes and methods as 404/405, anything else as 500 (the server keeps serving)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        return error_response(APIError(400, f"invalid request: {err.get('msg')}", param=loc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(APIError(exc.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}",
                                       type="server_error"))


def bearer_token(request: Request) -> str:
    """The request's key: `Authorization: Bearer KEY`, else `x-api-key` (Cerebras' SDK), else ''."""
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")


def _authorized(request: Request, key: str) -> bool:
    return hmac.compare_digest(bearer_token(request).encode(), key.encode())


def error_response(exc: APIError) -> JSONResponse:
    headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
