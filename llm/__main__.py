"""`python -m llm`: Ctrl-C during start-up (importing JAX) exits 130 with one line; after
that, llm.cli.commands handles it. The cyclic garbage collector is off while the imports run:
they create 265,000 objects that live as long as the process (JAX's, mostly) and no garbage
worth a collection; then they are frozen (never traversed again, at exit neither) and it is on.
With the model's objects frozen after loading (cli.commands._open), the collections of a
SmolLM2 `generate -n 32` took 16 ms instead of 170 ms, and the exit 90 ms instead of 250 ms.
A command that is done leaves without the interpreter's teardown (the streams and logging
flushed, every file a command writes closed by then): freeing JAX's client and the model's
modules only delayed the exit (Gemma3 `generate -n 32`, benchmarks/compare.py --cli: 2.10 ->
1.86 s with the vocabulary's faster load); a process of a jax.distributed run exits normally,
so that its coordination client says goodbye."""
import gc
import os
import signal
import sys


def _interrupted_at_start(signum, frame) -> None:
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)


signal.signal(signal.SIGINT, _interrupted_at_start)
gc.disable()

from llm.cli.commands import EXIT_INTERRUPTED, main  # noqa: E402  (after the handler, on purpose)

gc.freeze()
gc.enable()

rc = main()
from ggmlx._jax_private import coordination_client  # noqa: E402

if rc != EXIT_INTERRUPTED and coordination_client() is not None:
    sys.exit(rc)
import logging  # noqa: E402

logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(rc)
