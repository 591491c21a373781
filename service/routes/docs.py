"""``/docs``: the interactive API documentation, served from this server alone.

FastAPI's default page loads Swagger UI's script and stylesheet from a CDN, so it is
blank on a host without Internet access. The assets come from the ``swagger-ui-bundle``
package instead, mounted under ``/docs/assets``; like ``/health`` the pages need no API key.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from starlette.responses import HTMLResponse
from starlette.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/assets"


def install(app: FastAPI) -> None:
    """Serve ``/docs`` (and its OAuth2 redirect page) with local assets; the app must be built
    with ``docs_url=None, redoc_url=None`` (ReDoc, also CDN-only, is left out)."""
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url, title=f"{app.title} — API",
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
