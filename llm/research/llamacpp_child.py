"""llama.cpp (llama-cpp-python) in a child process, so that its crash is an error here.

A natively built llama-cpp-python (GGML_NATIVE, with AMX) segfaults on its first decode in
VMs that do not hand AMX state to guests; in-process that kills the interpreter or the
notebook kernel without a word. `call(fn, *args, model_path=...)` runs `fn(*args)` in a fresh
"spawn" child (no fork of JAX's threads) and returns its result (numpy arrays and all) through a
pipe; an exception in the child is raised here; a child that dies before replying raises
LlamaCppCrashed, naming the signal, the model file and the rebuild that fixes it.
"""
from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

INSTALL_HINT = "pip install 'ggmlx[compare]' (in a checkout: pip install -e '.[compare]')"
REBUILD_HINT = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON '
                '-DGGML_AMX_INT8=OFF" pip install --force-reinstall --no-cache-dir llama-cpp-python')


class LlamaCppMissing(ImportError):
    """llama-cpp-python is not installed (the optional extra `.[compare]`)."""

    def __init__(self) -> None:
        super().__init__(f"llama-cpp-python is not installed: {INSTALL_HINT}", name="llama_cpp")


class LlamaCppCrashed(RuntimeError):
    """The child running llama.cpp died before it replied (a signal, or an exit from native code)."""

    def __init__(self, model_path: str, exitcode: int) -> None:
        self.model_path = model_path
        self.exitcode = exitcode
        self.signal = signal.Signals(-exitcode) if exitcode < 0 else None
        if self.signal is None:
            super().__init__(f"llama.cpp's child process exited with code {exitcode} before replying "
                             f"(model {model_path})")
            return
        super().__init__(
            f"llama.cpp crashed with {self.signal.name} (signal {-exitcode}) in its child process "
            f"(model {model_path}). A llama-cpp-python built natively (GGML_NATIVE, with AMX) crashes "
            f"so on its first decode in VMs without AMX state; rebuild it for this machine's CPU: "
            f"{REBUILD_HINT}")


def llama_cpp_available() -> bool:
    """Whether llama-cpp-python is installed, without loading its native library here."""
    return importlib.util.find_spec("llama_cpp") is not None


def require_llama_cpp() -> None:
    if not llama_cpp_available():
        raise LlamaCppMissing()


def _child(conn: Connection, fn: Callable[..., Any], args: tuple) -> None:
    """The child's entry point: one call, its result or its exception sent back."""
    try:
        reply: tuple = ("ok", fn(*args))
    except BaseException as e:      # every failure goes back to the parent
        reply = ("error", e, traceback.format_exc())
    try:
        conn.send(reply)
    except Exception as e:          # an unpicklable result or exception: nothing was sent
        conn.send(("error", RuntimeError(f"llama.cpp's child could not send its reply back: {e!r}"),
                   traceback.format_exc()))
    conn.close()


def call(fn: Callable[..., T], *args: Any, model_path: str | os.PathLike) -> T:
    """fn(*args) in a spawned child process. fn must be importable by name (a module-level
    function) and args and result picklable. Raises what fn raised (the child's traceback as a
    note), or LlamaCppCrashed if the child dies before replying."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(sender, fn, args), name="llama.cpp", daemon=True)
    proc.start()
    sender.close()          # the child holds the only write end: its death ends recv() below
    log.debug("llama.cpp child %d runs %s for %s", proc.pid, fn.__qualname__, model_path)
    try:
        try:
            reply = receiver.recv()
        except EOFError:
            reply = None
        proc.join()
    finally:
        receiver.close()
        if proc.is_alive():     # interrupted here (Ctrl-C): do not leave llama.cpp running
            proc.kill()
            proc.join()
    if reply is None:
        assert proc.exitcode is not None
        raise LlamaCppCrashed(str(model_path), proc.exitcode)
    if reply[0] == "error":
        _, error, child_traceback = reply
        error.add_note(f"in llama.cpp's child process:\n{child_traceback}")
        raise error
    return reply[1]
