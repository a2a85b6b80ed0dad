"""Error types. Each message names what was wrong and how to fix it."""

import math


class DitkvError(Exception):
    """Base class of every ditkv error. `field`: the request or config field the error is about
    (the HTTP server reports it as `param`), or None."""

    field: str | None = None

    def __init__(self, *args, field: str | None = None):
        super().__init__(*args)
        if field is not None:
            self.field = field

    def __reduce__(self):  # keep the subclass and its attributes across processes (pickle)
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls, args, state):
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(state)
    return e


class ConfigError(DitkvError, ValueError):
    """A configuration value or combination is invalid (raised at startup)."""

    def __init__(self, field: str, value, fix: str):
        self.value, self.fix = value, fix
        super().__init__(f"invalid {field}={value!r}: {fix}", field=field)


class LayoutError(DitkvError, ValueError):
    """A row layout (lengths, spans) is malformed."""


class AdmissionError(DitkvError):
    """A request can never be admitted (client-safe message, e.g. HTTP 400)."""


class UnavailableError(DitkvError):
    """No live replica can take the request now (HTTP 503, not the client's fault): a stage failed
    closed or its remote server was lost."""


class MetadataError(DitkvError):
    """A worker rejected a metadata snapshot (stale, conflicting, malformed); nothing was written."""


class BackendError(DitkvError):
    """An attention backend cannot run the requested operation (no silent fallback)."""


def is_finite_number(v) -> bool:
    """An int or float (not a bool) that is a finite float: a huge JSON or YAML int is not."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond the float range
        return False
