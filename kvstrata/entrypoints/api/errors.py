"""One exception type for every client-visible error, rendered as an OpenAI error body."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from kvstrata.entrypoints.api.openai_protocol import error_body

# SamplingParams names fields the SGLang way; clients sent the OpenAI names.
_OPENAI_PARAM = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < 500 else "internal_error")
        self.code = code if code is not None else status

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, type_=self.type, param=self.param,
                                       code=self.code), status_code=self.status)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def from_sampling_error(e: ValueError, openai_names: bool = True,
                        overrides: dict[str, str] | None = None) -> ApiError:
    """SamplingParams raises ValueError("<field> must be ..."): name that field."""
    message = str(e)
    field = message.split(" ", 1)[0]
    if message.startswith("unsupported sampling parameter"):
        return bad_request(message, "sampling_params")
    param = field
    if openai_names:
        param = (overrides or {}).get(field) or _OPENAI_PARAM.get(field, field)
    return bad_request(message.replace(field, param, 1) if param != field else message, param)


class ClientDisconnected(Exception):
    """The client closed the connection before a non-streaming response was ready. The app
    logs one line for it (not a CancelledError traceback) and counts it in /metrics."""
