"""The command line, `python -m llm`: one subcommand per llama.cpp tool (main, bench, ...)."""
from llm.cli.commands import EXIT_INTERRUPTED, main

__all__ = ["EXIT_INTERRUPTED", "main"]
