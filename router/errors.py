"""Errors the router itself produces, in the OpenAI error shape clients already parse:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}

Errors from an engine (a vLLM 400 for a too-long prompt, say) are passed through untouched.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from aiohttp import web

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


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
