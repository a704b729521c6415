"""OpenAI-style errors: every failure is `{"error": {"message", "type", "param", "code"}}`.

Status mapping (as vLLM's server does it; docs/architecture.md §6.3):

    invalid JSON, wrong types, out-of-range values, prompt too long   400 BadRequestError
    missing or wrong API key                                         401 AuthenticationError
    unknown model, unknown route                                     404 NotFoundError
    wrong HTTP method                                                405 MethodNotAllowed
    --max-num-queued-reqs / --max-num-queued-tokens reached, dead     503 Service Unavailable
    no engine core attached (it went away; we re-attach by ourselves) 503 + Retry-After
    --max-queue-delay: estimated wait too long                       503 + Retry-After
    a bug or an engine failure (never bad input)                     500 InternalServerError

`param` names the offending request field when there is one. A `ValueError` raised by
`SamplingParams` ("top_p must be in (0, 1], got 2") becomes a 400 whose param is its first word.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from .protocol import PROMPT_SHAPES

logger = logging.getLogger("tidal.serve")

RETRY_AFTER_S = 2
"""The Retry-After (seconds) of a 503 sent while no engine core is attached."""

QUEUE_FULL_MESSAGE = ("The engine is currently busy and cannot accept new requests. "
                      "Please try again later or on a different instance.")
TOKENS_FULL_MESSAGE = ("The engine has reached its prefill token backlog limit. "
                       "Please try again later or on a different instance.")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    415: "UnsupportedMediaType",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "Service Unavailable",
}


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _TYPES.get(status) or HTTPStatus(status).phrase
        self.headers = headers
        """Extra response headers (Retry-After on a 503 of --max-queue-delay)."""

    def body(self) -> dict:
        """The JSON body, `{"error": {...}}`."""
        return error_body(self.status, self.message, self.param, self.err_type)

    def response(self) -> Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def engine_unavailable(message: str) -> APIError:
    """503 with Retry-After: no engine core is attached now, one may be soon."""
    return APIError(503, message, headers={"Retry-After": str(RETRY_AFTER_S)})


def error_body(status: int, message: str, param: str | None = None,
               err_type: str | None = None) -> dict:
    """The OpenAI error body. A message or param quoting the client's input may hold a lone
    surrogate (JSON can escape one), which no JSON encoder writes: it is escaped here, so an
    error can always be answered."""
    err_type = err_type or _TYPES.get(status) or HTTPStatus(status).phrase
    return {"error": {"message": _encodable(message), "type": err_type,
                      "param": None if param is None else _encodable(param), "code": status}}


def _encodable(text: str) -> str:
    """`text` with any lone surrogate written as its escape ("\\ud800")."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_response(content, status: int = 200, headers: dict | None = None) -> Response:
    """A JSON response encoded with msgspec (fast; dicts, lists, pydantic-free)."""
    return Response(msgspec.json.encode(content), status_code=status, headers=headers,
                    media_type="application/json")


def from_value_error(exc: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """A ValueError naming a field ("top_p must be ...") to a 400 with that param.

    `renames` maps internal field names to the request's (e.g. logprobs -> top_logprobs).
    """
    message = str(exc) or exc.__class__.__name__
    first = message.split(" ", 1)[0].strip(":")
    param = first if first.isidentifier() and first.islower() else None
    if param and renames and param in renames:
        param = renames[param]
        message = param + message[len(first):]
    return APIError(400, message, param)


def _validation_param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages.0.role'; the body itself -> None."""
    parts = [str(p) for p in loc if p != "body"]
    if parts and parts[0].isdigit():  # json_invalid: the location is a character position
        return None
    # pydantic adds the union member it tried ("list[int]", "str", or the tag of a tagged
    # union such as the prompt's "tokens") to the location: drop it
    parts = [p for i, p in enumerate(parts) if not any(c in p for c in "[]")
             and p not in ("str", "int") and not (i and parts[i - 1] == "prompt"
                                                  and p in PROMPT_SHAPES)]
    return ".".join(parts) or None


def from_validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI / pydantic request validation failure to a 400 naming the first bad field."""
    # our own validators' messages (value_error) say most: put them first
    errors = sorted(exc.errors(), key=lambda err: err.get("type") != "value_error")
    if not errors:
        return APIError(400, "Invalid request body.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return APIError(400, f"Invalid JSON body: {detail}")
    if tuple(first.get("loc", ())) == ("body",):
        return APIError(400, f"The request body must be a JSON object: {first.get('msg')}")
    messages = []
    for err in errors[:5]:
        where = _validation_param(tuple(err.get("loc", ()))) or "body"
        text = str(err.get("msg"))  # our validators' own words, without pydantic's prefix
        messages.append(f"{where}: {text.removeprefix('Value error, ')}")
    return APIError(400, "; ".join(messages), _validation_param(tuple(first.get("loc", ()))))


def not_supported_route(request: Request) -> str:
    """The 404 of a route tidal does not have: it says so, and which ones it has (an OpenAI
    client calling /v1/audio/transcriptions or /v1/images/generations learns it is not
    supported, rather than reading a bare `Not Found`)."""
    paths = sorted({getattr(route, "path", "") for route in request.app.routes} - {""})
    shown = [p for p in paths if p.startswith("/v1/")] or paths
    return (f"{request.method} {request.url.path} is not supported by tidal (no such "
            f"endpoint); it serves {', '.join(shown)} (docs/serving.md)")


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception to the OpenAI error body (validation errors are 400, not 422)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 404 and message == "Not Found":  # no such route
            message = not_supported_route(request)
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, f"Internal server error: {type(exc).__name__}").response()
