"""Sound in: decoding (mtmd-helper's audio path) and Whisper's log-mel spectrogram as llama.cpp's
tools/mtmd/mtmd-audio.cpp computes it (mtmd_audio_preprocessor_whisper), vectorised in numpy.

Decoding: llama.cpp recognises a WAV, MP3 or FLAC file by its first bytes and decodes it with
miniaudio to mono float32 at the model's sample rate (16 kHz for every Whisper-style encoder).
The `miniaudio` package is the same C library (dr_wav, dr_mp3, dr_flac and its resampler), so
the samples are llama.cpp's; the length is read from the header and checked before decoding.

The spectrogram: the samples are padded with 200 reflected samples in front and 30 s plus 200
zeros behind; frames of 400 samples every 160, a periodic Hann window, |FFT|^2, a Slaney mel
filter bank (librosa's default, area-normalized), log10 of max(sum, 2^-24), clamped to 8 below
the maximum, then (x + 4) / 4. It is cut into chunks of 3000 frames (30 s); the last, partial
chunk is only padding and is dropped. llama.cpp's FFT is float32 (its own radix-2 recursion
down to a 25-point DFT); numpy's float64 FFT differs from it by float32 rounding.
"""
from __future__ import annotations

import struct

import numpy as np

from llm.errors import MediaError

SAMPLE_RATE = 16000
# the longest sound decoded (1 hour: 230 MB of float32 samples at 16 kHz), checked from the
# file's header before any sample is decoded
MAX_SECONDS = 3600
N_FFT = 400
WINDOW = 400
HOP = 160
CHUNK_FRAMES = 3000          # 30 s: the frames one Whisper encoder graph reads
CHUNK_SECONDS = 30
MEL_FLOOR = 5.960464477539063e-08


def is_audio(buf: bytes) -> bool:
    """mtmd-helper's is_audio_file: RIFF....WAVE, ID3 or an MPEG sync word, fLaC."""
    if len(buf) < 12:
        return False
    wav = buf[:4] == b"RIFF" and buf[8:12] == b"WAVE"
    mp3 = buf[:3] == b"ID3" or (buf[0] == 0xFF and (buf[1] & 0xE0) == 0xE0)
    return wav or mp3 or buf[:4] == b"fLaC"


def check_wav_chunks(buf: bytes, what: str) -> None:
    """A WAV's chunks up to its data must lie inside the file: dr_wav decodes what is there of
    a truncated file without a word, so its declared data size is checked here (a streamed
    file's size of 0 or 0xFFFFFFFF says nothing and is let through)."""
    off = 12
    while off + 8 <= len(buf):
        tag, size = buf[off:off + 4], struct.unpack_from("<I", buf, off + 4)[0]
        if tag == b"data":
            if size not in (0, 0xFFFFFFFF) and off + 8 + size > len(buf):
                raise MediaError(f"{what}: the WAV is truncated: its data chunk declares {size} bytes, "
                                 f"{len(buf) - off - 8} are there")
            return
        off += 8 + size + (size & 1)
    raise MediaError(f"{what}: the WAV has no data chunk")


def frames_after_resampling(rate_out: int, rate_in: int, n_in: int) -> int:
    """ma_calculate_frame_count_after_resampling: the length mtmd-helper asks the decoder for
    (ma_decoder_get_length_in_pcm_frames), which it keeps whatever is read."""
    if n_in == 0 or rate_out == rate_in:
        return n_in
    n = n_in * rate_out // rate_in
    pre = n * (rate_in % rate_out) + n * (rate_in // rate_out) // rate_out
    return n + 1 if pre <= n_in else n


def decode(buf: bytes, what: str, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """A WAV / MP3 / FLAC file's bytes -> mono float32 samples at sample_rate (miniaudio's
    decoder, mixing and resampler, as mtmd-helper's decode_audio_from_buf). MediaError for
    a corrupt or truncated file, or one longer than MAX_SECONDS."""
    import miniaudio
    if buf[:4] == b"RIFF":
        check_wav_chunks(buf, what)
    get_info = (miniaudio.wav_get_info if buf[:4] == b"RIFF" else
                miniaudio.flac_get_info if buf[:4] == b"fLaC" else miniaudio.mp3_get_info)
    try:
        info = get_info(buf)
    except miniaudio.DecodeError as e:
        raise MediaError(f"{what}: cannot decode the audio: {e}") from None
    if info.sample_rate <= 0 or info.nchannels <= 0:
        raise MediaError(f"{what}: invalid audio header ({info.nchannels} channels at {info.sample_rate} Hz)")
    want = frames_after_resampling(sample_rate, info.sample_rate, info.num_frames)
    if want > MAX_SECONDS * sample_rate:
        raise MediaError(f"{what}: {info.num_frames / info.sample_rate:.0f} s of audio is over the limit of "
                         f"{MAX_SECONDS} s (refused before decoding)")
    try:
        out = miniaudio.decode(buf, output_format=miniaudio.SampleFormat.FLOAT32, nchannels=1,
                               sample_rate=sample_rate)
    except miniaudio.DecodeError as e:
        raise MediaError(f"{what}: cannot decode the audio: {e}") from None
    samples = np.frombuffer(out.samples, np.float32)
    if samples.size + 2 < want:
        raise MediaError(f"{what}: the audio is truncated ({samples.size} of {want} samples)")
    if want == 0:
        raise MediaError(f"{what}: the audio holds no samples")
    # mtmd-helper keeps `want` samples: the resampler's last one or two are cut, or zeros added
    return np.concatenate([samples[:want], np.zeros(max(0, want - samples.size), np.float32)])


def mel_filters(n_mel: int, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """fill_mel_filterbank_matrix with Whisper's arguments (0 Hz to Nyquist, Slaney mel scale,
    area normalization): float32 [n_mel, n_fft / 2 + 1], computed in float64."""
    log_step = np.log(6.4) / 27.0          # linear below 1 kHz (15 mel), logarithmic above

    def hz_to_mel(f):
        return np.where(f < 1000.0, f * 3.0 / 200.0, 15.0 + np.log(np.maximum(f, 1e-30) / 1000.0) / log_step)

    def mel_to_hz(m):
        return np.where(m < 15.0, m * 200.0 / 3.0, 1000.0 * np.exp((m - 15.0) * log_step))

    lo, hi = hz_to_mel(np.float64(0.0)), hz_to_mel(np.float64(0.5 * sample_rate))
    hz = mel_to_hz(lo + (hi - lo) * (np.arange(n_mel + 2) / (n_mel + 1)))
    f = np.arange(n_fft // 2 + 1) * (sample_rate / n_fft)
    left, center, right = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up = (f - left) / np.maximum(1e-30, center - left)
    down = (right - f) / np.maximum(1e-30, right - center)
    w = np.where((f >= left) & (f <= center), up, np.where((f > center) & (f <= right), down, 0.0))
    return (w * (2.0 / np.maximum(1e-30, right - left))).astype(np.float32)


def hann_window(length: int = WINDOW) -> np.ndarray:
    """fill_hann_window(periodic): cosf of the float-rounded angle."""
    angle = (2.0 * np.pi * np.arange(length) / length).astype(np.float32)
    return (0.5 * (1.0 - np.cos(angle).astype(np.float64))).astype(np.float32)


def log_mel_spectrogram(samples: np.ndarray, filters: np.ndarray) -> np.ndarray:
    """Whisper's normalized log-mel spectrogram of the whole (padded) sound: float32
    [n_mel, n_frames] (log_mel_spectrogram with the whisper preprocessor's parameters)."""
    x = np.asarray(samples, np.float32)
    half = N_FFT // 2
    if x.size < half + 1:                  # the reflection needs one sample plus half a window
        x = np.concatenate([x, np.zeros(half + 1 - x.size, np.float32)])
    n = x.size
    padded = np.zeros(n + CHUNK_SECONDS * SAMPLE_RATE + 2 * half, np.float32)
    padded[half:half + n] = x
    padded[:half] = x[half:0:-1]
    n_frames = (padded.size - N_FFT) // HOP + 1
    window = hann_window()
    out = np.empty((filters.shape[0], n_frames), np.float32)
    block = CHUNK_FRAMES                   # frames per FFT batch (bounds the float64 buffers)
    for s in range(0, n_frames, block):
        idx = np.arange(s, min(s + block, n_frames))[:, None] * HOP + np.arange(N_FFT)
        spec = np.fft.rfft((padded[idx] * window).astype(np.float64), axis=-1)
        power = spec.real ** 2 + spec.imag ** 2                    # [frames, n_fft / 2 + 1]
        mel = power @ filters.T.astype(np.float64)
        out[:, s:s + len(idx)] = np.log10(np.maximum(mel, MEL_FLOOR)).T
    floor = float(out.max()) - 8.0
    out = np.where(out < floor, np.float32(floor), out)
    return ((out.astype(np.float64) + 4.0) / 4.0).astype(np.float32)


def whisper_chunks(samples: np.ndarray, filters: np.ndarray) -> list[np.ndarray]:
    """mtmd_audio_preprocessor_whisper::preprocess: the spectrogram cut into [n_mel, 3000]
    chunks, each one encoder run; the last partial chunk (30 s of padding) is dropped."""
    mel = log_mel_spectrogram(samples, filters)
    return [np.ascontiguousarray(mel[:, off:off + CHUNK_FRAMES])
            for off in range(0, mel.shape[1] - CHUNK_FRAMES + 1, CHUNK_FRAMES)]
