"""One module per architecture; importing this package registers every builder."""
from llm.models import gemma2, gemma3, llama, phi3, qwen2, qwen3  # noqa: F401
