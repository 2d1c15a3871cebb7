"""Serving: the continuous-batching engine loop (batcher: Batcher, Engine) and the
OpenAI/Anthropic-compatible HTTP server over it (app: create_app; needs the `server` extra)."""
from llm.serving.batcher import (
    FINISH_EOG,
    FINISH_LENGTH,
    FINISH_STOP,
    MAX_TOP_LOGPROBS,
    Batcher,
    Delta,
    Done,
    Engine,
    EngineError,
    Failed,
    GenParams,
    Job,
    QueueFull,
    SlotBusy,
    SlotNotFound,
    TokenLogprob,
    logprobs_of,
)

__all__ = [
    "FINISH_EOG", "FINISH_LENGTH", "FINISH_STOP", "MAX_TOP_LOGPROBS", "Batcher", "Delta", "Done", "Engine",
    "EngineError", "Failed", "GenParams", "Job", "QueueFull", "SlotBusy", "SlotNotFound", "TokenLogprob",
    "logprobs_of",
]
