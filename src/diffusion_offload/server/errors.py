"""OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

__all__ = ["APIError", "error_body", "error_response"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered with OpenAI's envelope.

    Args:
        status: the HTTP status.
        message: a human-readable sentence.
        param: the request field at fault, or None when the whole request is.
        code: a short machine-readable code (e.g. ``"invalid_value"``).
        type: the error type; default by status (``invalid_request_error``, ...).
        headers: extra response headers.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON envelope."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """The envelope as a response with this error's status and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, **kwargs: Any) -> JSONResponse:
    """Shortcut for ``APIError(status, message, **kwargs).response()``."""
    return APIError(status, message, **kwargs).response()
