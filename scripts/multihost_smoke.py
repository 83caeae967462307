"""Two processes on localhost, one sharded speculative generate spanning both (CPU, jax.distributed).

Each process gets `--local-devices` CPU devices; the target's tensor axis takes one device from
each process, so every layer's collectives cross the process boundary. Each process compares the
result with the target's own greedy output, computed locally on one device. Writes
`--output` (default docs/results/multihost_smoke.json).

    python scripts/multihost_smoke.py            # launches both processes and reports
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from checkout import RESULTS


def worker(process_id: int, port: int, local_devices: int) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    # JAX is imported only now, in the worker: it reads these variables when it starts.
    import jax
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id,
                               local_device_ids=list(range(local_devices)))
    import numpy as np

    import jaxspec
    from jaxspec.tools.benchmarking import layer_skip_pair

    cfg = jaxspec.ModelConfig(vocab_size=256, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=4,
                              intermediate_size=128, max_position_embeddings=512, name="multihost-test")
    with jax.default_device(jax.local_devices()[0]):
        target, draft = layer_skip_pair(cfg, draft_layers=2, damping=0.3, sharpness=4.0)
        prompts = [np.random.default_rng(i).integers(0, 256, 5 + 3 * i).tolist() for i in range(4)]
        want = jaxspec.generate(target, prompts, max_new_tokens=16).tokens
    by_process = {p: [d for d in jax.devices() if d.process_index == p] for p in range(2)}
    devices = [by_process[0][0], by_process[1][0]]
    mesh = jaxspec.MeshConfig(target_tp=2, draft_tp=0, devices=devices)
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=3), mesh=mesh)
    got = decoder.generate(prompts, max_new_tokens=16)
    report = {"process": process_id, "global_devices": len(jax.devices()), "local_devices": len(jax.local_devices()),
              "mesh_devices": [str(d) for d in devices], "same_as_single_device": got.tokens == want,
              "accepted_tokens": got.stats.accepted_tokens}
    print("REPORT " + json.dumps(report), flush=True)
    jax.distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--local-devices", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--output", default=str(RESULTS / "multihost_smoke.json"))
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, args.local_devices)
        return
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), "--port", str(port), "--local-devices",
                               str(args.local_devices)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    reports = [json.loads(line[len("REPORT "):]) for out in outputs for line in out.splitlines()
               if line.startswith("REPORT ")]
    ok = len(reports) == 2 and all(r["same_as_single_device"] for r in reports)
    summary = {"ok": ok, "seconds": time.perf_counter() - start, "reports": reports,
               "returncodes": [p.returncode for p in procs]}
    if not ok:
        summary["output_tails"] = [out[-3000:] for out in outputs]
    print(json.dumps(summary, indent=2))
    out = Path(args.output)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
