"""Serving: the engine thread (engine: Engine) over the generation core's Batcher
(llm.generation.batcher) and the OpenAI-compatible HTTP server over it (app: create_app; routes,
requests, sse; needs the `server` extra). The core's names are exported here too, as before."""
from llm.generation.batcher import Batcher, Done, EngineError, Failed, Job, SlotBusy, SlotNotFound
from llm.generation.core import (
    FINISH_EOG,
    FINISH_LENGTH,
    FINISH_STOP,
    MAX_TOP_LOGPROBS,
    Delta,
    GenParams,
    TokenLogprob,
    logprobs_of,
)
from llm.serving.engine import Engine, QueueFull

__all__ = [
    "FINISH_EOG", "FINISH_LENGTH", "FINISH_STOP", "MAX_TOP_LOGPROBS", "Batcher", "Delta", "Done", "Engine",
    "EngineError", "Failed", "GenParams", "Job", "QueueFull", "SlotBusy", "SlotNotFound", "TokenLogprob",
    "logprobs_of",
]
