#!/usr/bin/env python3
"""Attention data parallel against one process, on one machine: the same bench_serving load (streamed chat, fixed
prompt and output lengths) against (a) one `deepinfer serve` and (b) `--data-parallel-size 2` ranks (the experts over
them, all-to-all over Gloo) behind `deepinfer router`, then each rank's share of pass time spent in the MoE layers'
all-to-all exchanges (deepinfer_moe_exchange_seconds_total / deepinfer_moe_pass_seconds_total): the most that
overlapping two micro-batches (SGLang's TBO) could hide. Prints bench_serving's JSON lines (label "one-process" /
"dp2") and one JSON line per rank. Reports, does not judge.

Usage: bench/dp_serving.py [--bin build/apps/deepinfer] [--bench build/bench/bench_serving] [--model models/demo]
                           [--threads-per-rank 1] [--concurrency 1,8,32] [--requests 64] [--prompt-tokens 256]
                           [--max-tokens 32]
On one host the ranks share its cores: --threads-per-rank sets each rank's OMP_NUM_THREADS (the one process gets
threads-per-rank x 2), so that both setups use the same cores.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(port, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def metrics(port):
    out = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/apps/deepinfer")
    ap.add_argument("--bench", default="build/bench/bench_serving")
    ap.add_argument("--model", default="models/demo")
    ap.add_argument("--threads-per-rank", type=int, default=1)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", default="64")
    ap.add_argument("--prompt-tokens", default="256")
    ap.add_argument("--max-tokens", default="32")
    args = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="dp-serving-")
    procs = []

    def serve(name, port, threads, *flags):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        log = open(os.path.join(logs, name + ".log"), "w")
        procs.append(subprocess.Popen([args.bin, "serve", "--model-path", args.model, "--device", "cpu", "--host",
                                       "127.0.0.1", "--port", str(port), *flags], stdout=log, stderr=subprocess.STDOUT,
                                      env=env))

    def bench(port, label):
        out = subprocess.run([args.bench, "--url", f"http://127.0.0.1:{port}", "--model", "demo", "--concurrency",
                              args.concurrency, "--requests", args.requests, "--prompt-tokens", args.prompt_tokens,
                              "--max-tokens", args.max_tokens, "--label", label, "--no-progress"],
                             capture_output=True, text=True)
        sys.stdout.write(out.stdout)
        sys.stdout.flush()

    try:
        one = free_port()
        serve("one-process", one, 2 * args.threads_per_rank)
        if not wait_health(one):
            raise SystemExit(f"the one-process server did not start (logs in {logs})")
        bench(one, "one-process")
        procs.pop().terminate()

        master, ranks, router = free_port(), [free_port(), free_port()], free_port()
        for r, port in enumerate(ranks):
            serve(f"rank{r}", port, args.threads_per_rank, "--data-parallel-size", "2", "--data-parallel-rank", str(r),
                  "--expert-parallel-size", "2", "--master-addr", "127.0.0.1", "--master-port", str(master))
        log = open(os.path.join(logs, "router.log"), "w")
        procs.append(subprocess.Popen([args.bin, "router", "--worker", f"http://127.0.0.1:{ranks[0]}", "--worker",
                                       f"http://127.0.0.1:{ranks[1]}", "--model-path", args.model, "--host",
                                       "127.0.0.1", "--port", str(router)], stdout=log, stderr=subprocess.STDOUT))
        if not all(wait_health(p) for p in ranks + [router]):
            raise SystemExit(f"the data-parallel ranks or the router did not start (logs in {logs})")
        time.sleep(1.0)
        bench(router, "dp2")
        for r, port in enumerate(ranks):
            m = metrics(port)
            dispatch = m.get('deepinfer_moe_exchange_seconds_total{phase="dispatch"}', 0.0)
            combine = m.get('deepinfer_moe_exchange_seconds_total{phase="combine"}', 0.0)
            passes = m.get("deepinfer_moe_pass_seconds_total", 0.0)
            served = sum(v for k, v in m.items() if k.startswith("deepinfer_requests_total{"))
            print(json.dumps({"bench": "dp_serving", "rank": r, "requests_served": served,
                              "pass_seconds": round(passes, 3), "dispatch_seconds": round(dispatch, 3),
                              "combine_seconds": round(combine, 3),
                              "exchange_share_of_passes": round((dispatch + combine) / passes, 3) if passes else None,
                              "threads_per_rank": args.threads_per_rank}), flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
