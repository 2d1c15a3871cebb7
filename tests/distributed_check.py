"""One process of a multi-host run on localhost, for tests/test_distributed.py.

`python tests/distributed_check.py COORDINATOR NUM_PROCESSES PROCESS_ID MODEL OUT [N_GEN]`:
joins the run with 2 simulated CPU devices (gloo collectives), loads MODEL with
split_mode="row" over every process's devices, and then process 0 generates N_GEN greedy
tokens from a fixed prompt, twice (the second prompt shares a prefix, so the KV-cache
sequence ops travel too), and writes them to OUT as JSON; the others follow its batches.
N_GEN < 0: process 0 generates until it fails (the test kills a process).
"""
from __future__ import annotations

import json
import sys

import jax

PROMPT = [1, 17, 99, 250, 3, 77, 401, 12]


def main(coordinator: str, num_processes: int, process_id: int, model: str, out: str, n_gen: int = 8) -> None:
    import ggmlx
    ggmlx.init()
    jax.config.update("jax_num_cpu_devices", 2)
    import llm
    from llm import distributed
    distributed.initialize(coordinator, num_processes, process_id, timeout_s=60, heartbeat_timeout_s=5)
    m = llm.LLM(model, n_ctx=64, n_batch=16, n_ubatch=16, split_mode="row", devices=jax.devices())
    if process_id == 0 and n_gen < 0:       # until a process is lost
        print("generating", file=sys.stderr, flush=True)
        while True:
            m.generate(PROMPT, max_tokens=16, temperature=0.0)
    if process_id == 0:
        first = m.generate(PROMPT, max_tokens=n_gen, temperature=0.0).tokens
        second = m.generate(PROMPT[:5] + [5, 6], max_tokens=n_gen, temperature=0.0).tokens
        m.close()
        # what this process holds of each split weight: its devices' shards only
        held = {t.name: [sum(s.data.nbytes for a in t.data.arrays() for s in a.addressable_shards),
                         sum(a.nbytes for a in t.data.arrays())]
                for t in m.model.weight_tensors() if t.data.spec.split is not None}
        with open(out, "w") as f:
            json.dump({"first": first, "second": second, "n_devices": jax.device_count(),
                       "local": jax.local_device_count(), "held": held}, f)
    else:
        print("following", file=sys.stderr, flush=True)
        n = m.follow()
        print(f"process {process_id} followed {n} batches", file=sys.stderr)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), a[3], a[4], *(int(x) for x in a[5:]))
