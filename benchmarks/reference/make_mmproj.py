"""Tiny seeded vision fixtures (a text model and its mmproj) with llama.cpp's libmtmd as the oracle.

    python benchmarks/reference/make_mmproj.py            # every projector below
    python benchmarks/reference/make_mmproj.py gemma3

For each projector NAME it writes, under tests/data/mtmd/:

- `NAME.gguf`: the text model (make_fixture.py's seeded weights and its 512-token SPM
  vocabulary, plus the projector's image begin/end control tokens);
- `NAME.mmproj.gguf`: the vision encoder and projector, every key and tensor libmtmd reads,
  at a tiny size (a 64 x 64 image in 4 x 4 patches, 2 layers of width 32);
- `NAME.npz`: llama.cpp (llama-cpp-python's mtmd bindings, CPU, flash attention off, F32
  KV cache, in a child process) on PROMPTS with the committed test images: per prompt k the
  chunks (`k_types`, `k_n_tokens`, `k_n_pos`, `k_text_<i>` tokens), every image chunk's
  embeddings `k_embd_<i>` [n_tokens, n_embd] (mtmd_encode_chunk + mtmd_get_output_embd), the
  last logits `k_logits` after mtmd_helper_eval_chunks and its `k_n_past`;
- `NAME-f16.mmproj.gguf` and `NAME-f16.npz`: the same mmproj with its attention, FFN and
  projector matrices in F16, as released mmproj files hold them, and the first prompt's arrays.

ultravox, qwen2a and voxtral (AUDIO) read sounds instead: SOUND (committed, 0.4 s of 16 kHz mono
16-bit PCM) and a 22.05 kHz stereo twin made in memory (stereo_sound_bytes), for
AUDIO_PROMPTS; their npz also hold llama.cpp's decoded samples of each (`samples_<j>`, mono
float32 at 16 kHz). qwen2a's 750 tokens a sound need a context of N_CTX_OF["qwen2a"].
ultravox also hears LONG_PROMPT, a 31 s sound made in memory (long_sound_bytes): two 30 s
chunks of the spectrogram, two audio chunks. lfm2 also sees TILED_PROMPT, a 1700 x 1300
picture made in memory (big_image_bytes): six 512 x 512 tiles and a thumbnail.

`--images` rewrites the two test images and the test sound (seeded; committed, so normally
never needed).
The GGUFs are byte-identical on rerun; the tests read only the stored files.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_fixture as mf  # noqa: E402  (the shared writers and vocabulary)

OUT = ROOT / "tests" / "data" / "mtmd"
IMAGES = (OUT / "test-image.png", OUT / "test-image-2.png")
SOUND = OUT / "test-sound.wav"
N_CTX = 256
N_CTX_OF = {"qwen2a": 1024, "ultravox": 512, "qwen2.5o": 1024, "lfm2": 1024,      # prompts that need more than N_CTX
            "llama4": 512, "llava16": 1024}
AUDIO = ("ultravox", "qwen2a", "voxtral")
_MTMD_LOG = None
CONTROL = 3                 # llama_token_type LLAMA_TOKEN_TYPE_CONTROL
USER_DEFINED = 4
# prompts of the oracle: the text, and which of IMAGES its markers stand for
PROMPTS = (
    ("Look at this: <__media__> What is in the picture?", (0,)),
    ("<__media__>two <__media__> images", (1, 0)),
)


AUDIO_PROMPTS = (
    ("Listen: <__media__> What is it?", (0,)),
    ("<__media__>a second sound", (1,)),
)


def sound_bytes(rate: int, channels: int, seconds: float, seed: int) -> bytes:
    """A seeded 16-bit PCM WAV: a 440 Hz tone, a rising chirp and noise under a fade in/out."""
    import io
    import wave
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    x = 0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * (200 + 3000 * t) * t)
    x = (x + 0.05 * rng.standard_normal(t.size)) * np.minimum(1.0, np.minimum(t, t[-1] - t) * 20)
    pcm = np.stack([x * (1.0 - 0.3 * c) for c in range(channels)], axis=1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(np.round(pcm * 32767).astype("<i2").tobytes())
    return buf.getvalue()


LONG_PROMPT = ("A long one: <__media__> done", (2,))
# qwen2.5o's prompt over [*IMAGES, SOUND]: an image and a sound in one prompt
OMNI_PROMPTS = (("Look at <__media__> and listen to <__media__> now", (0, 2)),)
SAMPLES_KEPT = 16000        # the decoded samples stored of sounds up to 1 s (the long one is not)


# lfm2's third prompt: a 1700 x 1300 picture (made in memory, big_image_bytes), cut into tiles
TILED_PROMPT = ("Tiles: <__media__> done", (2,))


def big_image_bytes() -> bytes:
    """A seeded 1700 x 1300 PNG (not committed: rebuilt identically), large enough that lfm2
    cuts it into 512 x 512 tiles."""
    import io

    from PIL import Image
    rng = np.random.default_rng(2028)
    y, x = np.mgrid[0:1300, 0:1700]
    a = np.stack([x * 255 // 1699, y * 255 // 1299, (x * y) % 251], axis=2).astype(np.int32)
    a[300:900, 500:1200] = [40, 200, 90]
    a = np.clip(a + rng.integers(-20, 21, a.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def long_sound_bytes() -> bytes:
    """A 31 s sound (rebuilt from its seed, not committed): its spectrogram is two chunks."""
    return sound_bytes(16000, 1, 31.0, 2027)


def stereo_sound_bytes() -> bytes:
    """The second test sound (not committed: rebuilt identically from its seed), resampled and
    mixed down by the decoder."""
    return sound_bytes(22050, 2, 0.3, 2026)


def make_images() -> None:
    """A 96 x 72 picture (resized down with padding) and a 40 x 40 one (resized up), seeded."""
    from PIL import Image
    rng = np.random.default_rng(2024)
    y, x = np.mgrid[0:72, 0:96]
    a = np.stack([x * 255 // 95, y * 255 // 71, (x + y) * 255 // 166], axis=2).astype(np.int32)
    a[20:50, 30:60] = [230, 40, 40]
    a = np.clip(a + rng.integers(-12, 13, a.shape), 0, 255).astype(np.uint8)
    Image.fromarray(a).save(IMAGES[0], optimize=True)
    b = rng.integers(0, 256, (5, 5, 3)).astype(np.uint8).repeat(8, 0).repeat(8, 1)
    Image.fromarray(b).save(IMAGES[1], optimize=True)
    SOUND.write_bytes(sound_bytes(16000, 1, 0.4, 2025))


def vocab_with(extra: list[str]) -> list:
    """make_fixture's SPM vocabulary with `extra` tokens appended: control tokens, and
    user-defined ones for texts that are not <...> markup (idefics3's "\\n\\n")."""
    out = []
    for k, v, vtype, atype in mf.spm_vocab_kv():
        if k == "tokenizer.ggml.tokens":
            v = list(v) + extra
        elif k == "tokenizer.ggml.scores":
            v = list(v) + [0.0] * len(extra)
        elif k == "tokenizer.ggml.token_type":
            v = list(v) + [CONTROL if t.startswith("<") else USER_DEFINED for t in extra]
        out.append((k, v, vtype, atype))
    return out


def llama_text(w: mf.Weights, d: mf.Dims, n_vocab: int) -> dict:
    """SmolVLM's text model is a llama: make_fixture's llama blocks, an untied output."""
    kv = mf.base_kv("llama", d)
    w.embd("token_embd.weight", n_vocab, d.n_embd)
    for il in range(d.n_layer):
        mf.llama_block(w, f"blk.{il}.", d)
    w.norm("output_norm.weight", d.n_embd)
    w.mat("output.weight", n_vocab, d.n_embd, gain=3.0)
    return kv


def gemma3_text(w: mf.Weights, d: mf.Dims, n_vocab: int) -> dict:
    """Gemma 3's text model: tied embeddings, QK norms, post-attention and post-FFN norms;
    every layer sliding-window (pattern 6) with a window longer than the context."""
    kv = mf.base_kv("gemma3", d)
    kv["gemma3.attention.sliding_window"] = 512
    kv["gemma3.attention.key_length"] = d.head_dim
    kv["gemma3.attention.value_length"] = d.head_dim
    w.embd("token_embd.weight", n_vocab, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        mf.attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_q_norm.weight", d.head_dim)
        w.norm(p + "attn_k_norm.weight", d.head_dim)
        w.norm(p + "post_attention_norm.weight", d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.norm(p + "post_ffw_norm.weight", d.n_embd)
    w.norm("output_norm.weight", d.n_embd)
    return kv


CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


def vision_kv(projector: str, n_embd_text: int, *, n_embd: int, n_ff: int, n_layer: int, n_head: int,
              eps: float, image_size: int, patch: int, act: str | None = "gelu",
              mean: tuple[float, ...] = HALF, std: tuple[float, ...] = HALF,
              scale_factor: int | None = None, **extra: object) -> dict[str, object]:
    """The keys of a vision mmproj, in the order every projector here writes them: clip.use_<act>
    (None: quick GELU, no key), the ViT's shape, its preprocessing, then
    clip.vision.projector.scale_factor and each of `extra` as clip.vision.<name>."""
    kv: dict[str, object] = {
        "general.architecture": "clip",
        "general.name": "fixture mmproj",
        "clip.projector_type": projector,
        "clip.has_vision_encoder": True,
    }
    if act:
        kv[f"clip.use_{act}"] = True
    kv.update({
        "clip.vision.embedding_length": n_embd,
        "clip.vision.feed_forward_length": n_ff,
        "clip.vision.block_count": n_layer,
        "clip.vision.projection_dim": n_embd_text,
        "clip.vision.attention.head_count": n_head,
        "clip.vision.attention.layer_norm_epsilon": eps,
        "clip.vision.image_size": image_size,
        "clip.vision.patch_size": patch,
        "clip.vision.image_mean": list(mean),
        "clip.vision.image_std": list(std),
    })
    if scale_factor is not None:
        kv["clip.vision.projector.scale_factor"] = scale_factor
    kv.update({f"clip.vision.{k}": v for k, v in extra.items()})
    return kv


def linear(w: mf.Weights, name: str, n_out: int, n_in: int, bias: bool = True) -> None:
    """name.weight [n_out, n_in] and (bias) name.bias."""
    w.mat(name + ".weight", n_out, n_in)
    if bias:
        w.bias(name + ".bias", n_out)


def layer_norm(w: mf.Weights, name: str, n: int, bias: bool = True) -> None:
    """name.weight and (bias; none: an RMS norm) name.bias of a norm over n."""
    w.norm(name + ".weight", n)
    if bias:
        w.bias(name + ".bias", n)


def patch_embd(w: mf.Weights, n_embd: int, patch: int, kernels: int = 1) -> None:
    """v.patch_embd.weight [n_embd, 3, patch, patch] (and with kernels=2 the second temporal
    kernel v.patch_embd.weight.1), scaled to unit variance over all kernels' inputs."""
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1")[:kernels]:
        w.t[name] = (w.rng.standard_normal((n_embd, 3, patch, patch)) / np.sqrt(3 * kernels * patch * patch)
                     ).astype(np.float32)


def class_embd(w: mf.Weights, n_embd: int) -> None:
    """v.class_embd, the class token prepended to the patches."""
    w.t["v.class_embd"] = (0.5 * w.rng.standard_normal(n_embd)).astype(np.float32)


def vit_layers(w: mf.Weights, n_layer: int, n_embd: int, n_ff: int, *, prefix: str = "v", bias: bool = True,
               ln_bias: bool = True, gated: bool = False, k_bias: bool = True, layer_scale: bool = False) -> None:
    """A standard ViT's blocks {prefix}.blk.<i>.: attn_q/k/v/out, ln1, ln2, [ffn_gate,] ffn_up,
    ffn_down[, the layer scales ls1 / ls2]. bias: the linear layers' biases (k_bias: attn_k's
    too, Whisper's has none); ln_bias: the norms' (none: RMS norms)."""
    for il in range(n_layer):
        p = f"{prefix}.blk.{il}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            linear(w, p + name, n_embd, n_embd, bias=bias and (k_bias or name != "attn_k"))
        layer_norm(w, p + "ln1", n_embd, bias=ln_bias)
        layer_norm(w, p + "ln2", n_embd, bias=ln_bias)
        if gated:
            linear(w, p + "ffn_gate", n_ff, n_embd, bias=bias)
        linear(w, p + "ffn_up", n_ff, n_embd, bias=bias)
        linear(w, p + "ffn_down", n_embd, n_ff, bias=bias)
        if layer_scale:
            w.norm(p + "ls1.weight", n_embd, center=0.5)
            w.norm(p + "ls2.weight", n_embd, center=0.5)


def siglip_vit(w: mf.Weights, projector: str, n_embd_text: int, image_size: int, merge: int) -> dict:
    """A SigLIP ViT (2 layers, width 32, 4 heads, FFN 64) over image_size x image_size
    images in 4 x 4 patches, its keys for `projector`; the projector's own tensors follow."""
    n_embd, n_ff, n_layer, patch = 32, 64, 2, 4
    kv = vision_kv(projector, n_embd_text, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=4, eps=1e-6,
                   image_size=image_size, patch=patch, scale_factor=merge)
    patch_embd(w, n_embd, patch)
    w.bias("v.patch_embd.bias", n_embd)
    w.embd("v.position_embd.weight", (image_size // patch) ** 2, n_embd, scale=0.5)
    vit_layers(w, n_layer, n_embd, n_ff)
    layer_norm(w, "v.post_ln", n_embd)
    return kv


def gemma3_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """A 64 x 64 image (256 patches) pooled 4 x 4 to 16 tokens, projected to the text width."""
    kv = siglip_vit(w, "gemma3", n_embd_text, 64, 4)
    w.t["mm.input_projection.weight"] = (w.rng.standard_normal((32, n_embd_text)) / np.sqrt(32)).astype(np.float32)
    w.norm("mm.soft_emb_norm.weight", 32)
    return kv


def idefics3_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """32 x 32 tiles (64 patches) pixel-shuffled 2 x 2 to 16 tokens of 128, projected; the
    image resized to a longest edge of 64 (so 2 x 2 tiles) plus the overview."""
    kv = siglip_vit(w, "idefics3", n_embd_text, 32, 2)
    kv["clip.vision.preproc_image_size"] = 64
    w.mat("mm.model.fc.weight", n_embd_text, 32 * 4)
    return kv


def mlp_mmproj(w: mf.Weights, n_embd_text: int, norm: bool = False) -> dict:
    """LLaVA 1.5's shape: a CLIP ViT (3 quick-GELU layers of 32, class embedding, pre-LN, no
    post-LN; read at layer 2) over a 32 x 32 image in 4 x 4 patches (64 tokens), CLIP's
    mean and std, then the mm.0 / GELU / mm.2 MLP to the text width; norm: Yi-VL's
    mm.0 / LN mm.1 / GELU / mm.3 / LN mm.4 instead (mlp_norm, in a file that says "mlp")."""
    n_embd, n_ff, n_layer, image_size, patch = 32, 64, 3, 32, 4
    kv = vision_kv("mlp", n_embd_text, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=4, eps=1e-5,
                   image_size=image_size, patch=patch, act=None, mean=CLIP_MEAN, std=CLIP_STD)
    patch_embd(w, n_embd, patch)
    class_embd(w, n_embd)
    w.embd("v.position_embd.weight", (image_size // patch) ** 2 + 1, n_embd, scale=0.5)
    layer_norm(w, "v.pre_ln", n_embd)
    vit_layers(w, n_layer, n_embd, n_ff)
    linear(w, "mm.0", n_embd_text, n_embd)
    if norm:
        layer_norm(w, "mm.1", n_embd_text)
        linear(w, "mm.3", n_embd_text, n_embd_text)
        layer_norm(w, "mm.4", n_embd_text)
    else:
        linear(w, "mm.2", n_embd_text, n_embd_text)
    return kv


def mlp_norm_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    return mlp_mmproj(w, n_embd_text, norm=True)


def llava16_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """LLaVA 1.6: mlp with LLaVA 1.6's pinpoints in 32-pixel tiles (1 x 2, 2 x 1, 2 x 2, 3 x 1,
    1 x 3); both test images become 2 x 2 tiles and the overview (5 chunks of 64 tokens)."""
    kv = mlp_mmproj(w, n_embd_text)
    kv["clip.vision.image_grid_pinpoints"] = np.array([32, 64, 64, 32, 64, 64, 96, 32, 32, 96], np.int32)
    return kv


def ultravox_mmproj(w: mf.Weights, n_embd_text: int, n_embd: int = 40, stack: int = 8) -> dict:
    """A Whisper encoder over 80 mel bands (2 layers of width n_embd, 4 heads, FFN 64;
    convolutions 80 -> n_embd -> n_embd) and the ultravox projector: Ultravox's 8 positions
    stacked per token (187 tokens a 30 s chunk, the last 4 positions dropped as llama.cpp's
    build_stack does at Ultravox's width), mm.a.mlp.1 to 2 x 64, SwiGLU, 64 -> the text width."""
    n_ff, n_layer, n_mel, n_mid = 64, 2, 80, 64
    kv: dict[str, object] = {
        "general.architecture": "clip",
        "general.name": "fixture mmproj",
        "clip.projector_type": "ultravox",
        "clip.has_audio_encoder": True,
        "clip.use_gelu": True,
        "clip.audio.embedding_length": n_embd,
        "clip.audio.feed_forward_length": n_ff,
        "clip.audio.block_count": n_layer,
        "clip.audio.projection_dim": n_embd_text,
        "clip.audio.attention.head_count": 4,
        "clip.audio.attention.layer_norm_epsilon": 1e-5,
        "clip.audio.num_mel_bins": n_mel,
        "clip.audio.projector.stack_factor": stack,
    }
    for il, n_in in ((1, n_mel), (2, n_embd)):
        w.t[f"a.conv1d.{il}.weight"] = (w.rng.standard_normal((n_embd, n_in, 3)) / np.sqrt(3 * n_in)).astype(np.float32)
        w.bias(f"a.conv1d.{il}.bias", n_embd, 1)
    w.embd("a.position_embd.weight", 1500, n_embd, scale=0.5)
    vit_layers(w, n_layer, n_embd, n_ff, prefix="a", k_bias=False)
    layer_norm(w, "a.post_ln", n_embd)
    w.norm("mm.a.norm_pre.weight", n_embd * stack)
    w.mat("mm.a.mlp.1.weight", 2 * n_mid, n_embd * stack)
    w.norm("mm.a.norm_mid.weight", n_mid)
    w.mat("mm.a.mlp.2.weight", n_embd_text, n_mid)
    return kv


def qwen2_text(w: mf.Weights, d: mf.Dims, n_vocab: int) -> dict:
    """Qwen2-Audio's text model is a qwen2: llama blocks with Q/K/V biases, an untied output."""
    kv = mf.base_kv("qwen2", d)
    w.embd("token_embd.weight", n_vocab, d.n_embd)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        mf.attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    w.norm("output_norm.weight", d.n_embd)
    w.mat("output.weight", n_vocab, d.n_embd, gain=3.0)
    return kv


def qwen2a_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """ultravox's Whisper encoder (its own seed), its positions averaged in pairs before the
    post-LN (750 tokens a 30 s chunk), then mm.a.fc (with bias) to the text width."""
    kv = ultravox_mmproj(w, n_embd_text, n_embd=32, stack=12)
    kv["clip.projector_type"] = "qwen2a"
    del kv["clip.audio.projector.stack_factor"]
    for name in [n for n in w.t if n.startswith("mm.")]:
        del w.t[name]
    w.mat("mm.a.fc.weight", n_embd_text, 32)
    w.bias("mm.a.fc.bias", n_embd_text)
    return kv


def qwen2vl_text(w: mf.Weights, d: mf.Dims, n_vocab: int) -> dict:
    """Qwen2.5-VL's text model is a qwen2vl: make_fixture's (biased Q/K/V, M-RoPE over sections
    of 3/3/2 t/h/w pairs), an untied output."""
    a = "qwen2vl"
    kv = mf.base_kv(a, d)
    kv[f"{a}.rope.dimension_sections"] = [3, 3, 2, 0]
    kv[f"{a}.attention.layer_norm_rms_epsilon"] = 1e-12       # llama.cpp 0.3.36 normalizes with 0 here
    w.embd("token_embd.weight", n_vocab, d.n_embd)
    w.norm("output_norm.weight", d.n_embd)
    w.mat("output.weight", n_vocab, d.n_embd, gain=3.0)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        mf.attn_qkv(w, p, d, bias=True)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    return kv


def qwen2vl_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """Qwen2-VL's ViT: qwen2.5vl's shape (width 16, 3 layers, two temporal patch kernels of 16 x
    16, the 2-D rope, the 2 x 2 merger) with layer norms, quick-GELU FFNs and no windows."""
    n_embd, n_ff, n_layer, patch = 16, 32, 3, 16
    kv = vision_kv("qwen2vl_merger", n_embd_text, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=2, eps=1e-6,
                   image_size=512, patch=patch, act=None, mean=CLIP_MEAN, std=CLIP_STD)
    patch_embd(w, n_embd, patch, kernels=2)
    vit_layers(w, n_layer, n_embd, n_ff)
    layer_norm(w, "v.post_ln", n_embd)
    linear(w, "mm.0", 4 * n_embd, 4 * n_embd)
    linear(w, "mm.2", n_embd_text, 4 * n_embd)
    return kv


def qwen25vl_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """Qwen2.5-VL's ViT at width 16 (2 heads of 8, 2-D RoPE), 3 RMS-norm layers with SiLU-gated
    FFNs, every 2nd attending over the whole image and the others within windows (n_wa_pattern
    2), two temporal patch kernels of 16 x 16, then the 2 x 2 merger (post-LN, mm.0, GELU, mm.2).
    llama.cpp fixes a window at 112 pixels (3 merged tokens of 32 pixels here), so the 96 x 72
    test image, resized to 128 x 96 (4 x 3 merged tokens: the minimum is 8), spans two windows."""
    n_embd, n_ff, n_layer, patch = 16, 32, 3, 16
    kv = vision_kv("qwen2.5vl_merger", n_embd_text, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=2, eps=1e-6,
                   image_size=512, patch=patch, act="silu", mean=CLIP_MEAN, std=CLIP_STD, n_wa_pattern=2)
    patch_embd(w, n_embd, patch, kernels=2)
    vit_layers(w, n_layer, n_embd, n_ff, ln_bias=False, gated=True)
    w.norm("v.post_ln.weight", n_embd)
    linear(w, "mm.0", 4 * n_embd, 4 * n_embd)
    linear(w, "mm.2", n_embd_text, 4 * n_embd)
    return kv


def qwen3vl_text(w: mf.Weights, d: mf.Dims, n_vocab: int) -> dict:
    """Qwen3-VL's text model: make_fixture's qwen3vl (QK norms, IMROPE sections 3/3/1), one
    DeepStack layer (an image token's input is 2 x n_embd wide), an untied output."""
    a = "qwen3vl"
    kv = mf.base_kv(a, d)
    kv[f"{a}.rope.dimension_sections"] = [3, 3, 1, 0]
    kv[f"{a}.n_deepstack_layers"] = 1
    w.embd("token_embd.weight", n_vocab, d.n_embd)
    w.norm("output_norm.weight", d.n_embd)
    w.mat("output.weight", n_vocab, d.n_embd, gain=3.0)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        mf.attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "attn_k_norm.weight", d.head_dim)
        w.norm(p + "attn_q_norm.weight", d.head_dim)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
        w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    return kv


def qwen3vl_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """Qwen3-VL's ViT at width 16 (2 heads of 8, 2-D RoPE) in 16 x 16 patches: two temporal patch
    kernels and a patch bias, learned positions for an 8 x 8 grid (resized bilinearly, corners
    aligned, to the image's), 3 layer-norm layers with fused QKV and GELU FFNs, all over the
    whole image; layer 1 also feeds a DeepStack merger (norm, fc1, GELU, fc2) whose tokens are
    appended to the main merger's (post-LN, mm.0, GELU, mm.2): 2 x n_embd_text per token."""
    n_embd, n_ff, n_layer, patch, side = 16, 32, 3, 16, 8
    kv = vision_kv("qwen3vl_merger", n_embd_text, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=2, eps=1e-6,
                   image_size=side * patch, patch=patch, spatial_merge_size=2)
    patch_embd(w, n_embd, patch, kernels=2)
    w.bias("v.patch_embd.bias", n_embd)
    w.embd("v.position_embd.weight", side * side, n_embd, scale=0.5)
    for il in range(n_layer):
        p = f"v.blk.{il}."
        layer_norm(w, p + "ln1", n_embd)
        linear(w, p + "attn_qkv", 3 * n_embd, n_embd)
        linear(w, p + "attn_out", n_embd, n_embd)
        layer_norm(w, p + "ln2", n_embd)
        linear(w, p + "ffn_up", n_ff, n_embd)
        linear(w, p + "ffn_down", n_embd, n_ff)
    layer_norm(w, "v.deepstack.1.norm", 4 * n_embd)
    linear(w, "v.deepstack.1.fc1", 4 * n_embd, 4 * n_embd)
    linear(w, "v.deepstack.1.fc2", n_embd_text, 4 * n_embd)
    layer_norm(w, "v.post_ln", n_embd)
    linear(w, "mm.0", 4 * n_embd, 4 * n_embd)
    linear(w, "mm.2", n_embd_text, 4 * n_embd)
    return kv


def voxtral_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """ultravox's Whisper encoder (its own seed), its positions averaged in pairs, stacked 4 at
    a time (Voxtral's: 187 tokens a chunk) and a GELU MLP without biases, 160 -> 64 -> the text
    width."""
    kv = ultravox_mmproj(w, n_embd_text, n_embd=40, stack=4)
    kv["clip.projector_type"] = "voxtral"
    for name in [n for n in w.t if n.startswith("mm.")]:
        del w.t[name]
    w.mat("mm.a.mlp.1.weight", 64, 40 * 4)
    w.mat("mm.a.mlp.2.weight", n_embd_text, 64)
    return kv


def pixtral_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """Mistral Small 3.1's ViT at width 32 (2 heads of 16, the 2-D rope) in 8 x 8 patches: a
    pre-LN, 2 RMS-norm layers with SiLU-gated FFNs and no biases, the patch merger (input norm,
    2 x 2 blocks unfolded and projected), the GELU MLP (mm.1 with a bias, mm.2 without) and
    the [IMG_BREAK] embedding. The 96 x 72 test image becomes 96 x 80 (6 x 5 merged tokens
    and 4 breaks), the 40 x 40 one 48 x 48 (3 x 3 and 2)."""
    n_embd, n_ff, n_layer, patch = 32, 64, 2, 8
    kv = vision_kv("pixtral", n_embd_text, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=2, eps=1e-5,
                   image_size=1024, patch=patch, act="silu", mean=CLIP_MEAN, std=CLIP_STD, spatial_merge_size=2)
    patch_embd(w, n_embd, patch)
    w.norm("v.pre_ln.weight", n_embd)
    vit_layers(w, n_layer, n_embd, n_ff, bias=False, ln_bias=False, gated=True)
    w.norm("mm.input_norm.weight", n_embd)
    w.mat("mm.patch_merger.weight", n_embd, 4 * n_embd)
    linear(w, "mm.1", n_embd_text, n_embd)
    w.mat("mm.2.weight", n_embd_text, n_embd_text)
    w.bias("v.token_embd.img_break", n_embd_text, scale=0.5)
    return kv


def internvl_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """InternVL's shape: a ViT (2 GELU layers of 32, 4 heads, layer norms and layer scales, a
    patch bias, a class embedding, learned positions) over 32 x 32 tiles in 4 x 4 patches,
    pixel-shuffled 2 x 2 (16 tokens a tile of 128), then the MLP projector (layer norm,
    mm.model.mlp.1, GELU, mm.model.mlp.3). Up to 4 tiles: both test images become 2 x 2 tiles
    and the overview (80 tokens)."""
    n_embd, n_ff, n_layer, image_size, patch = 32, 64, 2, 32, 4
    kv = vision_kv("internvl", n_embd_text, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=4, eps=1e-6,
                   image_size=image_size, patch=patch, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
                   scale_factor=2, preproc_min_tiles=1, preproc_max_tiles=4)
    patch_embd(w, n_embd, patch)
    w.bias("v.patch_embd.bias", n_embd)
    class_embd(w, n_embd)
    w.embd("v.position_embd.weight", (image_size // patch) ** 2 + 1, n_embd, scale=0.5)
    vit_layers(w, n_layer, n_embd, n_ff, layer_scale=True)
    layer_norm(w, "mm.model.mlp.0", 4 * n_embd)
    linear(w, "mm.model.mlp.1", n_embd_text, 4 * n_embd)
    linear(w, "mm.model.mlp.3", n_embd_text, n_embd_text)
    return kv


def lfm2_text(w: mf.Weights, d: mf.Dims, n_vocab: int) -> dict:
    """LFM2-VL's text model: make_fixture's lfm2 (short convolutions and attention) with FFNs of
    64 (the fixture set stays near 1 MB), its tied embeddings holding the projector's tokens too."""
    kv = mf.spec_lfm2(dataclasses.replace(d, n_ff=64), w)
    w.embd("token_embd.weight", n_vocab, d.n_embd, scale=0.4)
    return kv


def lfm2_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """LFM2-VL's SigLIP2 at width 16 (2 layers, 2 heads, GELU, post-LN) in 16 x 16 patches, its
    positions an 8 x 8 grid resized to the image's, pixel unshuffle 4 x 4 (so 64 x 64 pixels a
    token and 8 x 8 tokens a 512 x 512 tile), the projector's layer norm, mm.1, GELU, mm.2. The
    test images grow into 640 x 448 and 512 x 512 (the minimum is 64 tokens); the big one is
    3 x 2 tiles and a 1152 x 832 thumbnail."""
    n_embd, n_ff, n_layer, patch, side, merge = 16, 32, 2, 16, 8, 4
    kv = vision_kv("lfm2", n_embd_text, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=2, eps=1e-6,
                   image_size=256, patch=patch, scale_factor=merge)
    patch_embd(w, n_embd, patch)
    w.bias("v.patch_embd.bias", n_embd)
    w.embd("v.position_embd.weight", side * side, n_embd, scale=0.5)
    vit_layers(w, n_layer, n_embd, n_ff)
    layer_norm(w, "v.post_ln", n_embd)
    n_in = n_embd * merge * merge
    layer_norm(w, "mm.input_norm", n_in)
    linear(w, "mm.1", n_embd_text, n_in)
    linear(w, "mm.2", n_embd_text, n_embd_text)
    return kv


def llama4_text(w: mf.Weights, d: mf.Dims, n_vocab: int) -> dict:
    """Llama 4's text model, make_fixture's llama4 made smaller (the fixture set stays near 1 MB):
    4 layers (chunked attention but in layer 3, NoPE), dense FFNs of 64 and mixtures of 2 experts
    of 32 with the shared one in turn; both experts are used, so no near tie of the router flips
    a token's expert between the engines (a top-1 fixture's logits moved by 3e-3)."""
    a = "llama4"
    d = dataclasses.replace(d, n_layer=4, n_ff=64, n_expert=2, n_expert_used=2)
    kv = mf.base_kv(a, d)
    kv[f"{a}.rope.freq_base"] = 500000.0
    kv[f"{a}.expert_count"] = d.n_expert
    kv[f"{a}.expert_used_count"] = d.n_expert_used
    kv[f"{a}.expert_feed_forward_length"] = 32
    kv[f"{a}.interleave_moe_layer_step"] = 2
    w.embd("token_embd.weight", n_vocab, d.n_embd)
    w.norm("output_norm.weight", d.n_embd)
    w.mat("output.weight", n_vocab, d.n_embd, gain=3.0)
    for il in range(d.n_layer):
        p = f"blk.{il}."
        w.norm(p + "attn_norm.weight", d.n_embd)
        mf.attn_qkv(w, p, d)
        w.mat(p + "attn_output.weight", d.n_embd, d.n_embd)
        w.norm(p + "ffn_norm.weight", d.n_embd)
        if il % 2:
            mf.moe(w, p, d, 32)
            w.mat(p + "ffn_gate_shexp.weight", 32, d.n_embd)
            w.mat(p + "ffn_down_shexp.weight", d.n_embd, 32)
            w.mat(p + "ffn_up_shexp.weight", 32, d.n_embd)
        else:
            w.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
            w.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)
            w.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    return kv


def llama4_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """Llama 4's ViT at width 32 (2 layers, 4 heads of 8, the 2-D rope, layer norms with a pre-
    and post-LN, GELU) over 32 x 32 tiles in 4 x 4 patches (the 2-D patch matrix, a class
    embedding, learned positions), pixel shuffle 2 x 2 (16 tokens a tile), the adapter
    (mm.model.mlp.1, mm.model.mlp.2) and mm.model.fc. The 96 x 72 test image is 3 x 3 tiles and
    the overview, the 40 x 40 one 2 x 2 and the overview."""
    n_embd, n_ff, n_layer, image_size, patch = 32, 64, 2, 32, 4
    kv = vision_kv("llama4", n_embd_text, n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=4, eps=1e-5,
                   image_size=image_size, patch=patch, scale_factor=2)
    w.mat("v.patch_embd.weight", n_embd, 3 * patch * patch)
    class_embd(w, n_embd)
    w.embd("v.position_embd.weight", (image_size // patch) ** 2 + 1, n_embd, scale=0.5)
    layer_norm(w, "v.pre_ln", n_embd)
    vit_layers(w, n_layer, n_embd, n_ff)
    layer_norm(w, "v.post_ln", n_embd)
    w.mat("mm.model.mlp.1.weight", 64, 4 * n_embd)
    w.mat("mm.model.mlp.2.weight", 64, 64)
    w.mat("mm.model.fc.weight", n_embd_text, 64)
    return kv


def qwen25o_mmproj(w: mf.Weights, n_embd_text: int) -> dict:
    """Qwen2.5-Omni's mmproj: qwen2.5vl's vision encoder and qwen2a's audio encoder (drawn from a
    second seed) in one file, projector type qwen2.5o, both encoders' keys."""
    kv = qwen25vl_mmproj(w, n_embd_text)
    wa = mf.Weights(int(w.rng.integers(1 << 30)))
    kv_a = qwen2a_mmproj(wa, n_embd_text)
    w.t.update(wa.t)
    kv.update({k: v for k, v in kv_a.items() if k.startswith("clip.audio.") or k == "clip.has_audio_encoder"})
    kv["clip.projector_type"] = "qwen2.5o"
    return kv


SPECS = {
    # name: (text kv/weights, mmproj kv/weights, extra tokens, seed)
    "gemma3": (gemma3_text, gemma3_mmproj, ["<start_of_image>", "<end_of_image>"], 201),
    "idefics3": (llama_text, idefics3_mmproj, ["\n\n", "<fake_token_around_image>", "<global-img>"]
                 + [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)], 203),
    "mlp": (llama_text, mlp_mmproj, [], 205),
    "mlp_norm": (llama_text, mlp_norm_mmproj, [], 225),
    "llava16": (llama_text, llava16_mmproj, [], 227),
    "ultravox": (llama_text, ultravox_mmproj, [], 209),
    "qwen2a": (qwen2_text, qwen2a_mmproj, ["<|audio_bos|>", "<|audio_eos|>"], 211),
    "voxtral": (llama_text, voxtral_mmproj, ["[BEGIN_AUDIO]"], 213),
    "qwen2.5o": (qwen2vl_text, qwen25o_mmproj,
                 ["<|vision_start|>", "<|vision_end|>", "<|audio_bos|>", "<|audio_eos|>"], 215),
    "qwen2vl": (qwen2vl_text, qwen2vl_mmproj, ["<|vision_start|>", "<|vision_end|>"], 211),
    "qwen2.5vl": (qwen2vl_text, qwen25vl_mmproj, ["<|vision_start|>", "<|vision_end|>"], 207),
    "qwen3vl": (qwen3vl_text, qwen3vl_mmproj, ["<|vision_start|>", "<|vision_end|>"], 209),
    "pixtral": (llama_text, pixtral_mmproj, ["[IMG_END]"], 217),
    "internvl": (qwen2_text, internvl_mmproj, ["<img>", "</img>"], 219),
    "llama4": (llama4_text, llama4_mmproj, ["<|image_start|>", "<|image_end|>"], 223),
    "lfm2": (lfm2_text, lfm2_mmproj, ["<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"]
             + [f"<|img_row_{r}_col_{c}|>" for r in (1, 2) for c in (1, 2, 3)], 221),
}


def make_files(name: str, out: Path = OUT) -> tuple[Path, Path]:
    text_fn, mm_fn, extra, seed = SPECS[name]
    out.mkdir(parents=True, exist_ok=True)
    vocab = vocab_with(extra)
    n_vocab = mf.N_VOCAB + len(extra)
    d = mf.Dims()
    w = mf.Weights(seed)
    kv = text_fn(w, d, n_vocab)
    paths = out / f"{name}.gguf", out / f"{name}.mmproj.gguf"
    mf.write_gguf(paths[0], kv, vocab, w.t)
    wm = mf.Weights(seed + 1)
    mf.write_gguf(paths[1], mm_fn(wm, d.n_embd), [], wm.t)
    return paths


def llamacpp_mtmd(model_path: str, mmproj_path: str, image_paths: list[str],
                  prompts: tuple[tuple[str, tuple[int, ...]], ...], n_ctx: int = N_CTX) -> dict[str, np.ndarray]:
    """In llama.cpp (run in a child process): every prompt tokenized, its images encoded and
    the whole evaluated into a fresh context; the arrays of the module docstring."""
    import llama_cpp as L
    import llama_cpp.mtmd_cpp as M
    mf.quiet_llamacpp(L)
    global _MTMD_LOG
    _MTMD_LOG = L.llama_log_callback(lambda level, text, user_data: None)     # kept alive: C holds it
    M.mtmd_helper_log_set(_MTMD_LOG, None)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(model_path.encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    p = M.mtmd_context_params_default()
    p.use_gpu = False
    p.n_threads = 2
    p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.warmup = False
    mctx = M.mtmd_init_from_file(mmproj_path.encode(), model, p)
    if not mctx:
        raise RuntimeError(f"libmtmd could not load {mmproj_path}")
    bitmaps = [M.mtmd_helper_bitmap_init_from_file(mctx, path.encode(), False) for path in image_paths]
    if not all(bitmaps):
        raise RuntimeError(f"libmtmd could not decode {image_paths}")
    arrays: dict[str, np.ndarray] = {}
    for j, bm in enumerate(bitmaps):
        n_bytes = M.mtmd_bitmap_get_n_bytes(bm)
        if M.mtmd_bitmap_is_audio(bm) and n_bytes <= 4 * SAMPLES_KEPT:      # the decoder's mono float32 samples
            raw = np.ctypeslib.as_array(M.mtmd_bitmap_get_data(bm), (n_bytes,))
            arrays[f"samples_{j}"] = raw.view(np.float32).copy()
    for k, (text, which) in enumerate(prompts):
        chunks = M.mtmd_input_chunks_init()
        raw = text.encode()
        inp = M.mtmd_input_text(raw, len(raw), True, True)
        bms = (M.mtmd_bitmap_p_ctypes * len(which))(*[bitmaps[i] for i in which])
        rc = M.mtmd_tokenize(mctx, chunks, ctypes.byref(inp), bms, len(which))
        if rc != 0:
            raise RuntimeError(f"mtmd_tokenize returned {rc} for prompt {k}")
        types, n_tokens, n_pos = [], [], []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            ch = M.mtmd_input_chunks_get(chunks, i)
            t = M.mtmd_input_chunk_get_type(ch)
            n = M.mtmd_input_chunk_get_n_tokens(ch)
            types.append(t)
            n_tokens.append(n)
            n_pos.append(M.mtmd_input_chunk_get_n_pos(ch))
            if t == 0:      # MTMD_INPUT_CHUNK_TYPE_TEXT
                cnt = ctypes.c_size_t()
                toks = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(cnt))
                arrays[f"{k}_text_{i}"] = np.array([toks[j] for j in range(cnt.value)], np.int32)
            else:
                if M.mtmd_encode_chunk(mctx, ch) != 0:
                    raise RuntimeError(f"mtmd_encode_chunk failed on prompt {k} chunk {i}")
                n_embd = L.llama_model_n_embd_inp(model)        # with DeepStack's slices (qwen3vl)
                out = M.mtmd_get_output_embd(mctx)
                arrays[f"{k}_embd_{i}"] = np.ctypeslib.as_array(out, (n * n_embd,)).reshape(n, n_embd).copy()
        arrays[f"{k}_types"] = np.array(types, np.int32)
        arrays[f"{k}_n_tokens"] = np.array(n_tokens, np.int32)
        arrays[f"{k}_n_pos"] = np.array(n_pos, np.int32)
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k = cp.type_v = 0       # F32
        lctx = L.llama_init_from_model(model, cp)
        new_n_past = L.llama_pos(0)
        rc = M.mtmd_helper_eval_chunks(mctx, lctx, chunks, 0, 0, n_ctx, True, ctypes.byref(new_n_past))
        if rc != 0:
            raise RuntimeError(f"mtmd_helper_eval_chunks returned {rc} for prompt {k}")
        arrays[f"{k}_logits"] = np.ctypeslib.as_array(L.llama_get_logits_ith(lctx, -1), (n_vocab,)).copy()
        arrays[f"{k}_n_past"] = np.array(new_n_past.value, np.int32)
        L.llama_free(lctx)
        M.mtmd_input_chunks_free(chunks)
    for bm in bitmaps:
        M.mtmd_bitmap_free(bm)
    M.mtmd_free(mctx)
    L.llama_model_free(model)
    return arrays


def f16_twin(path: Path, twin: Path) -> None:
    """The mmproj with its 2-D attention, FFN and projector matrices in F16 (the patch and
    position embeddings, norms and biases stay F32, as in released files)."""
    from ggmlx import gguf
    with gguf.GGUFReader(path) as f:
        w = gguf.GGUFWriter()
        for k, v in f.kv.items():
            w.add_kv(k, v, f.kv_types[k], f.kv_array_types.get(k))
        for name, ti in f.tensors.items():
            x = np.array(ti.data.view(np.float32).reshape(tuple(reversed(ti.ne))))
            half = x.ndim == 2 and (".attn_" in name or ".ffn_" in name or name.startswith("mm."))
            w.add_tensor(name, x.astype(np.float16) if half else x)
        w.write(twin)


def make_oracle(name: str, out: Path = OUT) -> list[Path]:
    import tempfile

    from llm.research import llamacpp_child
    model, mmproj = make_files(name, out)
    twin = out / f"{name}-f16.mmproj.gguf"
    f16_twin(mmproj, twin)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        media, all_prompts = [str(p) for p in IMAGES], PROMPTS
        if name in AUDIO:
            stereo, long = Path(tmp) / "stereo.wav", Path(tmp) / "long.wav"
            stereo.write_bytes(stereo_sound_bytes())
            long.write_bytes(long_sound_bytes())
            media, all_prompts = [str(SOUND), str(stereo), str(long)], AUDIO_PROMPTS
            if name == "ultravox":
                all_prompts += (LONG_PROMPT,)
        if name == "qwen2.5o":
            media, all_prompts = [*media, str(SOUND)], OMNI_PROMPTS
        if name == "lfm2":
            big = Path(tmp) / "big.png"
            big.write_bytes(big_image_bytes())
            media, all_prompts = [*media, str(big)], PROMPTS + (TILED_PROMPT,)
        for proj, prompts, npz in ((mmproj, all_prompts, out / f"{name}.npz"),
                                   (twin, all_prompts[:1], out / f"{name}-f16.npz")):
            arrays = llamacpp_child.call(llamacpp_mtmd, str(model), str(proj), media, prompts,
                                         N_CTX_OF.get(name, N_CTX), model_path=str(model))
            np.savez_compressed(npz, **arrays)
            written.append(npz)
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"projectors ({', '.join(SPECS)}; default: all)")
    ap.add_argument("--images", action="store_true", help="rewrite the committed test images")
    args = ap.parse_args(argv)
    if args.images:
        OUT.mkdir(parents=True, exist_ok=True)
        make_images()
    for name in args.names or list(SPECS):
        print(*make_oracle(name))


if __name__ == "__main__":
    main()
