"""The high-level Python API: `llm.LLM` opens a model by path or known name and generates,
streams and chats, on top of Context, the vocab and the sampler chain."""
from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import jax
import numpy as np

import ggmlx
from ggmlx import compile as compile_mod
from ggmlx.compile import get_default_cache
from llm import cvec, distributed, hub
from llm import mtmd as mtmd_mod
from llm import params as params_mod
from llm.adapter import LoraAdapter, adapter_lora_init
from llm.batch import Batch
from llm.chat import parsers as parsers_mod
from llm.chat import prompt as prompt_mod
from llm.chat import templates as chat_mod
from llm.chat import tool_calls as tools_mod
from llm.chat.formats import ChatSyntax, ReasoningFormat
from llm.context import Context, ContextParams, DecodeStatus, bucket
from llm.generation import core
from llm.generation.batcher import Batcher, Done, Event, Job, media_prompt
from llm.generation.core import FINISH_EOG, FINISH_LENGTH, FINISH_STOP, Delta, GenParams, TokenLogprob, logprobs_of  # noqa: F401
from llm.generation.speculative import DraftModel, PromptLookup, draft_lengths, max_draft
from llm.hparams import PoolingType
from llm.model import Model, RowPlan, load_model
from llm.params import with_parameters
from llm.prompt_cache import PromptCache
from llm.research import trace as trace_mod
from llm.sampling import structured as grammar_mod
from llm.sampling.samplers import SamplingParams

FINISH_TOOL_CALLS = "tool_calls"

logger = logging.getLogger(__name__)


class GenerationError(RuntimeError):
    """decode failed during generation (the message carries the context's error)."""


class EmbedAborted(GenerationError):
    """LLM.embed was stopped by its abort_callback."""


class LLMBusyError(RuntimeError):
    """A generation or reset on an LLM while another generation on it is live (an unfinished
    stream, or a call in another thread): one LLM holds one conversation in its cache."""


@dataclass
class Completion:
    text: str
    tokens: list[int]
    n_prompt_tokens: int
    n_completion_tokens: int
    finish_reason: str
    timings: dict = field(default_factory=dict)
    tool_calls: list[dict] | None = None    # OpenAI-shaped calls parsed from a chat reply with tools
    logprobs: list[TokenLogprob] | None = None    # per generated token, when asked for
    reasoning_content: str | None = None    # a chat reply's reasoning, apart from its text (the content)


class _Collect:
    """Gathers the events of one batched job with n samples."""

    def __init__(self, n: int):
        self.text = [""] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.done: Done | None = None
        self.failed: str | None = None

    def __call__(self, ev: Event) -> None:
        if isinstance(ev, Delta):
            self.text[ev.index] += ev.text
            self.tokens[ev.index] += ev.tokens
            self.logprobs[ev.index] += ev.logprobs
            self.finish[ev.index] = ev.finish_reason
        elif isinstance(ev, Done):
            self.done = ev
        else:
            self.failed = ev.message


@dataclass
class GenerationChunk:
    """One step of `LLM.stream`: the text that became safe to show (may be empty, held back
    for a stop string or an unfinished UTF-8 character) and the token sampled. The last chunk
    has no token, the finish reason, and the whole Completion (with timings)."""

    text: str
    token: int | None
    finish_reason: str | None = None
    completion: Completion | None = None
    reasoning_content: str = ""     # chat_stream: new reasoning text (`text` is then new content)


class LLM:
    """A loaded model with one context. Known names: see `llm.hub.KNOWN_MODELS`."""

    @with_parameters(ContextParams)
    def __init__(self, model: str | os.PathLike = hub.DEFAULT_MODEL, *, n_gpu_layers: int = -1, devices=None,
                 split_mode: str = "layer", tensor_split: list[float] | None = None,
                 row_plan: RowPlan | None = None, weight_format: str = "auto", numerics: str = "exact",
                 progress_callback: Callable[[float], bool] | None = None,
                 prompt_cache: str | os.PathLike | None = None, prompt_cache_bytes: int = 4 << 30,
                 cb_eval: Callable | None = None, abort_callback: Callable[[], bool] | None = None,
                 lora: Sequence[tuple[str | os.PathLike, float]] = (),
                 mmproj: str | os.PathLike | None = None,
                 params: ContextParams | None = None, **kwargs):
        """The context's settings are ContextParams' fields (n_ctx, n_batch, n_seq_max, ...), as
        keyword arguments or `params`; cb_eval and abort_callback go to the Context. `lora`:
        LoRA adapter files and their scales (llama.cpp's --lora-scaled), applied to every call.
        `mmproj`: the vision projector of a multimodal model (llama.cpp's --mmproj), so that
        generate takes `images` and chat takes image_url content parts (llm.mtmd). `numerics`:
        "exact" or "ggml" (llama.cpp's quantized products; see load_model)."""
        path = hub.resolve(model)
        cparams = params_mod.from_kwargs(ContextParams, kwargs, where="LLM", base=params or ContextParams())
        t0 = time.perf_counter()
        # the executables the last start with these settings used are read while the model loads
        self._run_key: str | None = None
        self._prefetched: list[str] = []
        ggmlx.init()        # before JAX's first call (process_count creates the client)
        if jax.process_count() == 1 and path.is_file():
            st = path.stat()
            self._run_key = repr((str(path.resolve()), st.st_size, st.st_mtime_ns, n_gpu_layers, devices, split_mode,
                                  tensor_split, row_plan, weight_format, numerics,
                                  [(str(f), s) for f, s in lora], None if mmproj is None else str(mmproj), cparams))
            self._prefetched = compile_mod.prefetch_run(self._run_key)
        self._paths_from = len(get_default_cache().disk_paths)
        self.model: Model = load_model(path, devices=devices, n_gpu_layers=n_gpu_layers, tensor_split=tensor_split,
                                       progress_callback=progress_callback, weight_format=weight_format,
                                       split_mode=split_mode, row_plan=row_plan, numerics=numerics)
        # the vision encoder (libmtmd's context); the batcher decodes prompts' images with it
        self.mtmd = mtmd_mod.init_from_file(mmproj, self.model) if mmproj is not None else None
        self.t_load = time.perf_counter() - t0
        if self.model.output is None:       # an encoder gives embeddings only
            cparams = dataclasses.replace(cparams, embeddings=True)
        self.ctx = Context(self.model, cparams, cb_eval=cb_eval, abort_callback=abort_callback)
        if jax.process_count() > 1 and prompt_cache is not None:
            raise ValueError("prompt_cache restores KV state on process 0 only: not available in a multi-host run")
        if jax.process_count() > 1 and jax.process_index() == 0:
            # multi-host: process 0 generates; its decodes and cache ops are sent to the others
            # (a proxy with the Context interface: every other attribute reads the wrapped one)
            self.ctx = cast(Context, distributed.LeaderContext(self.ctx))
        self.vocab = self.model.vocab
        # the generation loop of every call; slot 0 holds the conversation of one-prompt calls
        self._batcher = Batcher(self.ctx, self.vocab, mtmd=self.mtmd)
        self._last_slot = 0
        self.prompt_cache = (PromptCache(prompt_cache, self.ctx.fingerprint, max_bytes=prompt_cache_bytes)
                             if prompt_cache is not None else None)
        self._busy = threading.Lock()    # held while a generation is live
        self._warned_template = False
        self._n_ctx, self._n_ubatch = cparams.n_ctx, min(cparams.n_ubatch, cparams.n_batch)
        self._embd_ctx: dict[PoolingType, Context] = {}
        self._cached_edits: tuple = ()     # the interventions the cached K/V were computed under
        self._tables: dict[bool, dict] = {}      # flash_attn -> named nodes (llm.trace.probe_nodes)
        self._trace_ctx: Context | None = None
        self.grad_programs: dict = {}            # compiled gradient functions (llm.trace)
        self.adapters: list[LoraAdapter] = []      # loaded by `lora` or set_adapters_lora, in the context's order
        if lora:
            self.set_adapters_lora([p for p, _ in lora], [s for _, s in lora])

    def follow(self) -> int:
        """On a process other than 0 of a multi-host run: run process 0's batches until it
        calls close(); returns the number of batches decoded."""
        if jax.process_index() == 0:
            raise RuntimeError("follow() runs on the processes other than 0; process 0 generates")
        return distributed.follow(self.ctx)

    def close(self) -> None:
        """On process 0 of a multi-host run: let the following processes return from follow()."""
        if isinstance(self.ctx, distributed.LeaderContext):
            self.ctx.stop_followers()

    def set_adapters_lora(self, adapters: Sequence[LoraAdapter | str | os.PathLike], scales: Sequence[float]) -> None:
        """Apply these LoRA adapters (loaded ones, or GGUF paths to load) with these scales to the
        following calls (llama_set_adapters_lora; an empty list removes them). The cached
        conversation was computed without them, so it is forgotten."""
        if len(adapters) != len(scales):
            raise ValueError(f"set_adapters_lora: {len(adapters)} adapters but {len(scales)} scales")
        if not self._busy.acquire(blocking=False):
            raise LLMBusyError("set_adapters_lora() while a generation on this LLM is live")
        try:
            loaded = [a if isinstance(a, LoraAdapter) else adapter_lora_init(self.model, a) for a in adapters]
            self._forget()
            self._batcher.set_adapters_lora(loaded, scales)
            self.adapters = loaded
        finally:
            self._busy.release()

    def reset(self) -> None:
        """Forget the cached conversation: clear the KV cache (llama-cpp-python's Llama.reset).
        Call it after decoding on `self.ctx` directly, so the next request starts clean."""
        if not self._busy.acquire(blocking=False):
            raise LLMBusyError("reset() while a generation on this LLM is live: finish or close() it first")
        try:
            self._forget()
        finally:
            self._busy.release()

    # ---- text <-> tokens -------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: list[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        return self.vocab.detokenize(tokens, remove_special, unparse_special)

    # ---- embeddings ------------------------------------------------------------------

    def embed(self, texts: str | list[str] | list[list[int]], normalize: bool = True,
              pooling_type: str | int | None = None, max_seqs: int = 8, *,
              abort_callback: Callable[[], bool] | None = None) -> np.ndarray:
        """One embedding per text, [n, n_embd] float32 (rank pooling: [n, n_cls_out] scores).

        Texts are tokenized with the model's special tokens and decoded several sequences
        per batch (up to `max_seqs`, as many as fit in n_ubatch tokens), each pooled over
        its own tokens. `pooling_type` defaults to the model's; a model whose default is
        "none" (decoders) is pooled with "mean". `normalize` scales each vector to unit L2
        norm (not applied to rank scores). A text longer than n_ubatch tokens: ValueError.
        `abort_callback` is asked before each batch; True stops with EmbedAborted (a server
        whose client left).
        """
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        pooling = self.model.hparams.pooling_type if pooling_type is None else PoolingType.parse(pooling_type)
        if pooling == PoolingType.NONE:
            pooling = PoolingType.MEAN
        if pooling not in self._embd_ctx:
            self._embd_ctx[pooling] = Context(self.model, n_ctx=self._n_ctx, n_batch=self._n_ubatch,
                                              n_ubatch=self._n_ubatch, n_seq_max=max_seqs, embeddings=True,
                                              pooling_type=pooling)
        ctx = self._embd_ctx[pooling]
        seqs = [list(t) if not isinstance(t, str) else self.vocab.tokenize(t, True, True) for t in items]
        room = min(ctx.n_ubatch, ctx.n_ctx)    # a group is one ubatch, and its cells fit the cache
        for i, toks in enumerate(seqs):
            if not toks:
                raise ValueError(f"embed: text {i} has no tokens")
            if len(toks) > room:
                raise ValueError(f"embed: text {i} has {len(toks)} tokens, more than {room} (n_ubatch "
                                 f"{ctx.n_ubatch}, n_ctx {ctx.n_ctx}: a sequence must be pooled in one ubatch)")
        out: list[np.ndarray] = []
        i = 0
        with ctx.lock:      # one embed at a time on this context: each group clears it first
            while i < len(seqs):
                if abort_callback is not None and abort_callback():
                    raise EmbedAborted(f"embed: aborted after {i} of {len(seqs)} texts")
                group = [seqs[i]]
                while (i + len(group) < len(seqs) and len(group) < ctx.n_seq_max
                       and sum(map(len, group)) + len(seqs[i + len(group)]) <= room):
                    group.append(seqs[i + len(group)])
                ctx.memory_clear()
                tokens = np.concatenate([np.asarray(t, np.int32) for t in group])
                pos = np.concatenate([np.arange(len(t), dtype=np.int32) for t in group])
                seq_id = [(k,) for k, t in enumerate(group) for _ in t]
                if ctx.decode(Batch(tokens, pos=pos, seq_id=seq_id)) != 0:
                    raise GenerationError(f"embed: decode failed: {ctx.last_error}")
                out += [ctx.get_embeddings_seq(k).copy() for k in range(len(group))]
                i += len(group)
        res = np.stack(out).astype(np.float32)
        if normalize and pooling != PoolingType.RANK:
            norm = np.linalg.norm(res, axis=1, keepdims=True)
            res = res / np.maximum(norm, np.float32(1e-12))
        return res

    # ---- generation ------------------------------------------------------------------

    def grammar_vocab(self) -> grammar_mod.GrammarVocab:
        """The vocabulary as llguidance wants it (built once per model, shared with every caller)."""
        return core.grammar_vocab(self.vocab)

    @staticmethod
    def constraint(grammar=None, json_schema=None) -> grammar_mod.GrammarSpec | None:
        """The checked constraint of a request: GBNF text or a GrammarSpec (llm.sampling.grammar /
        json_schema / json_object), or a JSON schema; GrammarError before any decoding."""
        if grammar is not None and json_schema is not None:
            raise ValueError("pass either grammar or json_schema, not both")
        if isinstance(grammar, grammar_mod.GrammarSpec):
            return grammar
        if grammar is not None:
            return grammar_mod.spec_gbnf(grammar)
        if json_schema is not None:
            return grammar_mod.spec_json_schema(json_schema)
        return None

    def _gen_params(self, *, max_tokens: int, stop, grammar, json_schema, n: int, logprobs: bool,
                    top_logprobs: int, speculative, sampling: SamplingParams | None,
                    lora: Sequence[float] | None = None, kwargs: dict, where: str) -> GenParams:
        """One request's GenParams from generate/stream's arguments (sampling keyword arguments
        named as SamplingParams declares them, over `sampling`)."""
        if not self.ctx.has_logits:
            raise ValueError(f"model {self.model.path} ({self.model.arch}) has no output layer: it gives "
                             f"embeddings only (LLM.embed), it cannot generate")
        sp = params_mod.from_kwargs(SamplingParams, kwargs, where=where, base=sampling or SamplingParams())
        params = GenParams(max_tokens=max_tokens, sampling=sp, stop=core.stop_strings(stop), n=n,
                           logprobs=logprobs or top_logprobs > 0, top_logprobs=top_logprobs,
                           constraint=self.constraint(grammar, json_schema),
                           speculative=None if speculative is None else self._drafter(speculative),
                           lora=None if lora is None else tuple(lora))
        params.check()
        return params

    def _drafter(self, speculative):
        if isinstance(speculative, str):
            if speculative != "prompt-lookup":
                raise ValueError(f"speculative must be 'prompt-lookup', a PromptLookup, a DraftModel or an "
                                 f"LLM, got {speculative!r}")
            return speculative
        if isinstance(speculative, LLM):
            if speculative.model.n_vocab != self.model.n_vocab:
                raise ValueError(f"speculative: the draft model has {speculative.model.n_vocab} tokens, "
                                 f"the target {self.model.n_vocab}; they must share the vocabulary")
            speculative.reset()       # its context is now the drafter's
            return DraftModel(speculative.ctx)
        if isinstance(speculative, (PromptLookup, DraftModel)):
            return speculative
        raise ValueError(f"speculative must be 'prompt-lookup', a PromptLookup, a DraftModel or an LLM, "
                         f"got {type(speculative).__name__}")

    def _graph_edits(self, interventions: trace_mod.Interventions | None) -> trace_mod.GraphEdits | None:
        """Interventions as GraphEdits, checked on every ubatch size a generation may use."""
        if not interventions:
            return None
        edits = trace_mod.GraphEdits(self.node_table(self.ctx.flash_attn), interventions)
        sizes = {1}
        while max(sizes) < self.ctx.n_ubatch:
            sizes.add(bucket(2 * max(sizes), self.ctx.n_ubatch))
        edits.check(sorted(sizes))
        return edits

    @contextlib.contextmanager
    def _under(self, edits: trace_mod.GraphEdits | None) -> Iterator[None]:
        """Decode under `edits` (interventions compiled into the graphs; none: None). K/V cached
        under other interventions are dropped."""
        key = tuple((label, id(iv.fn)) for label, iv in edits.fns.items()) if edits else ()
        if key != self._cached_edits:
            self._forget()
            self._cached_edits = key
        self.ctx.edits = edits
        try:
            yield
        finally:
            self.ctx.edits = None

    def _forget(self) -> None:
        """Clear the KV cache and what the batcher knows it holds."""
        self.ctx.memory_clear()
        self._batcher.forget()

    @property
    def _cached(self) -> list[int]:
        """The tokens whose K/V the cache holds in slot 0 (the conversation of one-prompt calls)."""
        return self._batcher.cached.get(0, [])

    def _prepare(self, tokens: list[int], params: GenParams, media: dict[int, mtmd_mod.InputChunk]) -> int:
        """Before a one-prompt job: keep the prefix of the best slot (or restore a longer one from
        the prompt cache, for a prompt without images) and compile the graphs the generation will
        use; returns the number of prompt tokens already in the cache."""
        slot, n_keep = self._batcher.best_slot(tokens, params.lora, media)
        pc = self.prompt_cache
        if (pc is not None and self.ctx.edits is None and not self.ctx.lora.adapters and not media
                and n_keep < len(tokens) - 1 - pc.min_tokens):
            n_restored = pc.restore(self.ctx, tokens[:-1], seq_id=slot, better_than=n_keep)
            if n_restored:
                self._batcher.cached[slot] = list(tokens[:n_restored])
                n_keep = n_restored
        self._batcher.keep_prefix(slot, n_keep)
        verify = () if params.speculative is None else tuple(1 + d for d in draft_lengths(max_draft(self.ctx)))
        self.ctx.reserve_generation(len(tokens) - n_keep, params.max_tokens or 0, verify=verify)
        self.remember_executables()     # the first generation's: what the next start reads ahead
        return n_keep

    def remember_executables(self) -> None:
        """Record the stored executables this LLM has used so far (once: the first generation's,
        or a server's warmup), so that the next LLM with the same model file and settings reads
        them while its model loads (ggmlx.compile.prefetch_run)."""
        if self._run_key is None:
            return
        used = list(get_default_cache().disk_paths)[self._paths_from:]
        if used and used != self._prefetched:
            compile_mod.remember_run(self._run_key, used)
        self._run_key = None

    def save_prompt_cache(self) -> None:
        """Save what the KV cache holds now (prompt and generated tokens of the last one-prompt
        call) as a prompt-cache entry."""
        cached = self._batcher.cached.get(self._last_slot, [])
        if (self.prompt_cache is not None and cached and not self.ctx.lora.adapters
                and not self._batcher.cached_media.get(self._last_slot)       # placeholders are no tokens
                and not self.prompt_cache.contains(cached)):        # the cache's K/V are of the bare model
            self.prompt_cache.store(cached, self.ctx.state_seq_get_data(self._last_slot, cached))

    def _steps(self, jobs: list[Job]) -> Iterator[None]:
        """Step the batcher until the jobs are done, yielding after each step (their events are
        in their sinks); the jobs still running when the caller stops are cancelled."""
        try:
            while not all(job.finished for job in jobs):
                self._batcher.step()
                yield
        finally:
            for job in jobs:
                self._batcher.cancel(job)

    def _stream(self, tokens: list[int], params: GenParams, edits: trace_mod.GraphEdits | None,
                media: dict[int, mtmd_mod.InputChunk] | None = None) -> Iterator[GenerationChunk]:
        """One prompt through the batcher: one chunk per sampled token, then the final one.
        media: the prompt's images (batcher.media_prompt; never a prompt-cache entry)."""
        with self._under(edits):
            perf0 = self.ctx.perf()
            n_keep = self._prepare(tokens, params, media or {})
            events: collections.deque[Event] = collections.deque()
            job = Job(tokens, params, events.append, cache_prompt=True, media=media)
            self._batcher.submit(job)
            out = _Collect(1)
            last_text = ""
            for _ in self._steps([job]):
                while events:
                    ev = events.popleft()
                    out(ev)
                    if isinstance(ev, Delta) and ev.tokens and (ev.finish_reason in (None, FINISH_LENGTH)):
                        yield GenerationChunk(ev.text, ev.tokens[0])
                    elif isinstance(ev, Delta):
                        last_text = ev.text
            if out.failed is not None:
                raise GenerationError(out.failed)
            self._last_slot = job.seqs[0].seq_id
            if (self.prompt_cache is not None and edits is None and not media
                    and len(tokens) - n_keep >= self.prompt_cache.min_tokens):
                self.save_prompt_cache()
            completion = self._completions(tokens, params, out, perf0)[0]
        yield GenerationChunk(last_text, None, completion.finish_reason, completion)

    def _completions(self, tokens: list[int], params: GenParams, out: _Collect, perf0: dict) -> list[Completion]:
        assert out.done is not None
        perf = self.ctx.perf()
        timings = {**out.done.timings, "compile_s": (perf["t_compile_ms"] - perf0["t_compile_ms"]) / 1e3,
                   "n_compiles": perf["n_compiles"] - perf0["n_compiles"], "load_s": self.t_load}
        return [Completion(text=out.text[i], tokens=out.tokens[i], n_prompt_tokens=len(tokens),
                           n_completion_tokens=len(out.tokens[i]), finish_reason=out.finish[i] or FINISH_LENGTH,
                           timings=timings, logprobs=out.logprobs[i] if params.logprobs else None)
                for i in range(params.n)]

    def _generate_batch(self, prompts: list[list[int]], params: GenParams,
                        edits: trace_mod.GraphEdits | None) -> list[Completion]:
        """The prompts as jobs of the batcher, stepped until all are done."""
        for toks in prompts:
            self._batcher.check(toks, params)
        if not self._busy.acquire(blocking=False):
            raise LLMBusyError("another generation on this LLM is live: finish it or close() it first")
        try:
            with self._under(edits):
                self._forget()          # as documented: batched calls forget the cached conversation
                perf0 = self.ctx.perf()
                sinks = [_Collect(params.n) for _ in prompts]
                jobs = [Job(toks, params, sink) for toks, sink in zip(prompts, sinks, strict=True)]
                for job in jobs:
                    self._batcher.submit(job)
                for _ in self._steps(jobs):
                    pass
        finally:
            self._busy.release()
        out = []
        for toks, sink in zip(prompts, sinks, strict=True):
            if sink.failed is not None:
                raise GenerationError(sink.failed)
            out += self._completions(toks, params, sink, perf0)
        return out

    @with_parameters(SamplingParams)
    def generate(self, prompt: str | list[int] | list[str] | list[list[int]], max_tokens: int = 128, *,
                 stop: str | list[str] | None = None, grammar=None, json_schema=None,
                 interventions: trace_mod.Interventions | None = None, n: int = 1, logprobs: bool = False,
                 top_logprobs: int = 0, speculative=None, sampling: SamplingParams | None = None,
                 lora: Sequence[float] | None = None, images: Sequence | None = None,
                 **kwargs) -> Completion | list[Completion]:
        """Continue `prompt` (text, or token ids as given) until end-of-generation, a stop
        string (cut from the text) or max_tokens. Sampling: the keyword arguments of
        SamplingParams' fields under llama-server's names (temperature, top_k, top_p, min_p,
        typical_p, repeat_penalty, dry_multiplier, mirostat, seed, ...; see llm/params.py),
        over `sampling` (a SamplingParams) when given. `grammar` (GBNF text or an llm.sampling
        grammar/json_schema/json_object) or `json_schema` (dict) constrain the output;
        `interventions` ({node pattern: fn}) edit activations inside the graph, as for `trace`.

        A list of prompts gives a list of Completions, generated together by the
        continuous-batching core: every active sequence advances in the same batch each step, up
        to the context's n_seq_max at once (LLM(..., n_seq_max=8); each sequence gets
        n_ctx // n_seq_max cells), the others wait for a free slot. n > 1 gives n samples per
        prompt (a list, prompt after prompt) sharing the prompt's cells; with a seed, sample i
        uses seed + i. logprobs: Completion.logprobs holds each generated token's log-probability
        under the model's distribution before sampling, with the top_logprobs (<= 20) best.
        speculative: "prompt-lookup", an llm.speculative.PromptLookup or DraftModel, or a draft
        LLM sharing the vocabulary (llm/generation/speculative.py). lora: this call's scale of
        each adapter in `self.adapters` (0 leaves one off), instead of those set for the LLM.
        images: with an mmproj, the images the prompt's markers (llm.mtmd.default_marker())
        stand for, in order: llm.mtmd.Bitmaps, file paths, image bytes, data URLs or uint8
        arrays; with an audio mmproj (ultravox), sounds: WAV / MP3 / FLAC paths or bytes, or
        1-d float arrays of 16 kHz samples; a MediaError when they do not pair up or cannot
        be read."""
        batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        params = self._gen_params(max_tokens=max_tokens, stop=stop, grammar=grammar, json_schema=json_schema, n=n,
                                  logprobs=logprobs, top_logprobs=top_logprobs, speculative=speculative,
                                  sampling=sampling, lora=lora, kwargs=kwargs, where="generate")
        if images is not None:
            if batched or n != 1 or not isinstance(prompt, str):
                raise ValueError("images go with one text prompt and n = 1 (its markers stand for them)")
            *_, done = self._media_checked(prompt, images, params, interventions)
            assert done.completion is not None
            return done.completion
        if batched or n != 1:
            items = cast(list, prompt if batched else [prompt])
            out = self._generate_batch([self._prompt_tokens(p) for p in items], params,
                                       self._graph_edits(interventions))
            return out if batched or n > 1 else out[0]
        *_, last = self._stream_checked(cast(str | list[int], prompt), params, interventions)
        assert last.completion is not None
        return last.completion

    @with_parameters(SamplingParams)
    def stream(self, prompt: str | list[int], max_tokens: int = 128, *, stop: str | list[str] | None = None,
               grammar=None, json_schema=None, interventions: trace_mod.Interventions | None = None,
               logprobs: bool = False, top_logprobs: int = 0, speculative=None,
               sampling: SamplingParams | None = None, lora: Sequence[float] | None = None,
               images: Sequence | None = None, **kwargs) -> Iterator[GenerationChunk]:
        """GenerationChunks as tokens are generated: their texts join to the completion's text,
        never splitting a UTF-8 character or a stop string; the last chunk has the finish reason
        and the Completion. Arguments as for generate (one prompt), checked at once, before the
        first chunk is asked for."""
        params = self._gen_params(max_tokens=max_tokens, stop=stop, grammar=grammar, json_schema=json_schema, n=1,
                                  logprobs=logprobs, top_logprobs=top_logprobs, speculative=speculative,
                                  sampling=sampling, lora=lora, kwargs=kwargs, where="stream")
        if images is not None:
            if not isinstance(prompt, str):
                raise ValueError("images go with a text prompt (its markers stand for them)")
            return self._media_checked(prompt, images, params, interventions)
        return self._stream_checked(prompt, params, interventions)

    def _stream_checked(self, prompt: str | list[int], params: GenParams,
                        interventions: trace_mod.Interventions | None) -> Iterator[GenerationChunk]:
        tokens = self._prompt_tokens(prompt)
        if len(tokens) >= self.ctx.n_ctx:
            raise ValueError(f"the prompt has {len(tokens)} tokens; the context holds {self.ctx.n_ctx}")
        self._batcher.check(tokens, params)
        return self._one_at_a_time(self._stream(tokens, params, self._graph_edits(interventions)))

    def score(self, prompt: str | list[int], continuation: str | list[int]) -> np.ndarray:
        """Log-likelihood of each token of `continuation` after `prompt` (lm-eval's
        loglikelihood; the sum is the continuation's log-probability). Text prompts get BOS as
        in tokenize(); a text continuation is tokenized without special tokens. Forgets the
        cached conversation."""
        ptoks = self._prompt_tokens(prompt)
        ctoks = self.tokenize(continuation, add_special=False) if isinstance(continuation, str) \
            else self._prompt_tokens(continuation)
        if not ctoks:
            raise ValueError("score: the continuation is empty (no tokens)")
        tokens = ptoks + ctoks
        if len(tokens) > self.ctx.n_ctx:
            raise ValueError(f"score: {len(tokens)} tokens do not fit the context of {self.ctx.n_ctx}")
        first = len(ptoks) - 1           # the logits at positions first .. len - 2 predict the continuation
        rows = []
        if not self._busy.acquire(blocking=False):
            raise LLMBusyError("another generation on this LLM is live: finish it or close() it first")
        try:
            self._forget()
            for start in range(0, len(tokens), self.ctx.n_batch):
                chunk = tokens[start:start + self.ctx.n_batch]
                pos = np.arange(start, start + len(chunk))
                want = (pos >= first) & (pos < len(tokens) - 1)
                status = self.ctx.decode(Batch(chunk, pos=pos.astype(np.int32), logits=want))
                if status != DecodeStatus.OK:
                    raise GenerationError(f"decode returned {status.name}: {self.ctx.last_error}") \
                        from self.ctx.last_exception
                rows += list(self.ctx.get_logits()[:int(want.sum())])
        finally:
            self._forget()
            self._busy.release()
        return np.array([logprobs_of(row, t, 0)[0] for row, t in zip(rows, ctoks, strict=True)])

    def _one_at_a_time(self, chunks: Iterator[GenerationChunk]) -> Iterator[GenerationChunk]:
        """The chunks, while holding the LLM: a second generation started while this one is
        live (interleaved streams, another thread) raises LLMBusyError instead of mixing its
        tokens into this one's cache. Released when the stream ends, is closed or collected."""
        if not self._busy.acquire(blocking=False):
            raise LLMBusyError("another generation on this LLM is live (an unfinished stream, or a call in "
                               "another thread): finish it or close() it first, or use a second LLM")
        try:
            yield from chunks
        finally:
            self._busy.release()

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        """Text is tokenized; token ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            tokens = self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            tokens = list(prompt)
            for i, t in enumerate(tokens):
                if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)):
                    raise TypeError(f"prompt[{i}] = {t!r} is not a token id (int): pass text or a list of ids")
                if not 0 <= t < self.model.n_vocab:
                    raise ValueError(f"prompt[{i}] = {t} is not a token id of this model [0, {self.model.n_vocab})")
            tokens = [int(t) for t in tokens]
        else:
            is_bytes = isinstance(prompt, (bytes, bytearray))
            hint = " (decode bytes first, e.g. prompt.decode('utf-8'))" if is_bytes else ""
            raise TypeError(f"prompt must be text (str) or a list of token ids, got {type(prompt).__name__}{hint}")
        if not tokens:
            raise ValueError("the prompt is empty (no tokens)")
        return tokens

    # ---- chat ------------------------------------------------------------------------

    def _template(self) -> str:
        tmpl = chat_mod.template_for(self.model.meta, self.model.arch)
        if "tokenizer.chat_template" not in self.model.meta and not self._warned_template:
            self._warned_template = True
            logger.warning("%s has no chat template (a base model?): chat uses a generic one and may answer "
                           "poorly; for chat use an instruction-tuned model, e.g. llm.LLM(%r)",
                           os.path.basename(self.model.path), hub.DEFAULT_CHAT_MODEL)
        return tmpl

    def _bos_eos(self) -> dict[str, str]:
        v = self.vocab
        return {"bos_token": v.token_get_text(v.bos).decode("utf-8", "replace") if v.bos >= 0 else "",
                "eos_token": v.token_get_text(v.eos).decode("utf-8", "replace") if v.eos >= 0 else ""}

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The model's chat template over messages; `tools` is passed to templates that use it."""
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        bos_eos = self._bos_eos()
        return chat_mod.render(self._template(), messages, add_generation_prompt=add_generation_prompt, **extra,
                               bos_token=bos_eos["bos_token"], eos_token=bos_eos["eos_token"])

    def chat_tokens(self, messages: list[dict], tools: list[dict] | None = None, *,
                    special_in_content: bool = False) -> list[int]:
        """The rendered conversation as tokens; the template writes BOS itself where the
        model wants it, else it is added here. Message content is text, as OpenAI's API treats
        it: a control token spelled in it (`<|im_end|>`) stays text, only the template's own
        markup has control tokens, unless special_in_content."""
        return self._tokens(self.render_chat(messages, tools=tools), messages,
                            lambda placed: self.render_chat(placed, tools=tools), special_in_content)

    def chat_prompt(self, messages: list[dict], options: prompt_mod.ChatOptions | None = None, *,
                    special_in_content: bool = False) -> tuple[prompt_mod.ChatPrompt, list[int]]:
        """A chat request in the model's own format (llm.chat.prompt.apply: its tool-call markup
        and reasoning, detected from the template): the ChatPrompt (the grammar and syntax of
        the reply) and the prompt's tokens, as chat_tokens makes them."""
        tmpl, bos_eos, opts = self._template(), self._bos_eos(), options or prompt_mod.ChatOptions()

        def apply(msgs: list[dict]) -> prompt_mod.ChatPrompt:
            return prompt_mod.apply(tmpl, msgs, opts, vocab=self.vocab, **bos_eos)

        chat = apply(messages)
        return chat, self._tokens(chat.prompt, messages, lambda placed: apply(placed).prompt, special_in_content)

    def _tokens(self, text: str, messages: list[dict], render: Callable[[list[dict]], str],
                special_in_content: bool) -> list[int]:
        """The tokens of `text`, the rendering of `messages` (render renders others)."""
        contents = [c for m in messages if isinstance(c := m.get("content"), str)]
        if special_in_content or not any(self._spells_special(c) for c in contents):
            tokens = self.tokenize(text, add_special=False, parse_special=True)
        else:
            tokens = self._markup_and_content_tokens(text, messages, render)
        if self.vocab.add_bos and (not tokens or tokens[0] != self.vocab.bos):
            tokens = [self.vocab.bos] + tokens
        return tokens

    def _spells_special(self, text: str) -> bool:
        return self.tokenize(text, add_special=False, parse_special=True) != \
            self.tokenize(text, add_special=False, parse_special=False)

    def _markup_and_content_tokens(self, text: str, messages: list[dict],
                                   render: Callable[[list[dict]], str]) -> list[int]:
        """Render with a placeholder per content, then tokenize the template's markup with its
        control tokens and each content as plain text."""
        marks: dict[str, str] = {}
        placed = []
        for m in messages:
            if isinstance(m.get("content"), str):
                key = f"\ue000{len(marks)}\ue001"
                marks[key] = m["content"]
                m = {**m, "content": key}
            placed.append(m)
        parts = re.split("(\ue000\\d+\ue001)", render(placed))
        if sorted(p for p in parts if p in marks) != sorted(marks):
            logger.warning("the chat template changes message content: control tokens in it are parsed")
            return self.tokenize(text, add_special=False, parse_special=True)
        out: list[int] = []
        for p in parts:
            if p in marks:
                out += self.tokenize(marks[p], add_special=False, parse_special=False)
            elif p:
                out += self.tokenize(p, add_special=False, parse_special=True)
        return out

    @with_parameters(SamplingParams)
    def chat(self, messages: list[dict], *, tools: list[dict] | None = None, tool_choice="auto",
             parallel_tool_calls: bool = False, reasoning_format: str = "auto", enable_thinking: bool = True,
             chat_template_kwargs: dict | None = None, **kw) -> Completion:
        """Render the model's chat template for messages and generate the assistant reply
        (keyword arguments as for generate). With `tools` (OpenAI's format) the model writes
        calls in its own format (Hermes' <tool_call>, Llama 3.x JSON, Mistral's [TOOL_CALLS],
        ...; the generic JSON one for other templates), constrained to the tools' schemas: a call
        or an answer with tool_choice "auto", a call with "required" or a named function; calls
        come back in `tool_calls` with finish_reason "tool_calls". The reply's reasoning (a
        <think> block, ...) comes back in `reasoning_content` (reasoning_format "none": left in
        the text); enable_thinking=False turns thinking off, as does chat_template_kwargs
        {"enable_thinking": false}."""
        *_, last = self.chat_stream(messages, tools=tools, tool_choice=tool_choice,
                                    parallel_tool_calls=parallel_tool_calls, reasoning_format=reasoning_format,
                                    enable_thinking=enable_thinking, chat_template_kwargs=chat_template_kwargs, **kw)
        assert last.completion is not None
        return last.completion

    @with_parameters(SamplingParams)
    def chat_stream(self, messages: list[dict], *, tools: list[dict] | None = None, tool_choice="auto",
                    parallel_tool_calls: bool = False, reasoning_format: str = "auto", enable_thinking: bool = True,
                    chat_template_kwargs: dict | None = None, max_tokens: int = 128,
                    stop: str | list[str] | None = None, grammar=None, json_schema=None,
                    interventions: trace_mod.Interventions | None = None, logprobs: bool = False,
                    top_logprobs: int = 0, speculative=None, sampling: SamplingParams | None = None,
                    lora: Sequence[float] | None = None, **kwargs) -> Iterator[GenerationChunk]:
        """chat as GenerationChunks: each chunk's text is new content and its reasoning_content
        new reasoning (markup never shows); the last chunk's Completion has the parsed reply."""
        checked = tools_mod.check_tools(tools) if tools else []
        options = prompt_mod.ChatOptions(
            tools=tuple(checked), tool_choice=tools_mod.ToolChoice.parse(tool_choice, checked),
            parallel_tool_calls=parallel_tool_calls, json_schema=json_schema,
            reasoning_format=ReasoningFormat(reasoning_format), enable_thinking=enable_thinking,
            chat_template_kwargs=dict(chat_template_kwargs or {}))
        if options.calls_tools and grammar is not None:
            raise ValueError("tools cannot be combined with grammar (json_schema gives the answer's schema)")
        messages, images = self._media_messages(messages)
        if images:
            tmpl, bos_eos = self._template(), self._bos_eos()
            chat = prompt_mod.apply(tmpl, messages, options, vocab=self.vocab, **bos_eos)
        else:
            chat, tokens = self.chat_prompt(messages, options)
        if chat.grammar is not None:
            grammar, json_schema = chat.grammar, None
        params = self._gen_params(max_tokens=max_tokens, stop=stop, grammar=grammar, json_schema=json_schema, n=1,
                                  logprobs=logprobs, top_logprobs=top_logprobs, speculative=speculative,
                                  sampling=sampling, lora=lora, kwargs=kwargs, where="chat")
        params = dataclasses.replace(params, preserved_tokens=chat.preserved_tokens)
        if images:
            return self._parse_reply(self._media_checked(chat.prompt, images, params, interventions), chat.syntax)
        return self._parse_reply(self._stream_checked(tokens, params, interventions), chat.syntax)

    # ---- images (llm.mtmd) ------------------------------------------------------------

    def _media_messages(self, messages: list[dict]) -> tuple[list[dict], list[mtmd_mod.Bitmap]]:
        """OpenAI content parts to text: each image_url part becomes the media marker (as
        llama-server does), its image decoded here; messages without parts are unchanged."""
        out, images = [], []
        marker = mtmd_mod.default_marker()
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if not isinstance(content, list):
                out.append(m)
                continue
            text = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                where = f"messages[{i}].content[{j}]"
                if kind == "text":
                    text.append(str(part.get("text", "")))
                elif kind == "image_url":
                    ref = part.get("image_url")
                    url = ref.get("url") if isinstance(ref, dict) else ref
                    if not isinstance(url, str):
                        raise mtmd_mod.MediaError(f"{where}: an image_url part needs {{'url': 'data:...'}}")
                    images.append(mtmd_mod.Bitmap.from_url(url, where))
                    text.append(marker)
                elif kind == "input_audio":
                    images.append(self._input_audio(part.get("input_audio"), where))
                    text.append(marker)
                else:
                    raise mtmd_mod.MediaError(f"{where}: content part type {kind!r} is not supported "
                                              f"(text, image_url, input_audio)")
            out.append({**m, "content": "".join(text)})
        if images and self.mtmd is None:
            raise mtmd_mod.MediaError("the messages hold images but this LLM has no vision projector: "
                                      "LLM(model, mmproj='....mmproj.gguf')")
        return out, images

    @staticmethod
    def _input_audio(ref, where: str) -> mtmd_mod.Bitmap:
        """An OpenAI input_audio part, {"data": base64, "format": "wav" | "mp3" | "flac"}; the
        bytes are decoded by what they are, as llama-server's mtmd-helper does."""
        data = ref.get("data") if isinstance(ref, dict) else None
        fmt = ref.get("format") if isinstance(ref, dict) else None
        if not isinstance(data, str) or fmt not in ("wav", "mp3", "flac"):
            raise mtmd_mod.MediaError(f"{where}: an input_audio part needs {{'data': base64, 'format': "
                                      f"'wav' | 'mp3' | 'flac'}}, got format {fmt!r}")
        try:
            buf = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise mtmd_mod.MediaError(f"{where}: the input_audio data is not valid base64: {e}") from None
        bm = mtmd_mod.Bitmap.from_bytes(buf, where)
        if not bm.is_audio:
            raise mtmd_mod.MediaError(f"{where}: the input_audio data is an image, not a sound")
        return bm

    def _bitmaps(self, images: Sequence) -> list[mtmd_mod.Bitmap]:
        out = []
        for i, im in enumerate(images):
            what = f"images[{i}]"
            if isinstance(im, mtmd_mod.Bitmap):
                out.append(im)
            elif isinstance(im, np.ndarray):
                out.append(mtmd_mod.Bitmap.from_array(im))
            elif isinstance(im, (bytes, bytearray)):
                out.append(mtmd_mod.Bitmap.from_bytes(bytes(im), what))
            elif isinstance(im, str) and im.startswith(("data:", "http://", "https://")):
                out.append(mtmd_mod.Bitmap.from_url(im, what))
            elif isinstance(im, (str, os.PathLike)):
                out.append(mtmd_mod.Bitmap.from_file(im))
            else:
                raise TypeError(f"{what} is a {type(im).__name__}: pass an llm.mtmd.Bitmap, a path, image bytes, "
                                f"a data URL or a uint8 array")
        return out

    def media_prompt(self, text: str, images: Sequence) -> list[mtmd_mod.InputChunk]:
        """The chunks generate(text, images=) evaluates (the server's too): mtmd's tokenization
        of the text, its markers standing for the images (as generate takes them), with BOS
        first where the model adds one and the text has none. A MediaError when markers and
        images do not pair up or the prompt ends with an image."""
        if self.mtmd is None:
            raise ValueError("images need a vision projector: LLM(model, mmproj='....mmproj.gguf')")
        chunks = self.mtmd.tokenize(text, self._bitmaps(images), add_special=False)
        bos = self.vocab.bos
        if self.vocab.add_bos and not (chunks and chunks[0].type == "text" and chunks[0].tokens[:1] == [bos]):
            chunks.insert(0, mtmd_mod.InputChunk("text", [bos]))
        if not chunks or chunks[-1].type != "text":
            raise mtmd_mod.MediaError("the prompt must end with text after its last image")
        return chunks

    def _media_checked(self, text: str, images: Sequence, params: GenParams,
                       interventions: trace_mod.Interventions | None) -> Iterator[GenerationChunk]:
        """The prompt's chunks, checked before the first chunk is asked for."""
        if interventions is not None or params.lora is not None or params.speculative is not None:
            raise ValueError("images cannot be combined with interventions, a per-call lora or speculative "
                             "decoding yet")
        tokens, media = media_prompt(self.media_prompt(text, images))
        self._batcher.check(tokens, params, media)
        return self._one_at_a_time(self._stream_media(tokens, media, params))

    def _stream_media(self, tokens: list[int], media: dict[int, mtmd_mod.InputChunk],
                      params: GenParams) -> Iterator[GenerationChunk]:
        """_stream with images, their encoder's share in the timings (0 runs for a cached image
        or one whose cells slot 0 still holds)."""
        assert self.mtmd is not None        # media_prompt made sure
        n_encode, t_encode = self.mtmd.n_encode, self.mtmd.t_encode
        for chunk in self._stream(tokens, params, None, media=media):
            if chunk.completion is not None:
                chunk.completion.timings.update(n_encode=self.mtmd.n_encode - n_encode,
                                                encode_s=self.mtmd.t_encode - t_encode)
            yield chunk

    @staticmethod
    def _parse_reply(chunks: Iterator[GenerationChunk], syntax: ChatSyntax) -> Iterator[GenerationChunk]:
        """The chunks with their text read as the reply's content and reasoning (llm.chat.parsers)."""
        reply = parsers_mod.ChatStream(syntax)
        for chunk in chunks:
            done = chunk.completion
            if done is None:
                delta = reply.feed(chunk.text)
            else:
                reply.add(chunk.text)
                delta = reply.finish()
                assert reply.message is not None
                msg = reply.message
                done.text, done.reasoning_content = msg.content, msg.reasoning_content or None
                if msg.tool_calls:
                    done.tool_calls = [c.to_openai() for c in msg.tool_calls]
                    done.finish_reason = chunk.finish_reason = FINISH_TOOL_CALLS
            yield dataclasses.replace(chunk, text=delta.content, reasoning_content=delta.reasoning_content)

    # ---- research: traces, interventions, gradients -------------------------------------

    def node_table(self, flash_attn: bool) -> dict[str, trace_mod.NodeInfo]:
        """The named nodes of this model's graph with their ranks (see llm.trace)."""
        if flash_attn not in self._tables:
            self._tables[flash_attn] = trace_mod.probe_nodes(self.model, self.trace_context(1).memory, flash_attn)
        return self._tables[flash_attn]

    def trace_context(self, n_tokens: int) -> Context:
        """The context traces and gradients run in: its own KV cache, so they leave this
        LLM's cache (the cached conversation) as it was."""
        if self._trace_ctx is None:
            self._trace_ctx = Context(self.model, n_ctx=self.ctx.n_ctx, n_batch=self.ctx.n_batch,
                                      n_ubatch=self.ctx.n_ubatch)
        if n_tokens > self._trace_ctx.n_ctx:
            raise ValueError(f"the prompt has {n_tokens} tokens; the context holds {self._trace_ctx.n_ctx}")
        return self._trace_ctx

    def trace(self, prompt: str | list[int], capture: str | Sequence[str] = ("l_out-*",),
              interventions: trace_mod.Interventions | None = None,
              flash_attn: bool | None = None, *, images: Sequence | None = None,
              capture_encoder: str | Sequence[str] = ()) -> trace_mod.Trace:
        """Run `prompt` from an empty cache and return the nodes matched by the fnmatch
        patterns in `capture` (an `llm.Trace`), under `interventions` ({pattern: fn(x) or
        fn(x, il)}, inserted after each matched node). flash_attn None: the unfused
        attention path when a pattern asks for kq / kq_soft_max / kqv nodes.
        `images` (with an mmproj): what the prompt's media markers stand for, as generate
        takes them; `capture_encoder`: patterns of the encoder's nodes (clip.cpp's names,
        `kq_soft_max-*`, `layer_out-*`) to keep per image, in `Trace.media`."""
        if images is not None or capture_encoder:
            return trace_mod.run_media_trace(self, prompt, images or [], capture, capture_encoder, interventions,
                                             flash_attn)
        return trace_mod.run_trace(self, prompt, capture, interventions, flash_attn)

    def gradient(self, prompt: str | list[int], target, wrt: str | Sequence[str] = ("inp_embd",),
                 interventions: trace_mod.Interventions | None = None) -> dict[str, np.ndarray]:
        """d target / d node for every node matched by `wrt`, shaped like its trace.
        target: (position, token_id) for one logit, or a JAX function of the logits
        [n_tokens, n_vocab] returning a scalar."""
        return trace_mod.run_gradient(self, prompt, target, wrt, interventions)[0]

    def control_vector(self, files: list[tuple[str | os.PathLike, float]] | str | os.PathLike,
                       layer_start: int = -1, layer_end: int = -1) -> trace_mod.Interventions:
        """llama.cpp control vectors as interventions for generate / stream / chat / trace:
        `files` is a path or (path, strength) pairs (--control-vector-scaled), the layer range
        as --control-vector-layer-range (bounds <= 0: the first / last layer)."""
        pairs = [(files, 1.0)] if isinstance(files, (str, os.PathLike)) else list(files)
        hp = self.model.hparams
        return cvec.load(pairs, hp.n_embd, hp.n_layer).interventions(layer_start, layer_end)

    def saliency(self, prompt: str | list[int], target, node: str = "inp_embd",
                 interventions: trace_mod.Interventions | None = None) -> np.ndarray:
        """Gradient x input at `node`, summed over the embedding: one score per prompt token."""
        grads, vals, _ = trace_mod.run_gradient(self, prompt, target, [node], interventions)
        g, v = grads[node], vals[node]
        return (g * v).reshape(g.shape[0], -1).sum(axis=1)

