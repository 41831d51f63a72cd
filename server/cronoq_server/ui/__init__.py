"""The web dashboard: static files (HTML, CSS, plain JS modules) committed in ./static and
served at /ui on the HTTP listener. The files need no credentials; every data call the page
makes to the API carries the token the page asks for."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).parent / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The page's own origin only: no inline script or style, no other origin, not framed.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def _load_assets() -> dict[str, tuple[bytes, str]]:
    """Every file of ./static with a known type, read once: the names served are exactly these."""
    return {
        path.name: (path.read_bytes(), CONTENT_TYPES[path.suffix])
        for path in sorted(STATIC.iterdir())
        if path.is_file() and path.suffix in CONTENT_TYPES
    }


def add_ui_routes(app: web.Application) -> None:
    """GET /ui (redirected to /ui/), /ui/ (index.html) and /ui/<file>."""
    assets = _load_assets()

    def asset_response(name: str) -> web.Response:
        body, content_type = assets[name]
        return web.Response(body=body, headers={"Content-Type": content_type, **SECURITY_HEADERS})

    async def redirect(request: web.Request) -> web.StreamResponse:
        raise web.HTTPMovedPermanently("/ui/")

    async def index(request: web.Request) -> web.StreamResponse:
        return asset_response("index.html")

    async def asset(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in assets:
            raise web.HTTPNotFound()
        return asset_response(name)

    app.router.add_get("/ui", redirect)
    app.router.add_get("/ui/", index)
    app.router.add_get("/ui/{name}", asset)
