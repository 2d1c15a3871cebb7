"""Images in: llama.cpp's libmtmd (tools/mtmd) on ggmlx graphs.

    mctx = llm.mtmd.init_from_file("model.mmproj.gguf", model)
    chunks = mctx.tokenize(f"Describe {llm.mtmd.default_marker()}", [llm.mtmd.Bitmap.from_file("cat.png")])
    n_past = mctx.eval_chunks(ctx, chunks)          # then sample from ctx.get_logits_ith(-1)

One file per projector family (siglip.py: gemma3), the shared ViT blocks in clip.py, the
preprocessing in image.py, decoding and MediaError in bitmap.py, the context in context.py.
"""
from llm.mtmd.bitmap import MAX_PIXELS, Bitmap, MediaError, default_marker
from llm.mtmd.context import (
    PROJECTORS,
    EvalError,
    ImageTokens,
    InputChunk,
    MtmdContext,
    init_from_file,
)

__all__ = ["MAX_PIXELS", "PROJECTORS", "Bitmap", "EvalError", "ImageTokens", "InputChunk", "MediaError",
           "MtmdContext", "default_marker", "init_from_file"]
