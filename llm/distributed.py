"""Multi-host inference through JAX's own multi-controller runtime (`jax.distributed`).

Every process runs the same program on its own devices; together they form one mesh, and a
model loaded with split_mode="row" is divided over all of them (each process reads only the
shards its devices hold from the same GGUF path). Process 0 owns tokenization, sampling and
output: `LeaderContext` sends each state-changing call (decode, KV-cache sequence ops) to
the others before running it, and `follow` makes every other process run the same calls.
Commands travel as small int32 arrays through `multihost_utils.broadcast_one_to_all`, a
collective over the processes' devices (gloo on CPU). docs/distributed.md says how to launch.
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import jax
import numpy as np

from llm.batch import Batch
from llm.context import bucket

log = logging.getLogger(__name__)

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"

OP_DECODE, OP_SEQ_RM, OP_CLEAR, OP_STOP = 1, 2, 3, 4
_HEADER = 8     # int32 words: op, n_tokens (padded), n_real, has_pos, has_seq, has_logits, a, b


class DistributedError(RuntimeError):
    """A multi-process run could not start or lost a process; the message names which."""


@dataclass(frozen=True)
class ProcessInfo:
    process_id: int
    num_processes: int
    coordinator: str


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise DistributedError(f"environment variable {name}={v!r} is not an integer") from None


def _check_reachable(coordinator: str, timeout_s: float) -> None:
    """A process other than 0 first checks that the coordinator's port accepts connections,
    retrying until timeout_s, so an unreachable address is a clear error, not a long wait."""
    import time
    host, _, port = coordinator.rpartition(":")
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise DistributedError(f"coordinator {coordinator} is not reachable after {timeout_s:g} s: {last}")


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, timeout_s: int = 60, heartbeat_timeout_s: int = 10) -> ProcessInfo:
    """Join a multi-process run: afterwards jax.devices() lists every process's devices.

    Arguments not given come from JAX's environment variables JAX_COORDINATOR_ADDRESS
    ("host:port", served by process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID. On CPU the
    collectives go through gloo. An unreachable coordinator or processes that disagree on
    the process count fail with DistributedError within timeout_s; a process that dies
    later is noticed within heartbeat_timeout_s by the others. Must run before any other
    use of JAX (as jax.distributed.initialize)."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if not coordinator or num_processes is None or process_id is None:
        raise DistributedError("distributed.initialize needs coordinator, num_processes and process_id "
                               f"(arguments or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DistributedError(f"coordinator must be 'host:port', got {coordinator!r}")
    if num_processes < 1:
        raise DistributedError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"process_id must be in [0, {num_processes}), got {process_id}")
    import ggmlx
    ggmlx.init()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if process_id != 0:
        _check_reachable(coordinator, timeout_s)
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s)
    except Exception as e:  # JAX raises XlaRuntimeError / RuntimeError with the service's status
        raise DistributedError(f"process {process_id} of {num_processes} could not join the run at "
                               f"{coordinator} within {timeout_s} s (do all processes give the same "
                               f"num_processes, and is every process started?): {e}") from e
    _handshake(process_id, num_processes, timeout_s)
    info = ProcessInfo(process_id, num_processes, coordinator)
    log.info("process %d of %d joined %s: %d local, %d global devices", process_id, num_processes,
             coordinator, jax.local_device_count(), jax.device_count())
    return info


def _handshake(process_id: int, num_processes: int, timeout_s: int) -> None:
    """Every process publishes the process count it was given in the coordination service's
    key-value store and reads everyone else's, so a mismatch is an error naming the process
    on every side at once (a collective would wait for a gloo timeout instead)."""
    from ggmlx._jax_private import coordination_client
    client = coordination_client()
    if client is None:
        raise DistributedError(f"process {process_id}: jax.distributed has no coordination client")
    client.key_value_set(f"ggmlx/num_processes/{process_id}", str(num_processes))
    for j in range(jax.process_count()):
        try:
            theirs = int(client.blocking_key_value_get(f"ggmlx/num_processes/{j}", timeout_s * 1000))
        except Exception as e:
            raise DistributedError(f"process {process_id}: process {j} did not report within {timeout_s} s: {e}") from e
        if theirs != num_processes:
            raise DistributedError(f"process {process_id} was started with num_processes={num_processes}, "
                                   f"process {j} with num_processes={theirs}")
    if jax.process_count() != num_processes:
        raise DistributedError(f"process {process_id}: the run has {jax.process_count()} processes, "
                               f"this one was told {num_processes}")


def is_leader() -> bool:
    return jax.process_index() == 0


# ---- the command channel -----------------------------------------------------------------------

def _broadcast(x: np.ndarray, what: str) -> np.ndarray:
    """x from process 0 to every process (a collective: every process must call it with the
    same shape). A lost process turns the collective into an error naming it."""
    from jax.experimental import multihost_utils
    try:
        return np.asarray(multihost_utils.broadcast_one_to_all(x))
    except Exception as e:
        raise DistributedError(f"process {jax.process_index()}: lost contact with the other processes while "
                               f"receiving {what} from process 0: {e}") from e


def _send(op: int, batch: Batch | None = None, a: int = 0, b: int = 0) -> None:
    header = np.zeros(_HEADER, np.int32)
    header[0], header[6], header[7] = op, a, b
    if batch is not None:
        if batch.token is None:
            raise ValueError("a multi-process run decodes token batches only (no embeddings input)")
        n = batch.n_tokens
        header[1:6] = [bucket(n), n, batch.pos is not None, batch.seq_id is not None, batch.logits is not None]
    _broadcast(header, "a command")
    if batch is not None:
        _broadcast(_payload(batch, int(header[1])), "a batch")


def _payload(batch: Batch, n_pad: int) -> np.ndarray:
    """tokens, positions, sequence ids and output flags of a batch as int32 [n_pad, 4]."""
    n = batch.n_tokens
    p = np.zeros((n_pad, 4), np.int32)
    assert batch.token is not None   # _send checked it
    p[:n, 0] = batch.token
    if batch.pos is not None:
        p[:n, 1] = batch.pos
    if batch.seq_id is not None:
        if any(len(ids) != 1 for ids in batch.seq_id):
            raise ValueError("a multi-process run sends one sequence id per token")
        p[:n, 2] = [ids[0] for ids in batch.seq_id]
    if batch.logits is not None:
        p[:n, 3] = batch.logits
    return p


def _receive() -> tuple[int, Batch | None, int, int]:
    header = _broadcast(np.zeros(_HEADER, np.int32), "a command")
    op, n_pad, n, has_pos, has_seq, has_logits, a, b = (int(v) for v in header)
    batch = None
    if op == OP_DECODE:
        p = _broadcast(np.zeros((n_pad, 4), np.int32), "a batch")[:n]
        batch = Batch(p[:, 0], pos=p[:, 1] if has_pos else None, seq_id=p[:, 2].tolist() if has_seq else None,
                      logits=p[:, 3].astype(bool) if has_logits else None)
    return op, batch, a, b


class _LeaderMemory:
    """The KV cache of a LeaderContext: sequence removal is sent to the followers first."""

    def __init__(self, ctx):
        self._ctx = ctx

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        _send(OP_SEQ_RM, None, seq_id, p0)
        _broadcast(np.asarray([p1], np.int32), "a command argument")
        return self._ctx.memory.seq_rm(seq_id, p0, p1)

    def __getattr__(self, name):
        return getattr(self._ctx.memory, name)


class LeaderContext:
    """A Context on process 0 of a multi-process run: decode and the KV-cache ops it changes
    are sent to every other process (running `follow`) before they run here; everything else
    (logits, perf, sizes) is read from the wrapped context."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.memory = _LeaderMemory(ctx)

    def decode(self, batch: Batch) -> int:
        _send(OP_DECODE, batch)
        return self.ctx.decode(batch)

    def memory_clear(self) -> None:
        _send(OP_CLEAR)
        self.ctx.memory_clear()

    def stop_followers(self) -> None:
        _send(OP_STOP)

    def __getattr__(self, name):
        return getattr(self.ctx, name)


def follow(ctx) -> int:
    """Run process 0's commands on this process's context until it says stop; returns the
    number of batches decoded. A decode that fails here fails there too (same program)."""
    n = 0
    while True:
        op, batch, a, b = _receive()
        if op == OP_STOP:
            return n
        if op == OP_DECODE:
            ret = ctx.decode(batch)
            if ret != 0:
                log.warning("process %d: decode returned %d: %s", jax.process_index(), ret, ctx.last_error)
            n += 1
        elif op == OP_SEQ_RM:
            p1 = int(_broadcast(np.zeros(1, np.int32), "a command argument")[0])
            ctx.memory.seq_rm(a, b, p1)
        elif op == OP_CLEAR:
            ctx.memory_clear()
        else:
            raise DistributedError(f"process {jax.process_index()}: unknown command {op} from process 0")
