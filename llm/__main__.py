"""`python -m llm`: Ctrl-C during start-up (importing JAX) exits 130 with one line; after
that, llm.cli.commands handles it."""
import os
import signal
import sys


def _interrupted_at_start(signum, frame) -> None:
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)


signal.signal(signal.SIGINT, _interrupted_at_start)

from llm.cli.commands import EXIT_INTERRUPTED, main  # noqa: E402  (after the handler, on purpose)

rc = main()
if rc == EXIT_INTERRUPTED:      # skip interpreter teardown: nothing is left to save
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
sys.exit(rc)
