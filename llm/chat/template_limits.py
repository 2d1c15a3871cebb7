"""What a chat template render may spend (RenderLimits, Deadline) and the error it raises:
shared by llm.chat.templates and the sandbox (llm.chat.sandbox) without either importing the
other."""
from __future__ import annotations

import time
from dataclasses import dataclass


class ChatTemplateError(ValueError):
    """A template that fails, escapes the sandbox, runs too long or renders too much."""


@dataclass(frozen=True)
class RenderLimits:
    seconds: float = 1.5         # the deadline; with its checks' granularity, renders end within 2 s
    max_output_chars: int = 1 << 20
    max_product: int = 1 << 20      # longest string/list any one operation may build
    max_built_bytes: int = 128 << 20    # all strings, lists and integers built during one render
    max_int_bits: int = 1 << 16     # largest integer an arithmetic operation may build


class Deadline:
    """The end of one render's time; check() raises ChatTemplateError once it is past."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise ChatTemplateError(f"chat template took longer than {self.seconds:g} s to render")
