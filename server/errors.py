"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from fastapi.responses import JSONResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "BadRequestError"), "param": param,
                      "code": code if code is not None else status}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status, err.param, err.code), status_code=err.status)
