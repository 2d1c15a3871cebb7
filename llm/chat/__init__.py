"""Chat: GGUF chat templates rendered in a sandbox (templates); a request's prompt, grammar and
reply syntax in the template's own format (prompt, formats, grammars); reading a reply back into
content, reasoning and tool calls (parsers); tools and the generic tool-call format (tool_calls)."""
from llm.chat.templates import BUILTIN_TEMPLATES, CHATML, GEMMA, ChatTemplateError, RenderLimits, render, template_for

__all__ = ["BUILTIN_TEMPLATES", "CHATML", "GEMMA", "ChatTemplateError", "RenderLimits", "render", "template_for"]
