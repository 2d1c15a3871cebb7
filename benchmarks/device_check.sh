#!/usr/bin/env bash
# GPU readiness check, under 5 minutes on a GPU machine: the decode parity tests on the GPU,
# then `llm bench` (pp512 / tg128, n_ctx 2048) for SmolLM2 and Gemma3 with the GPU's peak
# memory, and one summary at the end. On a machine without a GPU the GPU parts are skipped
# with a message (exit 0), so the script itself can be tried anywhere.
#
#   pip install -e '.[cuda,test]'        # JAX's CUDA wheels (needs the network once)
#   benchmarks/device_check.sh           # PYTHON=... to pick the interpreter
#
# Matmuls run at full f32 precision on the GPU (GGMLX_MATMUL_PRECISION=highest, the default;
# no TF32 unless that variable asks for it).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GGMLX_MATMUL_PRECISION=${GGMLX_MATMUL_PRECISION:-highest}

gpu=$("$PY" -c "import jax; print(sum(d.platform == 'gpu' for d in jax.devices()))" 2>/dev/null || echo 0)
if [ "${gpu:-0}" = "0" ]; then
    echo "device_check: no GPU visible to JAX ($("$PY" -c 'import jax; print(jax.devices())' 2>&1 | tail -1));"
    echo "device_check: skipping the GPU parity tests and GPU benchmarks (install '.[cuda]' on a GPU machine)."
    exit 0
fi

start=$(date +%s)
echo "== parity on the GPU (tests/test_decode_parity.py)"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_decode_parity.py 2>&1 | tail -15
parity=${PIPESTATUS[0]}

echo "== llm bench on the GPU"
timeout 240 "$PY" - <<'PYEOF' | tee /tmp/ggmlx-device-check.json
import json
import jax
from llm import hub
from llm.bench import bench_model
dev = jax.devices()[0]
rows = []
for name in ("smollm2-135m", "gemma3-270m"):
    for r in bench_model(str(hub.resolve(name)), n_prompt=512, n_gen=128, reps=3, n_ctx=2048):
        rows.append({"model": name, "test": r.test, "tok_s": round(r.tok_s_median, 1),
                     "min": round(r.tok_s_min, 1), "max": round(r.tok_s_max, 1),
                     "compile_s": round(r.compile_s, 2), "ttft_s": round(r.ttft_s, 3)})
stats = dev.memory_stats() or {}
print(json.dumps({"device": str(dev), "kind": dev.device_kind, "rows": rows,
                  "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 3)}))
PYEOF
bench=${PIPESTATUS[0]}

echo
echo "== device_check summary ($(( $(date +%s) - start )) s)"
echo "parity tests: $([ "$parity" = 0 ] && echo passed || echo "FAILED (rc $parity)")"
"$PY" - <<'PYEOF'
import json
try:
    d = json.loads(open("/tmp/ggmlx-device-check.json").read().strip().splitlines()[-1])
except (OSError, ValueError, IndexError):
    print("bench: no result")
else:
    print(f"device {d['device']} ({d['kind']}), peak GPU memory {d['peak_gib']} GiB")
    print("| model | test | t/s | min..max | compile s | TTFT s |")
    print("|---|---|---:|---:|---:|---:|")
    for r in d["rows"]:
        print(f"| {r['model']} | {r['test']} | {r['tok_s']} | {r['min']}..{r['max']} | {r['compile_s']} | {r['ttft_s']} |")
PYEOF
[ "$parity" = 0 ] && [ "$bench" = 0 ]
