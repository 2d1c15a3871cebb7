"""Chat: GGUF chat templates rendered in a sandbox (templates) and tool calls (tool_calls)."""
from llm.chat.templates import BUILTIN_TEMPLATES, CHATML, GEMMA, ChatTemplateError, RenderLimits, render, template_for

__all__ = ["BUILTIN_TEMPLATES", "CHATML", "GEMMA", "ChatTemplateError", "RenderLimits", "render", "template_for"]
