"""Typed errors of the llm layer; each message names the file, key, tensor or argument at fault."""


class ModelLoadError(Exception):
    """A model file that cannot be loaded: unknown architecture, missing or mistyped key, bad tensor."""


class MetadataError(ModelLoadError):
    """A GGUF metadata key that is missing or holds a value of the wrong type; `path` and `key` name it."""

    def __init__(self, path: str, key: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.key = key


class LoadCancelled(ModelLoadError):
    """Loading stopped because the progress callback returned False."""


class SizeError(ValueError):
    """A context, batch or prompt size that the model or the memory cannot take; the message
    gives the estimate it was checked with."""


class UsageError(ValueError):
    """A mistake in how a command was called (a bad value for an option): the CLI exits 2."""


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot be used: bad syntax, unknown rule, invalid schema,
    over a size limit. Raised before any decoding."""


class StateError(Exception):
    """A saved state (file or bytes) that cannot be loaded into this context; the message
    names the file and what is wrong, and the context is left unchanged."""


class MediaError(ValueError):
    """An image or sound (or its reference) that cannot be used: unreadable or truncated data, an
    unknown format, too many pixels or samples, a remote URL, markers and media that do not pair
    up. The message names the part at fault; nothing was changed. (llm.mtmd.MediaError; here so
    that the decoders of llm.mtmd.bitmap and llm.mtmd.audio share it without importing each other.)"""
