"""One module per architecture; importing this package registers every builder."""
from llm.models import gemma3, llama  # noqa: F401
