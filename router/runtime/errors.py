"""Errors the router itself produces, in the OpenAI error shape clients already parse:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}

Errors from an engine (a vLLM 400 for a too-long prompt, say) are passed through untouched.

Messages never grow with client input (`clip` bounds whatever they quote) and never name an internal host,
port or an engine's header bytes: those go to the log.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
# The `Server` header of every response, the router's own and proxied ones: no software versions.
SERVER_NAME = "fleetroute"
MAX_QUOTED = 128  # characters of client input an error message or an access-log field quotes


def clip(value: str, limit: int = MAX_QUOTED) -> str:
    """Client input as an error message or a log line may quote it: at most `limit` characters."""
    return value if len(value) <= limit else value[:limit] + "…"


def error_response(
    status: int,
    message: str,
    *,
    code: str,
    type_: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": type_ or (INVALID_REQUEST if status < 500 else SERVER_ERROR),
            "param": param,
            "code": code,
        }
    }
    return web.Response(
        status=status, body=orjson.dumps(body), content_type="application/json", headers=headers
    )
