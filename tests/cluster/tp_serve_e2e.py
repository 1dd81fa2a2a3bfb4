#!/usr/bin/env python3
"""`deepinfer serve --tensor-parallel-size 2` end to end on the CPU (issue 18, items 1, 3 and 4): two processes, rank 0
serving and rank 1 started and supervised by it, collectives over Gloo on loopback.

Checks:
  - greedy identity: chat completions (plain and streamed, several prompts, one batch of concurrent requests) equal a
    one-process server's;
  - the same with the experts spread over the two ranks (--expert-parallel-size 2, 2 redundant slots) and EPLB
    rebalancing every 5 passes while the requests run: identical text, rebalances counted in /metrics;
  - with the host and disk KV tiers (a 21-block device pool): a prompt pushed out to the host tier and loaded back,
    and after a restart one loaded from the disk tier, give the one-process server's text (rank 1 gets the blocks
    rank 0 loads), with MTP drafts too (the MTP layer's blocks); a TP=2 prefill worker's blocks imported by a TP=2
    decode worker give it too;
  - MTP speculative decoding (K=2) and DSpark's module with TP=2: plain decoding's text, and the drafts and
    acceptance of one process;
  - kill -9 rank 1: rank 0 reports it and exits non-zero within 10 s (no hang); the requests in flight get a 503
    naming the failed group;
  - kill -9 rank 0: rank 1 is gone within 10 s (it dies with its parent);
  - two hosts on loopback (--nnodes 2 --node-rank 0|1, TP=4): the same text; kill -9 host 1's process: rank 0 exits
    non-zero within 10 s; kill -9 rank 0: host 1's ranks exit within 10 s;
  - two hosts, what broke (regressions): a second process with the same --node-rank is refused naming it while the
    group serves; SIGSTOP of rank 0: host 1's node leader exits non-zero within 10 s, saying rank 0 stopped
    answering; SIGTERM to host 1's node leader: its ranks stop, rank 0 exits non-zero within 10 s naming host 1 and
    the signal; hosts that disagree on --tensor-parallel-size or --nnodes: both exit non-zero naming the flag and
    both values (not Gloo's error); a stream in flight when host 1 is SIGSTOPped ends with an error event
    (`data: {"error": ...}`) before rank 0 exits;
  - SIGTERM to rank 0: both exit 0;
  - what the tensor-parallel path does not carry is refused at startup with a message naming it.
Usage: tp_serve_e2e.py DEEPINFER_BINARY MODEL_DIR
"""
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from harness import chat, check, content, failures, free_port, init, metrics, request, streamed_text

BIN, MODEL, logdir = init("tp-e2e-")
procs = []


def ask(port, text, stream=False, max_tokens=24):
    """The server's greedy answer to `text` (no system prompt), or "HTTP <status>: <body>"."""
    status, data = request(port, "/v1/chat/completions", chat(text, max_tokens, stream, model="demo"), timeout=120)
    if status != 200:
        return f"HTTP {status}: {data}"
    return streamed_text(data) if stream else content(data)


def concurrent(port, prompts, max_tokens=16):
    """Greedy chat completions of `prompts`, all at once; {index: text}."""
    results = {}

    def worker(k, prompt):
        results[k] = ask(port, prompt, max_tokens=max_tokens)

    threads = [threading.Thread(target=worker, args=(k, p)) for k, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def start(name, *args):
    port = free_port()
    log = open(os.path.join(logdir, name + ".log"), "w+")
    p = subprocess.Popen([BIN, "serve", "--model-path", MODEL, "--device", "cpu", "--host", "127.0.0.1", "--port",
                          str(port), *args], stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    deadline = time.time() + 90
    while time.time() < deadline:
        if p.poll() is not None:
            break
        try:
            if request(port, "/health", timeout=2)[0] == 200:
                return p, port, log
        except OSError:
            pass
        time.sleep(0.2)
    log.seek(0)
    print(log.read()[-3000:])
    raise SystemExit(f"{name} did not become healthy")


seen_ranks = []  # every rank-1 process this test started


def launch(name, *args):
    """A `serve` process that may never become healthy; (process, log)."""
    log = open(os.path.join(logdir, name + ".log"), "w+")
    p = subprocess.Popen([BIN, "serve", "--model-path", MODEL, "--device", "cpu", "--host", "127.0.0.1", "--port",
                          str(free_port()), *args], stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    return p, log


def ranks_at(master_port):
    """The rank processes started for the group whose store is on `master_port`."""
    out = subprocess.run(["pgrep", "-f", "--", f"--master-port {master_port} .*--internal-tp-rank"],
                         capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def wait_gone(pids, seconds=10):
    t0 = time.time()
    while any(alive(pid) for pid in pids) and time.time() - t0 < seconds:
        time.sleep(0.1)


def stop_group(node0, others):
    """SIGTERM rank 0 (the group stops by command) and wait for the node leaders; kill what is left. Exit codes."""
    node0.send_signal(signal.SIGTERM)
    codes = []
    for p in [node0] + [p for p, _ in others]:
        try:
            codes.append(p.wait(timeout=30))
        except subprocess.TimeoutExpired:
            codes.append(None)
            p.kill()
    return codes


def rank1_pid(port):
    out = subprocess.run(["pgrep", "-f", "--", f"--port {port} .*--internal-tp-rank 1"], capture_output=True, text=True)
    pids = [int(x) for x in out.stdout.split()]
    seen_ranks.extend(pids)
    return pids[0] if pids else None


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def log_text(log):
    log.flush()
    log.seek(0)
    return log.read()


def answer_with_system(port, system, question, headers=None):
    """(greedy answer or "HTTP <status>: <body>", usage) of `question` after the system prompt `system`."""
    status, data = request(port, "/v1/chat/completions", chat(question, 16, system=system, model="demo"), timeout=120,
                           headers=headers)
    if status != 200:
        return f"HTTP {status}: {data}", {}
    body = json.loads(data)
    return body["choices"][0]["message"]["content"], body["usage"]


def tier_hits(port):
    """{tier: prompt blocks served from it} from /metrics."""
    out = {}
    for line in request(port, "/metrics", timeout=10)[1].splitlines():
        if line.startswith("deepinfer_kv_tier_hits_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


def tiers_and_roles(single_port):
    """Tensor parallel with the host and disk tiers and with the prefill/decode roles: blocks rank 0 writes into its
    cache from outside a pass (a tier's load, a transfer's import) are written on rank 1 too. Were they not, rank 1's
    heads would read other prompts' latents there and the text would differ from the one-process server's."""
    base = "You are the Debian documentation assistant; answer briefly and exactly. " * 60  # ~700 tokens, 10 blocks
    systems = [f"Conversation {i}. {base}" for i in range(4)]
    question = "What does apt-get do?"
    want = [answer_with_system(single_port, s, question)[0] for s in systems]
    disk = os.path.join(logdir, "kv-disk")
    # 21 device blocks: each 10-block prompt pushes the one before it out to the host tier.
    tier_args = ["--tensor-parallel-size", "2", "--kv-cache-memory", "2MiB", "--max-model-len", "1024",
                 "--kv-host-cache-memory", "32MiB", "--tiered-kv-storage-path", disk]
    tiers, tiers_port, _ = start("tp2-tiers", *tier_args)
    got = [answer_with_system(tiers_port, s, question)[0] for s in systems[:3]]
    again, usage = answer_with_system(tiers_port, systems[0], question)
    hits = tier_hits(tiers_port)
    check(got == want[:3] and again == want[0] and hits.get("host", 0) >= 9,
          f"TP=2 with host and disk tiers: the same text, the first prompt again after two others: "
          f"{usage.get('prompt_tokens_details', {}).get('cached_tokens')} tokens cached, blocks from the tiers {hits}")
    tiers.send_signal(signal.SIGTERM)
    code = tiers.wait(timeout=30)
    tiers, tiers_port, _ = start("tp2-tiers-restart", *tier_args)
    again, usage = answer_with_system(tiers_port, systems[1], question)
    hits = tier_hits(tiers_port)
    check(code == 0 and again == want[1] and hits.get("disk", 0) >= 9,
          f"TP=2 restarted on the same disk tier: the same text from the disk's blocks {hits}")
    tiers.send_signal(signal.SIGTERM)
    tiers.wait(timeout=30)
    # With MTP drafts too: the MTP layer's cache is one more layer of every block, written on both ranks as well.
    mtp_args = [a if a != disk else disk + "-mtp" for a in tier_args] + ["--speculative-algorithm", "mtp",
                                                                         "--speculative-num-draft-tokens", "2"]
    spec, spec_port, _ = start("tp2-tiers-mtp", *mtp_args)
    got = [answer_with_system(spec_port, s, question)[0] for s in systems[:3]]
    again, usage = answer_with_system(spec_port, systems[0], question)
    hits, accepted = tier_hits(spec_port), metrics(spec_port).get("deepinfer_spec_accepted_tokens_total", 0)
    check(got == want[:3] and again == want[0] and hits.get("host", 0) >= 9 and accepted > 0,
          f"TP=2 with MTP drafts and the tiers: the same text, blocks from the tiers {hits}, {accepted:.0f} drafts "
          "accepted")
    spec.send_signal(signal.SIGTERM)
    spec.wait(timeout=30)

    # A tensor-parallel prefill worker exports from rank 0's cache; a tensor-parallel decode worker imports into both.
    kv_port = free_port()
    prefill, prefill_port, _ = start("tp2-prefill", "--tensor-parallel-size", "2", "--role", "prefill",
                                     "--kv-transfer-port", str(kv_port))
    decode, decode_port, _ = start("tp2-decode", "--tensor-parallel-size", "2", "--role", "decode")
    received = 'deepinfer_kv_transfer_blocks_total{direction="received"}'
    before = metrics(decode_port).get(received, 0)
    got, usage = answer_with_system(decode_port, systems[3], question,
                                    headers={"X-KV-Prefill-Endpoint": f"127.0.0.1:{kv_port}"})
    moved = metrics(decode_port).get(received, 0) - before
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    check(got == want[3] and moved >= 10 and cached == moved * 64,
          f"TP=2 prefill worker -> TP=2 decode worker: the same text, {moved:.0f} blocks moved, {cached} tokens "
          "reused from them")
    for p in (prefill, decode):
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def spec_counts(port):
    m = metrics(port)
    return (m.get("deepinfer_spec_draft_tokens_total", 0), m.get("deepinfer_spec_accepted_tokens_total", 0))


def spec_drafts(single_port, prompts):
    """Speculative decoding with tensor parallel: the MTP layer's pass, and the DSpark module's injection and block
    passes, run on both ranks (split as decoder layers; the module's compact head whole on each). The text equals
    plain decoding's (verification is exact), and the drafts and their acceptance equal a one-process server's: a
    wrong draft pass would still give the right text, but not the same acceptance. DSpark with the step-time table
    'const' (every draft the confidence rule keeps is verified), so that its choices do not follow measured times."""
    texts = {"plain": [ask(single_port, p, max_tokens=32) for p in prompts]}
    for name, flags in (("MTP drafts (K=2)", ["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "2"]),
                        ("DSpark's module", ["--dspark-enable", "--dspark-step-time-table", "const"])):
        tag = "mtp" if name.startswith("MTP") else "dspark"
        one, one_port, _ = start(f"{tag}-tp1", *flags)
        two, two_port, _ = start(f"{tag}-tp2", "--tensor-parallel-size", "2", *flags)
        for run, port in (("tp1", one_port), ("tp2", two_port)):
            texts[run] = [ask(port, p, max_tokens=32) for p in prompts]
        counts = {run: spec_counts(port) for run, port in (("tp1", one_port), ("tp2", two_port))}
        check(texts["tp2"] == texts["plain"] and texts["tp1"] == texts["plain"],
              f"{name} with TP=2: the text of plain decoding")
        check(counts["tp2"] == counts["tp1"] and counts["tp1"][1] > 0,
              f"{name} with TP=2: the same drafts and acceptance as one process (drafted, accepted: {counts})")
        for p in (one, two):
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)


def main():
    prompts = ["What is Debian?", "How do I install a package with apt?", "Write a haiku about the kernel.",
               "List three file systems."]
    single, single_port, _ = start("single")
    tp, tp_port, tp_log = start("tp2", "--tensor-parallel-size", "2")
    r1 = rank1_pid(tp_port)
    check(r1 is not None, "rank 1 runs as its own process")
    for i, prompt in enumerate(prompts):
        want = ask(single_port, prompt)
        got = ask(tp_port, prompt, stream=(i % 2 == 1))
        check(got == want and not want.startswith("HTTP"), f"greedy identity ({'streamed' if i % 2 else 'plain'}): "
              f"{prompt!r} -> {got[:40]!r}")
    # Concurrent requests: batched steps across the two ranks.
    results = concurrent(tp_port, prompts * 2)
    want = {k: ask(single_port, p, max_tokens=16) for k, p in enumerate(prompts * 2)}
    check(results == want, "8 concurrent requests (batched steps) give the one-process server's text")

    # Experts over the ranks, EPLB moving them between passes while requests run.
    ep, ep_port, ep_log = start("tp2-ep2", "--tensor-parallel-size", "2", "--expert-parallel-size", "2",
                                "--num-redundant-experts", "2", "--enable-eplb", "--eplb-rebalance-num-iterations", "5")
    results = concurrent(ep_port, prompts * 2)
    check(results == want, "expert parallel + EPLB: 8 concurrent requests give the one-process server's text")
    metrics = request(ep_port, "/metrics", timeout=10)[1]
    rebalances = [line for line in metrics.splitlines() if line.startswith("deepinfer_eplb_rebalances_total ")]
    count = int(float(rebalances[0].split()[1])) if rebalances else 0
    check(count > 0, f"EPLB rebalanced {count} times during the requests")
    check('deepinfer_moe_expert_tokens_total{moe_layer="0",expert="0"}' in metrics, "per-expert load in /metrics")
    ep.send_signal(signal.SIGTERM)
    ep.wait(timeout=30)
    tiers_and_roles(single_port)
    spec_drafts(single_port, prompts)
    single.send_signal(signal.SIGTERM)

    # kill -9 rank 1 while requests run: rank 0 exits non-zero within 10 s; the requests get a 503 saying why.
    inflight = {}

    def long_request(k):
        inflight[k] = request(tp_port, "/v1/chat/completions", chat(prompts[k], 1500, model="demo"), timeout=60)

    threads = [threading.Thread(target=long_request, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(r1, signal.SIGKILL)
    t0 = time.time()
    try:
        code = tp.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code = None
    check(code is not None and code != 0, f"kill -9 rank 1: rank 0 exited ({code}) after {time.time() - t0:.1f} s")
    check("tensor-parallel rank 1" in log_text(tp_log), "rank 0's log names the dead rank")
    for t in threads:
        t.join(timeout=30)
    got = [inflight.get(k, (None, "")) for k in range(2)]
    check(all(status == 503 and "tensor-parallel group failed" in body for status, body in got),
          f"requests in flight when rank 1 died: 503 naming the group ({[(s, b[:100]) for s, b in got]})")

    # kill -9 rank 0: rank 1 goes with it.
    tp, tp_port, _ = start("tp2-b", "--tensor-parallel-size", "2")
    r1 = rank1_pid(tp_port)
    tp.kill()
    t0 = time.time()
    while r1 and alive(r1) and time.time() - t0 < 10:
        time.sleep(0.1)
    check(r1 is not None and not alive(r1), f"kill -9 rank 0: rank 1 gone after {time.time() - t0:.1f} s")

    # SIGTERM: both exit 0.
    tp, tp_port, _ = start("tp2-c", "--tensor-parallel-size", "2")
    r1 = rank1_pid(tp_port)
    tp.send_signal(signal.SIGTERM)
    try:
        code = tp.wait(timeout=30)
    except subprocess.TimeoutExpired:
        code = None
    t0 = time.time()
    while r1 and alive(r1) and time.time() - t0 < 10:
        time.sleep(0.1)
    check(code == 0 and r1 is not None and not alive(r1), f"SIGTERM: rank 0 exited {code}, rank 1 gone")

    # SIGTERM to every process of the group at once (kill $(pgrep ...), systemd's control-group stop) while a stream
    # runs: rank 1 leaves it to rank 0, which drains the stream, then stops rank 1; all exit 0.
    tp, tp_port, _ = start("tp2-d", "--tensor-parallel-size", "2")
    r1 = rank1_pid(tp_port)
    streamed = {}

    def stream_worker():
        streamed["text"] = ask(tp_port, prompts[0], stream=True, max_tokens=48)

    t = threading.Thread(target=stream_worker)
    t.start()
    time.sleep(0.5)
    os.kill(r1, signal.SIGTERM)
    tp.send_signal(signal.SIGTERM)
    t.join(timeout=60)
    try:
        code = tp.wait(timeout=30)
    except subprocess.TimeoutExpired:
        code = None
    check(streamed.get("text", "").startswith("The") and not streamed.get("text", "").startswith("HTTP"),
          f"SIGTERM to both ranks mid-stream: the stream finished ({streamed.get('text', '')[:40]!r})")
    t0 = time.time()
    while r1 and alive(r1) and time.time() - t0 < 10:
        time.sleep(0.1)
    check(code == 0 and r1 is not None and not alive(r1), f"SIGTERM to both: rank 0 exited {code}, rank 1 gone")

    # Two hosts (--nnodes 2, here both on loopback): TP=4, ranks 0-1 on host 0, 2-3 on host 1.
    def two_hosts(name):
        master = free_port()
        common = ["--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
                  str(master)]
        log1 = open(os.path.join(logdir, name + "-node1.log"), "w+")
        node1 = subprocess.Popen([BIN, "serve", "--model-path", MODEL, "--device", "cpu", "--host", "127.0.0.1",
                                  "--port", str(free_port()), *common, "--node-rank", "1"],
                                 stdout=log1, stderr=subprocess.STDOUT)
        procs.append(node1)
        node0, port, log0 = start(name, *common, "--node-rank", "0")
        out = subprocess.run(["pgrep", "-f", "--", f"--master-port {master} .*--internal-tp-rank"],
                             capture_output=True, text=True)
        local = [int(x) for x in out.stdout.split()]
        seen_ranks.extend(local + [node1.pid])
        return node0, port, log0, node1, log1, local

    node0, port0, log0, node1, _, local = two_hosts("hosts")
    check(len(local) == 2, f"each host's first rank started its host's other rank ({len(local)} started)")
    results = concurrent(port0, prompts * 2)
    check(results == want, "two hosts (TP=4, --nnodes 2): 8 concurrent requests give the one-process server's text")
    node1.kill()  # kill -9 host 1's node leader: its rank goes with it, rank 0 notices the silent host
    t0 = time.time()
    try:
        code = node0.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code = None
    check(code is not None and code != 0, f"kill -9 host 1: rank 0 exited ({code}) after {time.time() - t0:.1f} s")
    check("host 1 (ranks 2 to 3)" in log_text(log0) or "collective failed" in log_text(log0),
          "rank 0's log says why")
    node0, port0, _, node1, log1, local = two_hosts("hosts-b")
    node0.kill()  # kill -9 rank 0: host 1's ranks stop within 10 s
    t0 = time.time()
    while (node1.poll() is None or any(alive(pid) for pid in local)) and time.time() - t0 < 10:
        time.sleep(0.1)
    check(node1.poll() not in (None, 0) and not any(alive(pid) for pid in local),
          f"kill -9 rank 0: host 1 exited ({node1.poll()}) and every rank is gone after {time.time() - t0:.1f} s")

    # A second process with host 1's --node-rank: whichever claims the index second is refused, naming it, and the
    # group serves (regression: both joined).
    master = free_port()
    common = ["--tensor-parallel-size", "4", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
              str(master)]
    twins = [launch(f"twin-{k}", *common, "--node-rank", "1") for k in range(2)]
    node0, port0, log0 = start("twins-node0", *common, "--node-rank", "0")
    seen_ranks.extend(ranks_at(master))
    t0 = time.time()
    while all(p.poll() is None for p, _ in twins) and time.time() - t0 < 30:
        time.sleep(0.1)
    refused = [(p, log) for p, log in twins if p.poll() is not None]
    check(len(refused) == 1 and refused[0][0].returncode != 0, "two processes with --node-rank 1: one is refused "
          f"(exit codes {[p.poll() for p, _ in twins]})")
    check(bool(refused) and "--node-rank 1: another process already joined this group as node 1" in
          log_text(refused[0][1]), "the refused one names the duplicate node rank")
    check(ask(port0, prompts[0], max_tokens=16) == want[0], "the group serves with the first node 1")
    codes = stop_group(node0, [t for t in twins if t not in refused])
    check(codes == [0, 0], f"SIGTERM to rank 0 of two hosts: rank 0 and host 1 exit 0 ({codes})")

    # SIGSTOP rank 0: host 1's node leader notices rank 0's silent heartbeat (and its store not answering).
    node0, port0, _, node1, log1, local = two_hosts("stop-rank0")
    os.kill(node0.pid, signal.SIGSTOP)
    t0 = time.time()
    try:
        code = node1.wait(timeout=15)
    except subprocess.TimeoutExpired:
        code = None
    elapsed = time.time() - t0
    node0.kill()
    check(code not in (None, 0) and elapsed < 10, f"SIGSTOP rank 0: host 1 exited ({code}) after {elapsed:.1f} s")
    check("rank 0's host (node 0)" in log_text(log1) and "has not answered" in log_text(log1),
          "host 1's log says rank 0 stopped answering")
    wait_gone(local)
    check(not any(alive(pid) for pid in local), "SIGSTOP rank 0: every rank of host 1 is gone")

    # SIGTERM to host 1's node leader: it stops its ranks and leaves; rank 0 stops the server naming host 1 and why.
    node0, port0, log0, node1, log1, local = two_hosts("term-node1")
    host1_rank = children(node1.pid)
    node1.send_signal(signal.SIGTERM)
    t0 = time.time()
    try:
        code0 = node0.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code0 = None
    elapsed = time.time() - t0
    try:
        code1 = node1.wait(timeout=5)
    except subprocess.TimeoutExpired:
        code1 = None
    check(code1 == 0 and not any(alive(pid) for pid in host1_rank),
          f"SIGTERM host 1's node leader: it exited {code1} with its rank gone")
    check(code0 not in (None, 0), f"SIGTERM host 1's node leader: rank 0 exited ({code0}) after {elapsed:.1f} s")
    check("host 1 (ranks 2 to 3) left the group" in log_text(log0) and "SIGTERM" in log_text(log0),
          "rank 0's log names host 1 and the signal")
    wait_gone(local)

    # Hosts that disagree on the group's shape: both exit non-zero naming the flag and both values.
    for name, node1_args, words in [
            ("shape-tp", ["--tensor-parallel-size", "2", "--nnodes", "2"],
             "node 1 says --tensor-parallel-size 2, node 0 says 4"),
            ("shape-nnodes", ["--tensor-parallel-size", "4", "--nnodes", "4"], "node 1 says --nnodes 4, node 0 says 2")]:
        master = free_port()
        at = ["--master-addr", "127.0.0.1", "--master-port", str(master)]
        n1, l1 = launch(name + "-node1", *node1_args, *at, "--node-rank", "1")
        n0, l0 = launch(name + "-node0", "--tensor-parallel-size", "4", "--nnodes", "2", *at, "--node-rank", "0")
        codes = []
        for p in (n0, n1):
            try:
                codes.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:
                codes.append(None)
        seen_ranks.extend(ranks_at(master))
        check(all(c not in (None, 0) for c in codes), f"{' '.join(node1_args)} on host 1: both exit non-zero ({codes})")
        check(words in log_text(l0) and words in log_text(l1), f"both logs say {words!r}")

    # A stream in flight when host 1 stops (SIGSTOP: rank 0's step waits in a collective): it ends with an error
    # event before rank 0 exits, not a cut connection.
    node0, port0, log0, node1, log1, local = two_hosts("stream-stop")
    conn = http.client.HTTPConnection("127.0.0.1", port0, timeout=60)
    body = {"model": "demo", "messages": [{"role": "user", "content": "Write a long story about the Debian project."}],
            "max_tokens": 1500, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    lines = []
    while True:  # the first token: the stream is running
        line = resp.readline().decode()
        lines.append(line)
        if not line or ('"content"' in line and line.startswith("data: ")):
            break
    host1 = [node1.pid] + children(node1.pid)
    for pid in host1:
        os.kill(pid, signal.SIGSTOP)
    t0 = time.time()
    try:
        while True:
            line = resp.readline().decode()
            if not line:
                break
            lines.append(line)
    except OSError as e:
        lines.append(f"<{e}>")
    errors = [line for line in lines if line.startswith('data: {"error"')]
    check(bool(errors), f"SIGSTOP host 1 mid-stream: the stream ends with an error event after {time.time() - t0:.1f} s "
          f"({(errors or lines[-1:])[0].strip()[:160]!r})")
    check(bool(errors) and "tensor-parallel group failed" in errors[0], "the error event says the group failed")
    try:
        code = node0.wait(timeout=10)
    except subprocess.TimeoutExpired:
        code = None
    check(code not in (None, 0), f"SIGSTOP host 1: rank 0 exited ({code}) after {time.time() - t0:.1f} s")
    for pid in host1:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    wait_gone(local)

    # Refusals at startup.
    for args, words in [(["--tensor-parallel-size", "2", "--nnodes", "2"], "explicit --master-port"),
                        (["--tensor-parallel-size", "2", "--nnodes", "4", "--master-port", "29999"], "must divide"),
                        (["--cluster-nodes", "3", "--tensor-parallel-size", "2", "--master-port", "29999"],
                         "--cluster-nodes 3"),
                        (["--tensor-parallel-size", "2", "--node-rank", "1"], "a host index"),
                        (["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", "29999", "--node-rank", "2"],
                         "a host index"),
                        (["--tensor-parallel-size", "2", "--role", "prefill", "--kv-transfer-port", "29998",
                          "--master-port", "29998"], "is also --kv-transfer-port"),
                        (["--tensor-parallel-size", "3"], "num_attention_heads"),
                        (["--tensor-parallel-size", "0"], "at least 1"),
                        (["--tensor-parallel-size", "2", "--expert-parallel-size", "4"], "the experts spread over the tensor-parallel ranks"),
                        (["--tensor-parallel-size", "2", "--expert-parallel-size", "2", "--num-redundant-experts", "1"],
                         "does not divide"),
                        (["--tensor-parallel-size", "2", "--master-addr", "0.0.0.0"], "not a wildcard"),
                        (["--tensor-parallel-size", "2", "--expert-parallel-size", "2", "--eplb-policy", "hierarchical"],
                         "applies with --enable-eplb")]:
        out = subprocess.run([BIN, "serve", "--model-path", MODEL, "--device", "cpu", "--port", str(free_port()),
                              *args], capture_output=True, text=True, timeout=60)
        check(out.returncode != 0 and words in out.stderr, f"refused {' '.join(args)}: {out.stderr.strip()[:120]}")
    # No GPU here: every rank says so and the group goes down (on GPUs, rank r takes GPU r and NCCL links them).
    out = subprocess.run([BIN, "serve", "--model-path", MODEL, "--device", "cuda", "--tensor-parallel-size", "2",
                          "--port", str(free_port())], capture_output=True, text=True, timeout=60)
    check(out.returncode != 0 and "cuda" in out.stderr.lower(),
          f"--device cuda --tensor-parallel-size 2 without GPUs fails: {out.stderr.strip()[:120]}")
    leftover = [pid for pid in seen_ranks if alive(pid)]
    check(not leftover, f"no rank process left behind (of {len(seen_ranks)} started)")


try:
    main()
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
print("FAILED: " + "; ".join(failures) if failures else "all passed")
sys.exit(1 if failures else 0)
