#!/usr/bin/env python3
"""The policy table of a replay_policies.sh result (JSON lines) as Markdown: hit rate (the workers' usage),
the router's predicted hit rate, TTFT p50/p90, requests per worker (max over mean), against the single big worker.
Usage: table.py RESULT.jsonl"""
import json
import sys

lines = [json.loads(l) for l in open(sys.argv[1])]
setup = next(l for l in lines if l["bench"] == "router_policies_setup")
runs = [l for l in lines if l["bench"] == "live_replay"]
single = next((r for r in runs if r["label"].startswith("single-4x")), None)
print(f"{setup['requests']} requests of the Mooncake {setup['trace']}, {setup['block_tokens']} tokens per trace block, "
      f"prompts cut at {setup['max_prompt_tokens']}, {setup['concurrency']} clients; 4 workers with "
      f"{setup['worker_kv']} of KV each vs one with {setup['big_kv']}; {setup['cpus']} CPUs.\n")
print("| setup | hit rate (usage) | vs single 4x | router's predicted | TTFT p50 ms | TTFT p90 ms | requests max/mean | failed |")
print("|---|---|---|---|---|---|---|---|")
for r in runs:
    name = r["label"].split(":")[0]
    rate = r["cached_token_rate"]
    rel = f"{rate / single['cached_token_rate']:.2f}" if single and single["cached_token_rate"] else "-"
    router = r.get("router", {})
    print(f"| {name} | {rate:.4f} | {rel} | {router.get('predicted_token_hit_rate', '-')} | {r['ttft_ms']['p50']:.0f} | "
          f"{r['ttft_ms']['p90']:.0f} | {router.get('max_over_mean_requests', '-')} | {r['failed']} |")
print(f"\nIdeal (an infinite cache): {runs[0]['ideal_token_hit_rate']:.4f}.")
