"""Server-sent events: OpenAI's streaming framing, in one place.

Every object is one `data: {json}` event; a stream that ends normally ends with
`data: [DONE]`. An APIError raised while streaming (the status line is already sent) becomes
one `data: {"error": {...}}` event and ends the stream without [DONE], as llama-server does.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from llm.serving.requests import APIError

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def sse_response(objects: AsyncIterator[object], on_close: Callable[[], None]) -> StreamingResponse:
    """A text/event-stream of `objects`. `on_close` runs however the stream ends: finished,
    failed, or the client gone (Starlette then cancels or closes the stream), so the jobs
    behind it free their slots at once."""
    async def frames() -> AsyncIterator[str]:
        try:
            async for obj in objects:
                yield event(obj)
            yield DONE
        except APIError as e:
            yield event({"error": {"message": e.message, "type": e.type, "param": None, "code": None}})
        finally:
            on_close()

    return StreamingResponse(frames(), media_type="text/event-stream", headers=HEADERS)
