"""The one error tree of splitinfer.

Every error a user can cause derives from :class:`SplitInferError`. The CLI maps
each to a one-line message and exit code 2 (see :mod:`splitinfer.shared.cli`);
the HTTP servers map each to a status code in one place. Anything else that
escapes is a bug: the CLI says so in one line and exits 70 (its traceback with
``--debug``).
"""

from __future__ import annotations


class SplitInferError(Exception):
    """Root of every error caused by input: a bad model, file, flag or frame."""

    #: HTTP status the servers answer with for this kind of error.
    http_status: int = 400


class ModelError(SplitInferError):
    """The ONNX model cannot be read, fails the checker or cannot be analysed."""


class CutError(SplitInferError):
    """A requested cut is unknown or does not separate the graph."""


class PackageError(SplitInferError):
    """A split package is missing, malformed, or of an unsupported format version."""


class ConfigError(SplitInferError):
    """A configuration value or command-line option is invalid."""


class ProtocolError(SplitInferError):
    """A wire frame is malformed or does not match the manifest."""


class CodecError(SplitInferError):
    """A tensor payload cannot be encoded or decoded by its codec."""


class ModelNotFoundError(SplitInferError):
    """The requested model, version or cut is not served here."""

    http_status = 404


class OverloadError(SplitInferError):
    """The server cannot take the request now; the client may retry later."""

    http_status = 503


class AuthError(SplitInferError):
    """A request is not signed by a known, valid device credential."""

    http_status = 401


class ReplayCacheFullError(AuthError, OverloadError):
    """The replay cache is full of nonces still inside the window; retry later."""

    http_status = 503
