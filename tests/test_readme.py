"""The README's examples run as written, so the README cannot rot: its ```python blocks in
order (one script, as a reader would paste them), and every `python -m llm ...` /
`python -m ggmlx...` command of its indented command blocks, through the shell. Set-up steps
(venv, pip, the test suite itself) are not run. Real models: slow."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def commands(text: str) -> list[str]:
    """The `python -m llm` / `python -m ggmlx` steps of the indented (4-space) code lines."""
    out = []
    for line in text.splitlines():
        if not line.startswith("    ") or line.startswith("     "):
            continue
        for part in line.strip().split("&&"):
            part = part.strip()
            if re.match(r"python -m (llm|ggmlx)\b", part):
                out.append(part)
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # `python` is the interpreter running the tests; the package is the checkout under test
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_readme_examples_are_found():
    text = README.read_text()
    assert len(python_blocks(text)) >= 2
    cmds = commands(text)
    for sub in ("generate", "chat", "info", "pull", "bench", "dump-graph"):
        assert any(c.startswith(f"python -m llm {sub}") for c in cmds), sub
    assert any(c.startswith("python -m ggmlx.gguf") for c in cmds)


# runs the blocks in order in one namespace, as a reader pasting them would; a failing block is
# reported (with its first line) and the next ones still run, so one run lists every broken block
_RUN_BLOCKS = """
import json, sys, traceback
ns = {"__name__": "__main__"}
failed = []
for i, code in enumerate(json.loads(sys.stdin.read())):
    try:
        exec(compile(code, f"README.md python block {i}", "exec"), ns)
    except Exception:
        failed.append(f"block {i} ({code.splitlines()[0]!r}): " + traceback.format_exc(limit=1).splitlines()[-1])
print("\\n".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
def test_readme_python_examples_run(tmp_path, gemma3_path, smollm2_path):
    blocks = python_blocks(README.read_text())
    r = subprocess.run([sys.executable, "-c", _RUN_BLOCKS], input=json.dumps(blocks), cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"README python blocks that fail:\n{r.stderr[-3000:]}"
    assert r.stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("command", commands(README.read_text()), ids=lambda c: " ".join(c.split()[2:4]))
def test_readme_command_runs(tmp_path, gemma3_path, smollm2_path, command):
    r = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_env(), input="Say hello.\n",
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{command}\n{r.stderr[-3000:]}"
    assert r.stdout.strip() or list(tmp_path.iterdir())
