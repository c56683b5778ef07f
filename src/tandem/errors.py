"""The one root exception and the AMQP error classes, with the code table in one place."""

from __future__ import annotations


class TandemError(Exception):
    """Root of every error Tandem raises on purpose."""


class AMQPError(TandemError):
    """An error with an AMQP reply code; subclasses say whether it closes a channel or the
    connection."""

    code: int = 0
    hard: bool = False

    def __init__(self, text: str, class_id: int = 0, method_id: int = 0) -> None:
        super().__init__(text)
        self.text = text
        self.class_id = class_id
        self.method_id = method_id

    def reply_text(self) -> str:
        return f"{REPLY_NAMES.get(self.code, 'ERROR')} - {self.text}"[:255]


class AMQPChannelError(AMQPError):
    """Soft error: the channel is closed with the code, the connection goes on."""


class AMQPConnectionError(AMQPError):
    """Hard error: the connection is closed with the code."""

    hard = True


REPLY_NAMES = {
    200: "OK",
    311: "CONTENT_TOO_LARGE",
    312: "NO_ROUTE",
    313: "NO_CONSUMERS",
    320: "CONNECTION_FORCED",
    402: "INVALID_PATH",
    403: "ACCESS_REFUSED",
    404: "NOT_FOUND",
    405: "RESOURCE_LOCKED",
    406: "PRECONDITION_FAILED",
    501: "FRAME_ERROR",
    502: "SYNTAX_ERROR",
    503: "COMMAND_INVALID",
    504: "CHANNEL_ERROR",
    505: "UNEXPECTED_FRAME",
    506: "RESOURCE_ERROR",
    530: "NOT_ALLOWED",
    540: "NOT_IMPLEMENTED",
    541: "INTERNAL_ERROR",
}

_SOFT = {311, 312, 313, 403, 404, 405, 406}


def _make(code: int) -> type[AMQPError]:
    base: type[AMQPError] = AMQPChannelError if code in _SOFT else AMQPConnectionError
    name = "".join(part.title() for part in REPLY_NAMES[code].split("_"))
    return type(name, (base,), {"code": code})


ERRORS: dict[int, type[AMQPError]] = {code: _make(code) for code in REPLY_NAMES if code >= 311}

# Names used by the code, so a reader sees which error is raised.
AccessRefused = ERRORS[403]
NotFound = ERRORS[404]
ResourceLocked = ERRORS[405]
PreconditionFailed = ERRORS[406]
ConnectionForced = ERRORS[320]
InvalidPath = ERRORS[402]
FrameError = ERRORS[501]
SyntaxError_ = ERRORS[502]
CommandInvalid = ERRORS[503]
ChannelError = ERRORS[504]
UnexpectedFrame = ERRORS[505]
ResourceError = ERRORS[506]
NotAllowed = ERRORS[530]
NotImplemented_ = ERRORS[540]
InternalError = ERRORS[541]


def connection_access_refused(text: str) -> AMQPConnectionError:
    """A 403 that closes the connection (a failed login, a vhost the user may not open)."""
    err = AMQPConnectionError(text)
    err.code = 403
    return err


class StoreError(TandemError):
    """The store could not read or write what it must."""


class ConfigError(TandemError):
    """The configuration is invalid; the message says where."""


class StartError(TandemError):
    """The node cannot start (a port in use, a data dir held by another node)."""


class DataDirGone(TandemError):
    """A running cluster's data directory was deleted under it."""
