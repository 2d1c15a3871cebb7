"""libmtmd's context: tokenize a prompt with media markers into chunks, encode image (or
audio) chunks with the projector's graph, and evaluate chunks into a text model's Context.

llama.cpp: tools/mtmd/mtmd.cpp (mtmd_init_from_file, mtmd_tokenize, mtmd_encode_chunk) and
mtmd-helper.cpp (mtmd_helper_eval_chunks). The text is split at each marker; every text
part is tokenized alone (parse_special, no BOS), an image becomes the projector's begin
text, an image chunk and its end text, and BOS goes first when the vocabulary adds one. A
sound becomes one audio chunk per 30 s of its log-mel spectrogram (audio.py), held like an
image's preprocessed pixels so the rest of the engine treats both alike.
Encoder graphs are built once per image shape and compiled through ggmlx's graph cache;
the embeddings of an image are cached by its content hash, so asking about the same image
again runs no encoder.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ggmlx.compile import compute
from llm.batch import Batch
from llm.errors import ModelLoadError
from llm.mtmd import clip
from llm.mtmd.bitmap import Bitmap, MediaError, default_marker
from llm.mtmd.image import normalize
from llm.mtmd.internvl import INTERNVL
from llm.mtmd.lfm2 import LFM2
from llm.mtmd.llama4 import LLAMA4
from llm.mtmd.llava import MLP, MLP_NORM
from llm.mtmd.pixtral import PIXTRAL
from llm.mtmd.qwen2vl import QWEN2VL, QWEN3VL, QWEN25VL
from llm.mtmd.siglip import GEMMA3, IDEFICS3
from llm.mtmd.whisper import QWEN2A, ULTRAVOX, VOXTRAL

if TYPE_CHECKING:
    from llm.context import Context
    from llm.model import Model

logger = logging.getLogger(__name__)

PROJECTORS: dict[str, clip.Projector] = {p.name: p for p in (GEMMA3, IDEFICS3, MLP, MLP_NORM, QWEN2VL, QWEN25VL,
                                                              QWEN3VL, PIXTRAL, INTERNVL, LFM2, LLAMA4, ULTRAVOX,
                                                              QWEN2A, VOXTRAL)}
AUDIO_PROJECTORS = frozenset(p.name for p in (ULTRAVOX, QWEN2A, VOXTRAL))     # those that read sounds
EMBD_CACHE_ENTRIES = 32     # images whose embeddings are kept
# encoder graphs kept by image size: a dynamic-size projector (qwen2vl) builds one per size, with
# inputs of n_patches^2 floats (a window mask) that a long-running server must not pile up
GRAPHS_KEPT = 8


class EvalError(RuntimeError):
    """A decode of the text model failed while chunks were evaluated; `status` is its code."""

    def __init__(self, what: str, status: int, detail: str | None):
        super().__init__(f"decoding {what} failed with status {status}: {detail or 'no detail'}")
        self.status = status


@dataclass(eq=False)
class ImageTokens:
    """mtmd_image_tokens: the preprocessed image (float32 [3, ny, nx], normalized) and the
    grid its tokens cover (nx x ny; nx = n_tokens, ny = 1 where the positions are 1-d). `id`
    is the bitmap's; `key` tells the slices of one image apart (id#k, the overview k = 0).
    A sound's chunk (mtmd_audio_tokens) holds its log-mel chunk as float32 [1, n_mel, n_frames]."""
    nx: int
    ny: int
    id: str
    pixels: np.ndarray = field(repr=False)
    key: str = ""
    mrope: bool = False     # the text model reads the grid at 2-D positions (M-RoPE)
    audio: bool = False     # a sound's chunk: at M-RoPE positions every section reads n_past + i

    @property
    def n_tokens(self) -> int:
        return self.nx * self.ny

    def decoder_pos(self, n_past: int) -> np.ndarray:
        """mtmd_image_tokens_get_decoder_pos: the tokens' positions from n_past, [n_tokens]; for
        M-RoPE [4, n_tokens], each token's t (n_past), y and x (n_past + its row and column), e (0)."""
        i = np.arange(self.n_tokens)
        if not self.mrope:
            return n_past + i
        if self.audio:          # set_position_mrope_1d
            return np.tile(n_past + i, (4, 1))
        return np.stack([np.full_like(i, n_past), n_past + i // self.nx, n_past + i % self.nx, np.zeros_like(i)])


@dataclass(eq=False)
class InputChunk:
    """mtmd_input_chunk: "text" (its tokens), "image" or "audio" (its ImageTokens)."""
    type: str
    tokens: list[int] = field(default_factory=list)
    image: ImageTokens | None = None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) if self.image is None else self.image.n_tokens

    @property
    def n_pos(self) -> int:
        """Positions the chunk takes in the text model: its tokens, or for an image at 2-D
        positions the longer side of its grid (mtmd_image_tokens_get_n_pos)."""
        if self.image is not None and self.image.mrope:
            return max(self.image.nx, self.image.ny)
        return self.n_tokens

    @property
    def id(self) -> str:
        return self.image.id if self.image is not None else ""

    @property
    def key(self) -> str:
        return self.image.key if self.image is not None else ""


class MtmdContext:
    """An mmproj's encoder bound to a text model (mtmd_context)."""

    def __init__(self, mmproj_path: str | os.PathLike, model: Model, *, n_threads: int | None = None):
        self.path = os.fspath(mmproj_path)
        self.text_model = model
        self.n_threads = n_threads       # XLA sizes its own pool; kept for mtmd's signature
        device = model.place.dev_output
        self.clip, reader = clip.load_model(self.path, device)
        reader.close()
        self.projector = proj = self._bind(self.clip)
        self.n_mmproj_embd = model.hparams.n_embd_inp()
        # the audio encoder: the file's only one, or one beside its vision encoder (qwen2.5o)
        self.clip_a: clip.ClipModel | None = self.clip if self.clip.hparams.is_audio else clip.audio_beside(self.clip)
        if self.clip_a is not None and self.clip_a.hparams.projector not in AUDIO_PROJECTORS:
            logger.warning("%s: its audio encoder ('%s') is not supported; it reads images only", self.path,
                           self.clip_a.hparams.projector)
            self.clip_a = None
        self.projector_a = self.projector if self.clip_a is self.clip else \
            self._bind(self.clip_a) if self.clip_a is not None else None
        self.marker = default_marker()
        self.mrope = model.hparams.n_pos_per_embd() > 1         # mtmd_decode_use_mrope
        vocab = model.vocab
        self.tok_beg = vocab.tokenize(proj.img_beg, False, True) if proj.img_beg else []
        self.tok_end = vocab.tokenize(proj.img_end, False, True) if proj.img_end else []
        proj_a = self.projector_a
        self.tok_beg_a = vocab.tokenize(proj_a.img_beg, False, True) if proj_a is not None and proj_a.img_beg else []
        self.tok_end_a = vocab.tokenize(proj_a.img_end, False, True) if proj_a is not None and proj_a.img_end else []
        self.tok_ov_img_start = [self.lookup_token(t) for t in proj.tok_ov_img_start]
        self.tok_ov_img_end = [self.lookup_token(t) for t in proj.tok_ov_img_end]
        self.tok_row_end = [self.lookup_token(t) for t in proj.tok_row_end]
        self._graphs: collections.OrderedDict[tuple[int, int], clip.ClipGraph] = collections.OrderedDict()
        # the second encoder's (the audio one of a file with both), by spectrogram size
        self._graphs_a: collections.OrderedDict[tuple[int, int], clip.ClipGraph] = collections.OrderedDict()
        self._embd: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.n_encode = 0               # encoder runs (a cached image does not count)
        self.t_encode = 0.0

    def _bind(self, c: clip.ClipModel) -> clip.Projector:
        """The projector of one encoder: supported, fed to this text model, giving its width."""
        model, name = self.text_model, c.hparams.projector
        proj = PROJECTORS.get(name)
        if proj is None:
            raise ModelLoadError(f"{self.path}: projector type '{name}' is not supported "
                                 f"(supported: {', '.join(sorted(PROJECTORS))})")
        arch = model.hparams.arch.value
        if arch not in proj.text_archs:
            raise ModelLoadError(f"{self.path}: a '{name}' projector feeds {', '.join(sorted(proj.text_archs))} "
                                 f"text models; {model.path} is '{arch}'")
        n_mmproj_embd = proj.load(c)
        n_embd_inp = model.hparams.n_embd_inp()         # llama_model_n_embd_inp: with DeepStack's slices
        if n_mmproj_embd != n_embd_inp:
            raise ModelLoadError(f"{self.path}: the projector gives {n_mmproj_embd} values per token; "
                                 f"{model.path} has n_embd {model.hparams.n_embd}"
                                 + (f" and reads {n_embd_inp} per image token" if n_embd_inp != model.hparams.n_embd
                                    else ""))
        return proj

    def support_vision(self) -> bool:
        """mtmd_support_vision: the projector reads images."""
        return not self.clip.hparams.is_audio

    def support_audio(self) -> bool:
        """mtmd_support_audio: the projector (or the second encoder) reads sounds."""
        return self.clip_a is not None

    # ---- tokenize -----------------------------------------------------------------------

    def lookup_token(self, text: str) -> int:
        """mtmd's lookup_token: the first token whose piece (special tokens spelled) is text."""
        vocab = self.text_model.vocab
        want = text.encode()
        for t in range(vocab.n_tokens):
            if vocab.token_to_piece(t, special=True) == want:
                return t
        raise ModelLoadError(f"{self.path}: the '{self.projector.name}' projector needs the token {text!r}; "
                             f"{self.text_model.path}'s vocabulary has none")

    def _audio(self, bm: Bitmap, what: str) -> list[ImageTokens]:
        """A sound's chunks: one per 30 s of its log-mel spectrogram."""
        c, proj = self.clip_a, self.projector_a
        if c is None or proj is None:
            raise MediaError(f"{what} is a sound; the '{self.projector.name}' projector reads images")
        pre = proj.preprocess(c, proj, bm.data)
        return [ImageTokens(proj.n_output_tokens(c.hparams, mel.shape[1], mel.shape[0]), 1, bm.id, mel[None],
                            f"{bm.id}#{k}", mrope=self.mrope, audio=True) for k, mel in enumerate(pre.entries)]

    def _image(self, img: np.ndarray, bm: Bitmap, k: int) -> ImageTokens:
        hp = self.clip.hparams
        nx, ny = self.projector.n_output_tokens(hp, img.shape[1], img.shape[0]), 1
        grid = self.projector.n_output_grid
        if self.mrope and grid is not None:
            nx, ny = grid(hp, img.shape[1], img.shape[0])
        return ImageTokens(nx, ny, bm.id, normalize(img, hp.image_mean, hp.image_std), f"{bm.id}#{k}",
                           mrope=self.mrope)

    def preprocess(self, bm: Bitmap) -> list[ImageTokens]:
        """The images the encoder reads for one bitmap (the projector's preprocessor): one,
        or for a tiled image the overview then each slice, row by row; a sound's chunks."""
        if bm.is_audio:
            return self._audio(bm, "the bitmap")
        pre = self.projector.preprocess(self.clip, self.projector, bm.data)
        images = [] if pre.overview is None else [pre.overview]
        return [self._image(img, bm, k) for k, img in enumerate(images + pre.entries)]

    def tokenize(self, text: str, bitmaps: list[Bitmap] | tuple[Bitmap, ...] = (), *,
                 add_special: bool = True, parse_special: bool = True) -> list[InputChunk]:
        """mtmd_tokenize. A MediaError when the markers and the bitmaps do not pair up."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        bitmaps = list(bitmaps)
        for i, bm in enumerate(bitmaps):
            if not isinstance(bm, Bitmap):
                raise TypeError(f"bitmaps[{i}] is a {type(bm).__name__}, not an llm.mtmd.Bitmap")
        parts = text.split(self.marker)
        n_markers = len(parts) - 1
        if n_markers != len(bitmaps):
            raise MediaError(f"the prompt has {n_markers} media marker{'s' * (n_markers != 1)} ({self.marker}) "
                             f"but {len(bitmaps)} image{'s' * (len(bitmaps) != 1)} were given")
        vocab = self.text_model.vocab
        chunks: list[InputChunk] = []

        def add_text(tokens: list[int]) -> None:
            if not tokens:
                return
            if chunks and chunks[-1].type == "text":
                chunks[-1].tokens.extend(tokens)
            else:
                chunks.append(InputChunk("text", list(tokens)))

        proj = self.projector
        for i, part in enumerate(parts):
            if part:
                add_text(vocab.tokenize(part, False, parse_special))
            if i == len(bitmaps):
                break
            if bitmaps[i].is_audio:
                add_text(self.tok_beg_a)
                chunks += [InputChunk("audio", image=a) for a in self._audio(bitmaps[i], f"bitmaps[{i}]")]
                add_text(self.tok_end_a)
                continue
            if self.clip.hparams.is_audio:
                raise MediaError(f"bitmaps[{i}] is an image; the '{proj.name}' projector reads sounds")
            add_text(self.tok_beg)
            pre = proj.preprocess(self.clip, proj, bitmaps[i].data)
            if pre.overview is None:
                chunks += [InputChunk("image", image=self._image(img, bitmaps[i], k))
                           for k, img in enumerate(pre.entries)]
            else:
                # mtmd_tokenizer::add_media, llava-uhd style: slices row by row, the overview
                # before or after them, each among its projector's tokens
                overview = InputChunk("image", image=self._image(pre.overview, bitmaps[i], 0))
                if proj.ov_img_first:
                    add_text(self.tok_ov_img_start)
                    chunks.append(overview)
                    add_text(self.tok_ov_img_end)
                for y in range(pre.grid_y):
                    for x in range(pre.grid_x):
                        if proj.sli_img_start_tmpl:
                            add_text(vocab.tokenize(proj.sli_img_start_tmpl % (y + 1, x + 1), False, True))
                        k = 1 + y * pre.grid_x + x
                        chunks.append(InputChunk("image", image=self._image(pre.entries[k - 1], bitmaps[i], k)))
                    if y != pre.grid_y - 1:
                        add_text(self.tok_row_end)
                if not proj.ov_img_first:
                    add_text(self.tok_ov_img_start)
                    chunks.append(overview)
                    add_text(self.tok_ov_img_end)
            add_text(self.tok_end)
        if add_special and vocab.add_bos:
            if chunks and chunks[0].type == "text":
                chunks[0].tokens.insert(0, vocab.bos)
            else:
                chunks.insert(0, InputChunk("text", [vocab.bos]))
        if add_special and vocab.add_eos:
            add_text([vocab.eos])
        return chunks

    # ---- encode -------------------------------------------------------------------------

    def graph(self, nx: int, ny: int, audio: bool | None = None) -> clip.ClipGraph:
        """The encoder graph for images of this size (built once while among the last
        GRAPHS_KEPT sizes; compiled once per shape by ggmlx's cache); audio: the audio
        encoder's for a spectrogram of nx frames (the file's own modality by default)."""
        audio = self.clip.hparams.is_audio if audio is None else audio
        c, proj = (self.clip_a, self.projector_a) if audio else (self.clip, self.projector)
        assert c is not None and proj is not None, "this mmproj has no audio encoder"
        graphs = self._graphs if c is self.clip else self._graphs_a
        g = graphs.get((nx, ny))
        if g is None:
            g = clip.ClipGraph(c, nx, ny)
            g.finish(proj.build(g))
            graphs[(nx, ny)] = g
            while len(graphs) > GRAPHS_KEPT:
                graphs.popitem(last=False)
        else:
            graphs.move_to_end((nx, ny))
        return g

    def encode_chunk(self, chunk: InputChunk) -> np.ndarray:
        """mtmd_encode_chunk + mtmd_get_output_embd: float32 [n_tokens, n_mmproj_embd]."""
        if chunk.image is None:
            raise MediaError(f"encode_chunk: a {chunk.type} chunk has nothing to encode")
        img = chunk.image
        hit = self._embd.get(img.key)
        if hit is not None:
            self._embd.move_to_end(img.key)
            return hit
        t0 = time.perf_counter()
        ny, nx = img.pixels.shape[1:]
        g = self.graph(nx, ny, audio=chunk.type == "audio")
        assert g.out is not None
        outs, _ = compute(g.gf, {g.inp_raw: img.pixels, **g.inputs}, device=self.text_model.place.dev_output)
        embd = np.asarray(outs[g.out], np.float32).reshape(-1, self.n_mmproj_embd)
        if embd.shape[0] != img.n_tokens:
            raise RuntimeError(f"the encoder gave {embd.shape[0]} tokens for an image of {img.n_tokens}")
        self.n_encode += 1
        self.t_encode += time.perf_counter() - t0
        self._embd[img.key] = embd
        while len(self._embd) > EMBD_CACHE_ENTRIES:
            self._embd.popitem(last=False)
        return embd

    # ---- eval ---------------------------------------------------------------------------

    def eval_chunks(self, ctx: Context, chunks: list[InputChunk], n_past: int = 0, seq_id: int = 0,
                    n_batch: int = 512, logits_last: bool = True) -> int:
        """mtmd_helper_eval_chunks: decode every chunk into `ctx` at positions from n_past in
        sequence seq_id, in batches of n_batch; image chunks are encoded (or read from the
        cache) and fed as embeddings, with causal attention off around them where the model
        wants it. Returns the new n_past. Raises MediaError before decoding anything when
        the chunks do not fit, EvalError when a decode fails."""
        if n_batch <= 0:
            raise ValueError(f"n_batch must be > 0, got {n_batch}")
        n_total = sum(c.n_tokens for c in chunks)        # the cells they take
        if n_past + n_total > ctx.n_ctx:
            raise MediaError(f"the chunks take {n_total} positions from {n_past}; the context holds {ctx.n_ctx}")
        n_batch = min(n_batch, ctx.n_batch)
        for i, chunk in enumerate(chunks):
            last = logits_last and i == len(chunks) - 1
            if chunk.type == "text":
                toks = chunk.tokens
                for s in range(0, len(toks), n_batch):
                    part = toks[s:s + n_batch]
                    want = np.zeros(len(part), bool)
                    want[-1] = last and s + n_batch >= len(toks)
                    self._decode(ctx, Batch(tokens=part, pos=np.arange(n_past, n_past + len(part)),
                                            seq_id=[seq_id] * len(part), logits=want), "text")
                    n_past += len(part)
                continue
            embd = self.encode_chunk(chunk)
            assert chunk.image is not None      # encode_chunk refuses a text chunk
            pos = chunk.image.decoder_pos(n_past)
            non_causal = self.projector.non_causal and chunk.type == "image"      # mtmd_decode_use_non_causal
            if non_causal:
                ctx.set_causal_attn(False)
            try:
                for s in range(0, embd.shape[0], n_batch):
                    rows = embd[s:s + n_batch]
                    self._decode(ctx, Batch(embd=rows, pos=pos[..., s:s + len(rows)],
                                            seq_id=[seq_id] * len(rows), logits=np.zeros(len(rows), bool)),
                                 chunk.type)
            finally:
                if non_causal:
                    ctx.set_causal_attn(True)
            n_past += chunk.n_pos
        return n_past

    @staticmethod
    def _decode(ctx: Context, batch: Batch, what: str) -> None:
        status = ctx.decode(batch)
        if status != 0:
            raise EvalError(what, int(status), ctx.last_error)


def init_from_file(mmproj_path: str | os.PathLike, model: Model, *, n_threads: int | None = None) -> MtmdContext:
    """mtmd_init_from_file: the mmproj's encoder for `model`; ModelLoadError when the file is
    not an mmproj, its projector is not supported or does not fit the model (naming both)."""
    return MtmdContext(mmproj_path, model, n_threads=n_threads)
