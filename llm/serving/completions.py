"""One HTTP request's jobs on the Engine, and OpenAI's completion objects made from their events.

`Run` submits the jobs (one per prompt) and merges their events, which arrive from the engine
thread, into one asyncio queue. `Choices` folds those events into the choices' texts,
logprobs, finish reasons and usage, and writes them as chat.completion(.chunk) or
text_completion objects. A chat choice's text is read by its format's parser
(llm.chat.parsers.ChatStream): content, reasoning_content and tool_calls, as deltas when
streamed. `collect` answers a request at once, `chunks` streams it.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from fastapi import Request

from llm.chat.formats import ChatSyntax
from llm.chat.parsers import ChatStream, MsgDelta
from llm.errors import GrammarError
from llm.generation.batcher import Done, Failed, Job
from llm.generation.core import FINISH_EOG, Delta, GenParams, TokenLogprob
from llm.params import ParamError
from llm.serving.engine import Engine, QueueFull
from llm.serving.requests import APIError

if TYPE_CHECKING:
    from llm.mtmd import InputChunk

log = logging.getLogger(__name__)

Event = tuple[int, object]      # (index of the prompt, the job's event)


POLL_S = 0.5    # how often a non-streaming request checks that its client is still connected


class Run:
    """The jobs of one HTTP request (one per prompt), their events merged into one queue."""

    def __init__(self, engine: Engine, prompts: list[list[int]], params: GenParams, cache_prompt: bool = False, *,
                 prompt_field: str = "prompt", media: dict[int, InputChunk] | None = None):
        """`media`: the images of a single prompt (llm.generation.batcher.media_prompt)."""
        if media and len(prompts) != 1:
            raise ValueError(f"images go with one prompt, not {len(prompts)}")
        self.engine = engine
        self.prompt_field = prompt_field    # the request field the prompt came from ("messages" for chat)
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.jobs = [Job(toks, params, self._sink(k), cache_prompt=cache_prompt, media=media)
                     for k, toks in enumerate(prompts)]
        self.n = params.n
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_polled = time.monotonic()     # when next() last asked whether the client is still there

    def _sink(self, k: int):
        def put(ev) -> None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (k, ev))
        return put

    def submit(self) -> None:
        try:
            for job in self.jobs:
                self.engine.submit(job)
        except QueueFull as e:
            self.cancel()
            raise APIError(503, f"server busy: {e}", type="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except GrammarError as e:       # checked when the job is admitted: its first mask
            self.cancel()
            what = self.jobs[0].params.constraint
            kind = what.what if what is not None else ""
            param = kind if kind in ("grammar", "tools") else "response_format"
            raise APIError(400, f"'{param}' cannot be used: {e}", param=param) from None
        except ParamError as e:        # the batcher's check names the field
            self.cancel()
            param = self.prompt_field if e.name == "prompt" else e.name
            raise APIError(400, str(e), param=param) from None
        except ValueError as e:        # any other refusal of the job's settings
            self.cancel()
            raise APIError(400, str(e)) from None

    def cancel(self) -> None:
        for job in self.jobs:
            if not job.finished:
                self.engine.cancel(job)

    async def start(self, request: Request) -> list[Event]:
        """Submit the jobs and wait for the first event, so failures before the first token
        still get a proper status; returns that event."""
        self.submit()
        first = await self.next(request)
        if isinstance(first[1], Failed):
            self.cancel()
            raise APIError(500, f"generation failed: {first[1].message}", type="server_error")
        return [first]

    async def next(self, request: Request, poll: bool = True) -> Event:
        """The next event. With poll, check at least every POLL_S seconds whether the client
        went away (then cancel), on a clock: tokens arriving faster than that must not hide a
        hang-up. A streaming response must not poll (Starlette's own disconnect listener reads
        the same channel, and it closes the stream on a disconnect, which cancels the jobs)."""
        while True:
            if poll and time.monotonic() - self.t_polled >= POLL_S:
                self.t_polled = time.monotonic()
                if await request.is_disconnected():
                    self.cancel()
                    raise asyncio.CancelledError("client disconnected")
            try:
                k, ev = await (asyncio.wait_for(self.events.get(), POLL_S) if poll else self.events.get())
            except TimeoutError:
                continue
            if isinstance(ev, Delta) and self.t_first is None:
                self.t_first = time.perf_counter()
            return k, ev


def llama_timings(n_prompt: int, n_gen: int, t: dict) -> dict:
    """llama-server's `timings` object of a job's Done timings (with its draft counts when the
    job drafted)."""
    prompt_ms, gen_ms = 1000 * t.get("prompt_s", 0.0), 1000 * t.get("gen_s", 0.0)
    out = {"prompt_n": n_prompt, "prompt_ms": prompt_ms, "prompt_per_second": t.get("prompt_tok_s", 0.0),
           "predicted_n": n_gen, "predicted_ms": gen_ms, "predicted_per_second": t.get("gen_tok_s", 0.0)}
    if "spec_drafted" in t:
        out.update(draft_n=t["spec_drafted"], draft_n_accepted=t["spec_accepted"])
    return out


def finish_reason(reason: str) -> str:
    """OpenAI's name for a batcher finish reason (end-of-generation is "stop")."""
    return "stop" if reason == FINISH_EOG else reason


def piece(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def chat_logprobs(lps: Sequence[TokenLogprob], vocab) -> list[dict]:
    out = []
    for lp in lps:
        tops = [{"token": piece(vocab.token_to_piece(t)), "logprob": v, "bytes": list(vocab.token_to_piece(t))}
                for t, v in lp.top]
        out.append({"token": piece(lp.piece), "logprob": lp.logprob, "bytes": list(lp.piece), "top_logprobs": tops})
    return out


def text_logprobs(lps: Sequence[TokenLogprob], vocab, offset0: int) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    off = offset0
    for lp in lps:
        s = piece(lp.piece)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({piece(vocab.token_to_piece(t)): v for t, v in lp.top})
        out["text_offset"].append(off)
        off += len(s)
    return out


def _delta_obj(d: MsgDelta) -> dict:
    """A chat.completion.chunk delta: new content, reasoning_content and tool-call fragments."""
    out: dict = {}
    if d.reasoning_content:
        out["reasoning_content"] = d.reasoning_content
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        out["tool_calls"] = [c.to_openai() for c in d.tool_calls]
    return out


def log_done(path: str, run: Run, n_prompt: int, n_gen: int, reasons: Sequence[str | None]) -> None:
    t = time.perf_counter() - run.t0
    ttft = (run.t_first - run.t0) if run.t_first else t
    log.info("%s: %d prompt + %d generated tokens in %.2f s (first token %.2f s, %.1f tok/s), finish %s",
             path, n_prompt, n_gen, t, ttft, n_gen / max(t - ttft, 1e-9) if n_gen > 1 else 0.0,
             ",".join(map(str, reasons)))


class Choices:
    """The choices of one request (`params.n` per prompt) as their events arrive, and the
    OpenAI objects made from them: chat.completion(.chunk) when given the chat reply's
    `syntax`, else text_completion."""

    def __init__(self, n_prompts: int, params: GenParams, *, syntax: ChatSyntax | None, stream: bool, vocab,
                 model_name: str):
        chat = syntax is not None
        self.params, self.chat, self.stream, self.vocab = params, chat, stream, vocab
        self.n_choices = n_prompts * params.n
        self.replies = [ChatStream(syntax) for _ in range(self.n_choices)] if syntax is not None else []
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model_name}
        self.texts = [""] * self.n_choices
        self.lps: list[list[TokenLogprob]] = [[] for _ in range(self.n_choices)]
        self.reasons: list[str | None] = [None] * self.n_choices
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}
        self.timings: dict | None = None     # llama-server's, of the first prompt's job
        self.n_left = n_prompts         # jobs not yet Done

    def apply(self, k: int, ev) -> dict | None:
        """Fold in one event of prompt k's job; returns a stream chunk (or None)."""
        if isinstance(ev, Failed):
            raise APIError(500, f"generation failed: {ev.message}", type="server_error")
        if isinstance(ev, Done):
            self.usage["prompt_tokens"] += ev.n_prompt_tokens
            self.usage["completion_tokens"] += ev.n_completion_tokens
            if self.timings is None:
                self.timings = llama_timings(ev.n_prompt_tokens, ev.n_completion_tokens, ev.timings)
            self.n_left -= 1
            return None
        i = k * self.params.n + ev.index
        offset = len(self.texts[i])
        self.texts[i] += ev.text
        self.lps[i] += ev.logprobs
        delta = self._read(i, ev.text, ev.finish_reason is not None)
        if ev.finish_reason is not None:
            self.reasons[i] = finish_reason(ev.finish_reason)
            msg = self.replies[i].message if self.chat else None
            if msg is not None and msg.tool_calls:
                self.reasons[i] = "tool_calls"
        if not self.stream or (not ev.text and not ev.logprobs and ev.finish_reason is None):
            return None
        return {**self.base, "choices": [self._choice(i, ev.text, ev.logprobs, offset, final=False, delta=delta)]}

    def _read(self, i: int, text: str, last: bool) -> MsgDelta:
        """Chat: choice i's new text through its reply's parser (the delta to stream)."""
        if not self.chat:
            return MsgDelta()
        reply = self.replies[i]
        if last:
            reply.add(text)
            return reply.finish()
        if not self.stream:
            reply.add(text)
            return MsgDelta()
        return reply.feed(text) if text else MsgDelta()

    def _choice(self, i: int, text: str, lps: list[TokenLogprob], offset: int, *, final: bool,
                delta: MsgDelta | None = None) -> dict:
        """Choice i: the whole of it (`final`) or one chunk's delta."""
        if self.chat:
            content: dict = {"message": self._message(i)} if final else {"delta": _delta_obj(delta or MsgDelta())}
            logprobs = {"content": chat_logprobs(lps, self.vocab)} if self.params.logprobs else None
        else:
            content = {"text": text}
            logprobs = text_logprobs(lps, self.vocab, offset) if self.params.logprobs else None
        return {"index": i, **content, "logprobs": logprobs, "finish_reason": self.reasons[i]}

    def _message(self, i: int) -> dict:
        """Choice i's chat.completion message: content (null when the reply is only calls),
        reasoning_content and tool_calls when there are any."""
        msg = self.replies[i].message
        assert msg is not None
        out: dict = {"role": "assistant", "content": msg.content if msg.content or not msg.tool_calls else None}
        if msg.reasoning_content:
            out["reasoning_content"] = msg.reasoning_content
        if msg.tool_calls:
            out["tool_calls"] = [c.to_openai() for c in msg.tool_calls]
        return out

    def usage_obj(self) -> dict:
        return {**self.usage, "total_tokens": self.usage["prompt_tokens"] + self.usage["completion_tokens"]}

    def response(self) -> dict:
        """The whole (non-streamed) completion."""
        choices = [self._choice(i, self.texts[i], self.lps[i], 0, final=True) for i in range(self.n_choices)]
        return {**self.base, "object": "chat.completion" if self.chat else "text_completion",
                "choices": choices, "usage": self.usage_obj(), "timings": self.timings}

    def role_chunks(self) -> list[dict]:
        """Chat streams open each choice with an empty assistant delta."""
        return [{**self.base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]}
                for i in range(self.n_choices)]

    def usage_chunk(self) -> dict:
        return {**self.base, "choices": [], "usage": self.usage_obj()}

    def log_done(self, path: str, run: Run) -> None:
        log_done(path, run, self.usage["prompt_tokens"], self.usage["completion_tokens"], self.reasons)


async def collect(request: Request, run: Run, choices: Choices, pending: list[Event]) -> dict:
    """Wait for every job to finish; the whole completion. Any failure or cancel (the client
    went away) cancels the jobs still running."""
    try:
        for k, ev in pending:
            choices.apply(k, ev)
        while choices.n_left:
            choices.apply(*await run.next(request))
    except BaseException:
        run.cancel()
        raise
    choices.log_done(request.url.path, run)
    return choices.response()


async def chunks(request: Request, run: Run, choices: Choices, pending: list[Event],
                 include_usage: bool) -> AsyncIterator[dict]:
    """The chunks of a streamed completion, for llm.serving.sse; the caller cancels `run`
    when the stream closes. A failed job raises APIError (an error event)."""
    if choices.chat:
        for role in choices.role_chunks():
            yield role
    queue = list(pending)
    while choices.n_left:
        k, ev = queue.pop(0) if queue else await run.next(request, poll=False)
        chunk = choices.apply(k, ev)
        if chunk is not None:
            yield chunk
    if include_usage:
        yield choices.usage_chunk()
    choices.log_done(request.url.path, run)
