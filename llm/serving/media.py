"""Images in chat requests: the image_url parts of /v1/chat/completions read into bitmaps and the
prompt's mtmd chunks (llama-server's handle_media, oaicompat_content_load_media and
process_mtmd_prompt), every problem a 400 naming the part (`messages[i].content[j]`).

A part's URL is a data URL (`data:image/png;base64,...`). An http(s) URL is fetched only when
the server runs with --allow-remote-media, with llama-server's limits (10 MiB, 10 s); without
it the part is refused. Loading runs off the event loop and touches no Context: the engine
thread decodes the chunks (llm.generation.batcher's media jobs).
"""
from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

from llm.generation.batcher import media_prompt
from llm.mtmd import Bitmap, InputChunk, MediaError
from llm.serving.requests import APIError, MediaPart, bad

if TYPE_CHECKING:
    from llm.api import LLM

REMOTE_MAX_BYTES = 10 << 20     # llama-server's common_remote_params for images
REMOTE_TIMEOUT_S = 10.0


def fetch(url: str, where: str, *, max_bytes: int = REMOTE_MAX_BYTES, timeout: float = REMOTE_TIMEOUT_S) -> bytes:
    """The body of an http(s) URL: at most max_bytes, all of it within timeout seconds."""
    deadline = time.monotonic() + timeout
    req = urllib.request.Request(url, headers={"User-Agent": "ggmlx-llm-server"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:      # http(s) only: load_images checked
            size = r.headers.get("Content-Length", "")
            if size.isdigit() and int(size) > max_bytes:
                raise bad(where, f"{where}: the image at {url[:64]} has {size} bytes, over the limit of {max_bytes}")
            parts, n = [], 0
            while chunk := r.read(min(1 << 16, max_bytes + 1 - n)):
                parts.append(chunk)
                n += len(chunk)
                if n > max_bytes:
                    raise bad(where, f"{where}: the image at {url[:64]} is over the limit of {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise bad(where, f"{where}: fetching {url[:64]} took more than {timeout:g} s")
    except urllib.error.HTTPError as e:
        raise bad(where, f"{where}: fetching {url[:64]} failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise bad(where, f"{where}: fetching {url[:64]} failed: {getattr(e, 'reason', e)}") from None
    return b"".join(parts)


def load_images(parts: list[MediaPart], allow_remote: bool) -> list[Bitmap]:
    """The parts' images, decoded (blocking: call it off the event loop)."""
    out = []
    for p in parts:
        try:
            if p.url.startswith(("http://", "https://")):
                if not allow_remote:
                    raise bad(p.where, f"{p.where}: remote image URLs are not fetched ({p.url[:64]}); send the image "
                                       "as a data URL, or start the server with --allow-remote-media")
                out.append(Bitmap.from_bytes(fetch(p.url, p.where), p.where))
            else:
                out.append(Bitmap.from_url(p.url, p.where))
        except MediaError as e:
            raise bad(p.where, str(e)) from None
    return out


def media_job(llm: LLM, prompt: str, parts: list[MediaPart], bitmaps: list[Bitmap],
              n_ctx_slot: int) -> tuple[list[int], dict[int, InputChunk]]:
    """A Job's tokens and media for the rendered chat prompt (one marker per part). A prompt
    that does not fit a slot names the first image that reaches past it."""
    assert llm.mtmd is not None      # the route checked
    try:
        chunks = llm.media_prompt(prompt, bitmaps)
    except MediaError as e:
        raise bad("messages", f"the messages' images cannot be used: {e}") from None
    tokens, media = media_prompt(chunks)
    if len(tokens) >= n_ctx_slot:
        # a bitmap becomes len(preprocess) image chunks, in order: find the one that does not fit
        owner = [k for k, bm in enumerate(bitmaps) for _ in llm.mtmd.preprocess(bm)]
        for (start, chunk), k in zip(sorted(media.items()), owner, strict=True):
            if start + chunk.n_pos >= n_ctx_slot:
                raise APIError(400, f"{parts[k].where}: the prompt reaches position {start + chunk.n_pos} with this "
                                    f"image ({len(tokens)} in all); a slot holds {n_ctx_slot}",
                               param=parts[k].where, code="context_length_exceeded")
        raise APIError(400, f"the prompt has {len(tokens)} positions (text and images); a slot holds {n_ctx_slot}",
                       param="messages", code="context_length_exceeded")
    return tokens, media
