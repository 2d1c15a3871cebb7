"""A model split over 4 simulated CPU devices gives the logits of a single device.

tests/tiny_model.py runs in a subprocess (JAX must see 4 CPU devices before it is first used,
and this pytest process already has one): it loads 6-layer tiny llama (Q8_0 weights) and
gemma3 (tied output) models on one device, split evenly over 4 devices, unevenly
(tensor_split 3:1:0:2), and partially offloaded (n_gpu_layers 4), decodes 20 prompt tokens
and 4 single-token steps with each, and saves logits and placements for the checks here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_model import CONFIGS, SPECS

pytestmark = pytest.mark.slow   # one subprocess with 4 simulated devices

# llama.cpp's placement of 6 layers + the output layer (llama_model::load_tensors)
EXPECTED = {
    "one_device": ([0] * 6, 0),
    "even_4": ([0, 0, 1, 1, 2, 2], 3),
    "uneven_4": ([0, 0, 0, 0, 1, 3], 3),      # shares 3:1:0:2 -> cumulative 0.5, 0.67, 0.67, 1
    "partial_offload": ([0, 0, 0, 0, 1, 2], 3),  # the last 4 of 7 slots, one per device
}


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, dict[str, np.ndarray]]:
    out = tmp_path_factory.mktemp("multidevice")
    script = Path(__file__).parent / "tiny_model.py"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads((out / "result.json").read_text())
    with np.load(out / "result.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return info, arrays


def test_four_devices_are_visible(result):
    assert result[0]["n_devices"] == 4


@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.parametrize("config", [c for c in CONFIGS if c != "one_device"])
def test_split_model_gives_single_device_logits(result, arch: str, config: str):
    _, arrays = result
    one, split = arrays[f"{arch}/one_device"], arrays[f"{arch}/{config}"]
    assert np.isfinite(one).all() and one.std() > 1.0
    assert np.abs(split - one).max() <= 1e-5


@pytest.mark.parametrize("arch", list(SPECS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_layers_are_placed_like_llama_cpp(result, arch: str, config: str):
    info, _ = result
    placement = info["placement"][f"{arch}/{config}"]
    layers, output = EXPECTED[config]
    assert placement == {"input": 0, "layers": layers, "output": output}
    where: dict[str, set[int]] = {}
    for name, device in info["weight_devices"][f"{arch}/{config}"]:
        where.setdefault(name, set()).add(device)
    for name, devices in where.items():
        if name.startswith("blk."):
            want = {layers[int(name.split(".")[1])]}
        elif name == "token_embd.weight":
            # gemma3 ties its output to token_embd: a second copy lives on the output device
            want = {0, output} if arch == "gemma3" else {0}
        else:
            want = {output}
        assert devices == want, f"{name} on devices {devices}, expected {want}"
