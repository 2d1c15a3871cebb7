"""Typed errors of the llm layer; each message names the file, key, tensor or argument at fault."""


class ModelLoadError(Exception):
    """A model file that cannot be loaded: unknown architecture, missing or mistyped key, bad tensor."""


class LoadCancelled(ModelLoadError):
    """Loading stopped because the progress callback returned False."""
