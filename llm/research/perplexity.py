"""Perplexity and KL divergence the way llama-perplexity computes them.

The text is tokenized once (with BOS when the model adds one) and cut into chunks of n_ctx
tokens (len // n_ctx of them). Each chunk is decoded from an empty cache with its first
token replaced by BOS (when the model adds one); only the second half is scored: the logits
at positions n_ctx/2 .. n_ctx-2 predict tokens n_ctx/2+1 .. n_ctx-1, each as
-log_softmax (max in float32, sum of expf in double). n_batch // n_ctx chunks are decoded
together as separate sequences. The result is exp(mean NLL) with llama.cpp's uncertainty.

`--kl-divergence-base FILE` also writes the scored positions' log-probabilities in
llama.cpp's format (the "_logits_" header, then per chunk one row of uint16 per token:
scale and minimum as two floats, then 16-bit log-probabilities over a 16 nat range), so a
file from either program can be compared by the other; `--kl-divergence` reads one back and
compares this model's distributions with it.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable
from typing import BinaryIO

import numpy as np

from llm.batch import Batch
from llm.context import DecodeStatus

MAGIC = b"_logits_"


class PerplexityError(ValueError):
    """Input that cannot be scored: too little text, a base file that does not match."""


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per row, as llama-perplexity: float32 max, double sum of float32 exps."""
    mx = logits.max(axis=1)
    s = np.exp(logits - mx[:, None]).astype(np.float64).sum(axis=1)
    rows = np.arange(len(targets))
    return -((logits[rows, targets] - mx).astype(np.float64) - np.log(s))


@dataclasses.dataclass
class PPLResult:
    ppl: float
    uncertainty: float
    nll: np.ndarray             # per scored token
    chunk_ppl: list[float]      # running estimate after each chunk


def _ppl(nll_sum: float, nll2_sum: float, count: int) -> tuple[float, float]:
    mean = nll_sum / count
    ppl = math.exp(mean)
    var = nll2_sum / count - mean * mean
    return ppl, (math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0)


def chunk_tokens(tokens: list[int], n_ctx: int, n_chunks: int = -1) -> np.ndarray:
    """[n_chunk, n_ctx] token ids; PerplexityError when the text has fewer than 2 * n_ctx tokens."""
    if n_ctx < 4:
        raise PerplexityError(f"the context (-c) must be at least 4 tokens, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise PerplexityError(f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of "
                              f"{n_ctx}; the text has {len(tokens)}")
    n = len(tokens) // n_ctx
    if n_chunks > 0:
        n = min(n, n_chunks)
    return np.asarray(tokens[:n * n_ctx], np.int32).reshape(n, n_ctx)


def chunk_logits(ctx, chunks: np.ndarray, bos: int | None, n_batch: int,
                 on_logits: Callable[[int, np.ndarray], None]) -> None:
    """Decode the chunks, n_batch // n_ctx at a time as sequences 0.., and pass each chunk's
    logits at positions n_ctx/2 .. n_ctx-2 to on_logits(chunk index, [n_ctx/2 - 1, n_vocab])."""
    n_chunk, n_ctx = chunks.shape
    n_seq = max(1, n_batch // n_ctx)
    first = n_ctx // 2
    for i in range(0, n_chunk, n_seq):
        group = chunks[i:i + n_seq].copy()
        if bos is not None:
            group[:, 0] = bos
        ctx.memory_clear()
        outs: list[list[np.ndarray]] = [[] for _ in group]
        step = min(n_batch, n_ctx)
        for j in range(0, n_ctx, step):
            k = min(step, n_ctx - j)
            pos = np.arange(j, j + k, dtype=np.int32)
            toks = group[:, j:j + k].reshape(-1)
            batch = Batch(toks, pos=np.tile(pos, len(group)),
                          seq_id=[(s,) for s in range(len(group)) for _ in range(k)],
                          logits=np.tile(pos >= first, len(group)))
            status = ctx.decode(batch)
            if status != DecodeStatus.OK:
                raise RuntimeError(f"decode failed on chunk {i + 1}: {ctx.last_error}")
            n_out = int((pos >= first).sum())
            if n_out:
                rows = ctx.get_logits()
                for s in range(len(group)):
                    outs[s].append(rows[s * n_out:(s + 1) * n_out])
        for s in range(len(group)):
            on_logits(i + s, np.concatenate(outs[s])[:n_ctx - 1 - first])


def perplexity(ctx, chunks: np.ndarray, bos: int | None, n_batch: int,
               progress: Callable[[int, float], None] | None = None, base_out: BinaryIO | None = None) -> PPLResult:
    """llama-perplexity's perplexity over the chunks; base_out receives the KL base file."""
    n_chunk, n_ctx = chunks.shape
    first = n_ctx // 2
    nlls: list[np.ndarray] = [np.zeros(0)] * n_chunk
    running: list[float] = []
    totals = [0.0, 0.0, 0.0]      # sum of nll, of nll^2, count
    n_vocab = ctx.n_vocab
    if base_out is not None:
        base_out.write(MAGIC + struct.pack("<iii", n_ctx, n_vocab, n_chunk))
        base_out.write(chunks.astype("<i4").tobytes())

    def on_logits(c: int, logits: np.ndarray) -> None:
        targets = chunks[c, first + 1:]
        nll = log_softmax_nll(logits, targets)
        if base_out is not None:
            for r in range(0, len(logits), 32):
                base_out.write(quantize_log_probs(logits[r:r + 32]).tobytes())
        nlls[c] = nll
        totals[0] += float(nll.sum())
        totals[1] += float((nll * nll).sum())
        totals[2] += len(nll)
        running.append(math.exp(totals[0] / totals[2]))
        if progress is not None:
            progress(c, running[-1])

    chunk_logits(ctx, chunks, bos, n_batch, on_logits)
    ppl, unc = _ppl(totals[0], totals[1], int(totals[2]))
    return PPLResult(ppl, unc, np.concatenate(nlls), running)


def quantize_log_probs(logits: np.ndarray) -> np.ndarray:
    """llama-perplexity's stored log-probabilities: per row [scale, min_log_prob] as float32,
    then round((logit - min_logit) / scale) as uint16 (0 below min_logit = max - 16)."""
    n_rows, n_vocab = logits.shape
    nv = 2 * ((n_vocab + 1) // 2) + 4
    mx = logits.max(axis=1)
    mn = np.maximum(logits.min(axis=1), mx - np.float32(16))
    lse = np.log(np.exp(logits - mx[:, None]).astype(np.float64).sum(axis=1)).astype(np.float32)
    min_log_prob = (mn - mx - lse).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    out = np.zeros((n_rows, nv), np.uint16)
    head = np.stack([scale, min_log_prob], axis=1).astype("<f4").view(np.uint16)
    out[:, :4] = head
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.rint((logits - mn[:, None]) * (np.float32(1) / safe)[:, None])
    q = np.where((logits > mn[:, None]) & (scale[:, None] > 0), q, 0)
    out[:, 4:4 + n_vocab] = q.astype(np.uint16)
    return out


def read_base_header(f: BinaryIO) -> tuple[int, int, np.ndarray]:
    """(n_ctx, n_vocab, chunks [n_chunk, n_ctx]) of a KL base file."""
    if f.read(8) != MAGIC:
        raise PerplexityError(f"{getattr(f, 'name', 'the base file')} does not look like a file of "
                              "log-probabilities (no _logits_ header)")
    head = f.read(12)
    if len(head) != 12:
        raise PerplexityError("the base file ends inside its header")
    n_ctx, n_vocab, n_chunk = struct.unpack("<iii", head)
    data = f.read(4 * n_ctx * n_chunk)
    if len(data) != 4 * n_ctx * n_chunk:
        raise PerplexityError(f"the base file ends inside its {n_chunk} x {n_ctx} tokens")
    return n_ctx, n_vocab, np.frombuffer(data, "<i4").reshape(n_chunk, n_ctx).astype(np.int32)


@dataclasses.dataclass
class KLStats:
    """Running sums of llama-perplexity's kl_divergence_result."""

    nll: list[np.ndarray] = dataclasses.field(default_factory=list)
    nll_base: list[np.ndarray] = dataclasses.field(default_factory=list)
    kld: list[np.ndarray] = dataclasses.field(default_factory=list)
    p_diff: list[np.ndarray] = dataclasses.field(default_factory=list)
    same_top: int = 0
    count: int = 0

    def add(self, logits: np.ndarray, base: np.ndarray, targets: np.ndarray, block: int = 32) -> None:
        for i in range(0, len(targets), block):    # in blocks: a few [block, n_vocab] temporaries
            self._add(logits[i:i + block], base[i:i + block], targets[i:i + block])

    def _add(self, logits: np.ndarray, base: np.ndarray, targets: np.ndarray) -> None:
        n_vocab = logits.shape[1]
        rows = np.arange(len(targets))
        head = base[:, :4].copy().view("<f4")
        scale, min_log_prob = head[:, 0], head[:, 1]
        p_log_base = (scale[:, None] * base[:, 4:4 + n_vocab].astype(np.float32) + min_log_prob[:, None])
        mx = logits.max(axis=1)
        lse = np.log(np.exp(logits - mx[:, None]).astype(np.float64).sum(axis=1)).astype(np.float32)
        nll = (mx + lse - logits[rows, targets]).astype(np.float32)
        nll_base = -p_log_base[rows, targets]
        log_p = logits - (mx + lse)[:, None]
        keep = p_log_base > np.float32(-16)
        kld = np.where(keep, np.exp(p_log_base) * (p_log_base - log_p), 0).astype(np.float64).sum(axis=1)
        self.same_top += int((logits.argmax(axis=1) == p_log_base.argmax(axis=1)).sum())
        self.nll.append(nll.astype(np.float64))
        self.nll_base.append(nll_base.astype(np.float64))
        self.kld.append(kld)
        self.p_diff.append((np.exp(-nll) - np.exp(-nll_base)).astype(np.float64))
        self.count += len(targets)


def _mean_unc(x: np.ndarray) -> tuple[float, float]:
    n = len(x)
    f = float(x.mean())
    df = float((x * x).mean()) - f * f
    return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)


def kl_report(st: KLStats) -> list[str]:
    """The summary llama-perplexity prints after a KL-divergence run."""
    nll, nll_b = np.concatenate(st.nll), np.concatenate(st.nll_base)
    kld, pd = np.concatenate(st.kld), np.concatenate(st.p_diff)
    n = len(nll)
    lp, lp_unc = _mean_unc(nll)
    lb, lb_unc = _mean_unc(nll_b)
    cov = (float((nll * nll_b).mean()) - lp * lb) / (n - 1) if n >= 10 else 0.0
    ppl, ppl_b = math.exp(lp), math.exp(lb)
    ratio_unc = math.sqrt(max(lp_unc ** 2 + lb_unc ** 2 - 2 * cov, 0.0))
    ppl_unc, ppl_b_unc = ppl * lp_unc, ppl_b * lb_unc
    k, k_unc = _mean_unc(kld)
    msd, msd_unc = _mean_unc(pd * pd)
    rms = math.sqrt(msd)
    top = st.same_top / n
    ks = np.sort(kld)
    pds = np.sort(pd)

    def pct(v: np.ndarray, f: float) -> float:
        p = f * (len(v) - 1)
        i = int(p)
        return float((1 - (p - i)) * v[i] + (p - i) * v[min(i + 1, len(v) - 1)])

    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl_unc:10.6f}",
        f"Mean PPL(base)                : {ppl_b:10.6f} ± {ppl_b_unc:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * cov / (lp_unc * lb_unc) if lp_unc * lb_unc else 0.0:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {lp - lb:10.6f} ± {ratio_unc:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {math.exp(lp - lb):10.6f} ± {math.exp(lp - lb) * ratio_unc:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {ppl - ppl_b:10.6f} ± "
        f"{math.sqrt(max(ppl_unc ** 2 + ppl_b_unc ** 2 - 2 * ppl * ppl_b * cov, 0.0)):10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {k:10.6f} ± {k_unc:10.6f}",
        f"Maximum KLD: {ks[-1]:10.6f}",
    ]
    lines += [f"{label}KLD: {pct(ks, f):10.6f}" for label, f in
              (("99.9%   ", 0.999), ("99.0%   ", 0.99), ("95.0%   ", 0.95), ("90.0%   ", 0.9))]
    lines.append(f"Median  KLD: {float(np.median(ks)):10.6f}")
    lines += [f"{label}KLD: {pct(ks, f):10.6f}" for label, f in
              (("10.0%   ", 0.1), (" 5.0%   ", 0.05), (" 1.0%   ", 0.01), (" 0.1%   ", 0.001))]
    lines += [f"Minimum KLD: {ks[0]:10.6f}", "",
              "====== Token probability statistics ======",
              f"Mean    Δp: {100 * float(pd.mean()):6.3f} ± {100 * _mean_unc(pd)[1]:5.3f} %",
              f"Maximum Δp: {100 * pds[-1]:6.3f}%", f"Median  Δp: {100 * float(np.median(pds)):6.3f}%",
              f"Minimum Δp: {100 * pds[0]:6.3f}%",
              f"RMS Δp    : {100 * rms:6.3f} ± {100 * (0.5 / rms * msd_unc if rms else 0.0):5.3f} %",
              f"Same top p: {100 * top:6.3f} ± {100 * math.sqrt(top * (1 - top) / (n - 1)):5.3f} %"]
    return lines


def kl_divergence(ctx, base: BinaryIO, bos: int | None, n_batch: int,
                  progress: Callable[[int, KLStats], None] | None = None) -> KLStats:
    """Compare this model's distributions on the base file's chunks with the stored ones."""
    n_ctx, n_vocab, chunks = read_base_header(base)
    if n_vocab != ctx.n_vocab:
        raise PerplexityError(f"the base file has a vocabulary of {n_vocab}, this model {ctx.n_vocab}")
    first = n_ctx // 2
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_rows = n_ctx - 1 - first
    st = KLStats()
    pending: dict[int, np.ndarray] = {}
    next_read = [0]

    def on_logits(c: int, logits: np.ndarray) -> None:
        while next_read[0] <= c:           # rows are stored chunk after chunk
            data = base.read(2 * nv * n_rows)
            if len(data) != 2 * nv * n_rows:
                raise PerplexityError(f"the base file ends before chunk {next_read[0] + 1}")
            pending[next_read[0]] = np.frombuffer(data, "<u2").reshape(n_rows, nv)
            next_read[0] += 1
        st.add(logits, pending.pop(c), chunks[c, first + 1:])
        if progress is not None:
            progress(c, st)

    chunk_logits(ctx, chunks, bos, n_batch, on_logits)
    return st
