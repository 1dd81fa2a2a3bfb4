#!/usr/bin/env python3
"""`deepinfer serve --data-parallel-size 2` end to end on the CPU (issue 18: the server over attention data-parallel
groups): two servers, each its own scheduler, KV cache and HTTP port, started separately (vLLM's external load
balancing), the demo model's 16 routed experts spread over them (8 + 1 redundant slots each), every MoE layer's
tokens exchanged all-to-all over Gloo on loopback, their passes in lock step; `deepinfer router` in front.

Checks:
  - greedy identity: requests to rank 0 alone (rank 1 idle: it passes with no tokens), to rank 1 alone, to both at
    once and through the router equal a one-process server's text, with EPLB moving experts between the ranks every
    5 passes while they run (rebalances counted on both ranks);
  - a third process claiming rank 1 is refused naming it, and the group keeps serving; a rank 1 whose expert flags
    differ from rank 0's is refused naming the flag and both values, and claims nothing (the right one then joins);
  - SIGSTOP rank 1 (a hung peer): rank 0's /health answers 503 within --health-max-step-seconds (2) + 1 s; after
    SIGCONT, 200 again and the group serves;
  - kill -9 rank 1 while rank 0 decodes: rank 0's request gets a 503 naming the data-parallel group and rank 0 exits
    non-zero within 10 s; SIGTERM to rank 1: it exits 0, rank 0 exits non-zero saying rank 1 was stopped; SIGTERM to
    rank 1 while rank 0 is stopped: rank 1 exits within --shutdown-timeout-s + 15 s;
  - a prefill pool of two data-parallel ranks feeding a decode pool of two through `deepinfer router --prefill
    --decode`: long prompts give the one-process text, their KV blocks sent by the prefill ranks and received by the
    decode ranks; kill -9 decode rank 1 while rank 0's requests wait for their KV blocks (a prefill peer that never
    answers): rank 0 answers each with a 503 and exits non-zero (regression: it exited, cutting their connections);
  - speculative decoding (MTP K=2, DSpark with the demo's module) on two ranks gives the one-process text, the MTP
    drafts accepted at the demo's rate; ranks whose DSpark step-time files differ agree to measure again;
  - tensor parallel inside each rank (DP=2 x TP=2, four processes) gives the one-process text with EPLB running;
    SIGTERM to both ranks while they answer: every request answered, both exit 0 (they leave together);
  - what data parallel does not take is refused at startup with a message naming it.
Usage: dp_serve_e2e.py DEEPINFER_BINARY MODEL_DIR
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from harness import (chat, check, content, exit_failed, failures, free_port, init, metrics, request, start, stop_all,
                     wait_health)

BIN, MODEL, logdir = init("dp-e2e-")
PROMPTS = ["What is Debian?", "How do I install a package with apt?", "Write a haiku about the kernel.",
           "List three file systems.", "What does dpkg do?", "Name a text editor."]


def answer(port, prompt, max_tokens=16):
    status, body = request(port, "/v1/chat/completions", chat(prompt, max_tokens, model="demo"), timeout=120)
    return content(body) if status == 200 else f"HTTP {status}: {body}"


def all_at_once(jobs):
    """jobs: [(port, prompt)]; their answers, in order, sent concurrently."""
    out = [None] * len(jobs)

    def run(k, port, prompt):
        out[k] = answer(port, prompt)

    threads = [threading.Thread(target=run, args=(k, port, prompt)) for k, (port, prompt) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def serve(name, port, *args):
    return start(name, ["serve", "--model-path", MODEL, "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                        *args])


def exit_code(p, seconds):
    """The process's exit code once it exits within `seconds`, else None."""
    try:
        return p.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def log_text(name):
    with open(os.path.join(logdir, name + ".log")) as f:
        return f.read()


def main():
    sport = free_port()
    serve("single", sport)
    master = free_port()
    ports = [free_port(), free_port()]
    group = ["--data-parallel-size", "2", "--expert-parallel-size", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(master), "--num-redundant-experts", "2", "--enable-eplb",
             "--eplb-rebalance-num-iterations", "5", "--health-max-step-seconds", "2"]
    ranks = [serve(f"rank{r}", ports[r], *group, "--data-parallel-rank", str(r)) for r in (1, 0)][::-1]
    check(all(wait_health(p, seconds=120) for p in [sport] + ports), "the one-process server and both ranks healthy")
    want = {p: answer(sport, p) for p in PROMPTS}

    got0 = [answer(ports[0], p) for p in PROMPTS[:2]]
    check(got0 == [want[p] for p in PROMPTS[:2]], f"rank 0 alone (rank 1 idle): the one-process text ({got0[0][:40]!r})")
    got1 = [answer(ports[1], p) for p in PROMPTS[2:4]]
    check(got1 == [want[p] for p in PROMPTS[2:4]], f"rank 1 alone (rank 0 idle): the one-process text ({got1[0][:40]!r})")
    jobs = [(ports[k % 2], p) for k, p in enumerate(PROMPTS * 2)]
    both = all_at_once(jobs)
    check(both == [want[p] for _, p in jobs], "12 requests over both ranks at once: the one-process text")
    rebalances = [metrics(p).get("deepinfer_eplb_rebalances_total", 0) for p in ports]
    check(all(r > 0 for r in rebalances) and rebalances[0] == rebalances[1],
          f"EPLB rebalanced on both ranks together while they ran: {rebalances}")
    m = metrics(ports[1])
    exchange = m.get('deepinfer_moe_exchange_seconds_total{phase="dispatch"}', 0) + \
        m.get('deepinfer_moe_exchange_seconds_total{phase="combine"}', 0)
    passes = m.get("deepinfer_moe_pass_seconds_total", 0)
    check(0 < exchange < passes, f"rank 1's all-to-all time {exchange:.3f} s of {passes:.3f} s in passes (/metrics)")

    rport = free_port()
    start("router", ["router", "--worker", f"http://127.0.0.1:{ports[0]}", "--worker", f"http://127.0.0.1:{ports[1]}",
                     "--model-path", MODEL, "--host", "127.0.0.1", "--port", str(rport),
                     "--health-check-interval-ms", "200"])
    check(wait_health(rport, seconds=60), "the router in front of the two ranks healthy")
    time.sleep(0.5)
    routed = all_at_once([(rport, p) for p in PROMPTS])
    served = [sum(v for k, v in metrics(p).items() if k.startswith("deepinfer_requests_total{")) for p in ports]
    check(routed == [want[p] for p in PROMPTS], f"6 requests through the router: the one-process text (served {served})")

    # A second process claiming rank 1 while the group serves.
    twin = serve("twin", free_port(), *group, "--data-parallel-rank", "1")
    code = exit_code(twin, 60)
    check(code not in (None, 0) and "another process already joined this group as rank 1" in log_text("twin"),
          f"a second --data-parallel-rank 1 is refused naming it (exit {code})")
    check(answer(ports[0], PROMPTS[0]) == want[PROMPTS[0]], "the group still serves")

    # SIGSTOP rank 1 (a hung peer): rank 0's engine waits in the lock-step all-reduce, so its /health answers 503
    # past --health-max-step-seconds 2 (the router takes it out of rotation); after SIGCONT, 200 again and it serves.
    ranks[1].send_signal(signal.SIGSTOP)
    t0, unhealthy = time.time(), None
    while time.time() - t0 < 10 and unhealthy is None:
        status, body = request(ports[0], "/health", timeout=5)
        if status == 503:
            unhealthy = (time.time() - t0, body)
        time.sleep(0.2)
    busy = metrics(ports[0]).get("deepinfer_engine_busy_seconds", 0)
    ranks[1].send_signal(signal.SIGCONT)
    t1, healthy_again = time.time(), None
    while time.time() - t1 < 10 and healthy_again is None:
        if request(ports[0], "/health", timeout=5)[0] == 200:
            healthy_again = time.time() - t1
        time.sleep(0.1)
    check(unhealthy is not None and unhealthy[0] < 5 and "may be hung" in unhealthy[1] and busy > 2 and
          healthy_again is not None and answer(ports[0], PROMPTS[0]) == want[PROMPTS[0]],
          f"SIGSTOP rank 1: rank 0's /health 503 after {unhealthy[0] if unhealthy else None!r:.4} s (engine busy "
          f"{busy:.1f} s), 200 again {healthy_again!r:.4} s after SIGCONT, and it serves")

    # kill -9 rank 1 while rank 0 decodes a long answer: rank 0's request gets a 503 naming the group, rank 0 exits.
    inflight = {}

    def long_request():
        inflight["r"] = request(ports[0], "/v1/chat/completions", chat(PROMPTS[0], 1500, model="demo"), timeout=60)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    ranks[1].kill()
    t0 = time.time()
    code = exit_code(ranks[0], 10)
    elapsed = time.time() - t0
    t.join(timeout=30)
    status, body = inflight.get("r", (None, ""))
    check(status == 503 and ("data-parallel group failed" in body or "expert-parallel group failed" in body),
          f"kill -9 rank 1 mid-request: rank 0's request got {status} {body[:120]!r}")
    check(code not in (None, 0) and elapsed < 10, f"kill -9 rank 1: rank 0 exited ({code}) after {elapsed:.1f} s")

    # SIGTERM to rank 1 of a fresh pair: it drains, keeps making the group's passes for rank 0 until its
    # --shutdown-timeout-s (3) is spent, and exits 0; rank 0 stops too, naming why.
    master, ports = free_port(), [free_port(), free_port()]
    pair = ["--data-parallel-size", "2", "--expert-parallel-size", "2", "--master-addr", "127.0.0.1", "--master-port",
            str(master), "--shutdown-timeout-s", "3"]
    rank0 = serve("term-rank0", ports[0], *pair, "--data-parallel-rank", "0")
    # A rank 1 whose expert flags differ from rank 0's is refused naming the flag (regression: the group formed and
    # answered wrongly), and claims nothing: the right rank 1 then joins.
    wrong = serve("wrong-rank1", free_port(), *pair, "--data-parallel-rank", "1", "--num-redundant-experts", "2")
    code = exit_code(wrong, 60)
    check(code not in (None, 0) and "--num-redundant-experts 2 on rank 1, but rank 0 says 0" in log_text("wrong-rank1"),
          f"a rank 1 with other expert flags is refused naming the flag (exit {code})")
    stopped = [rank0, serve("term-rank1", ports[1], *pair, "--data-parallel-rank", "1")]
    check(all(wait_health(p, seconds=120) for p in ports), "then the right rank 1 joins: the pair healthy")
    stopped[1].terminate()
    codes = [exit_code(p, 15) for p in stopped]
    check(codes[1] == 0 and codes[0] not in (None, 0) and "rank 1 was stopped" in log_text("term-rank0"),
          f"SIGTERM to rank 1: it exits {codes[1]}, rank 0 exits {codes[0]} saying rank 1 was stopped")

    # SIGTERM to rank 1 while rank 0 is stopped (SIGSTOP: it serves the store, and rank 1's engine waits in a
    # collective on it): rank 1 still exits, within --shutdown-timeout-s + 15 s (regression: it stayed up until rank 0
    # resumed, and for good when its group failed while rank 0's store hung).
    master, ports = free_port(), [free_port(), free_port()]
    pair = ["--data-parallel-size", "2", "--expert-parallel-size", "2", "--master-addr", "127.0.0.1", "--master-port",
            str(master), "--shutdown-timeout-s", "1"]
    hung = [serve(f"hung-rank{r}", ports[r], *pair, "--data-parallel-rank", str(r)) for r in (0, 1)]
    check(all(wait_health(p, seconds=120) for p in ports), "a third pair healthy")
    hung[0].send_signal(signal.SIGSTOP)
    time.sleep(0.5)
    hung[1].terminate()
    t0 = time.time()
    code = exit_code(hung[1], 30)
    elapsed = time.time() - t0
    hung[0].kill()
    check(code is not None and elapsed < 20 and "did not stop within 16 s" in log_text("hung-rank1"),
          f"SIGTERM to rank 1 while rank 0 is stopped: rank 1 exits ({code}) after {elapsed:.1f} s")

    # Disaggregated: a prefill pool of two data-parallel ranks feeding a decode pool of two through the router (the
    # way DeepSeek's fleet runs both pools); prompts past --max-local-prefill-tokens (512) go to the prefill ranks.
    long_prompts = ["You answer questions about Debian packages, briefly. " * 90 + q for q in PROMPTS[:4]]
    want_long = [answer(sport, p) for p in long_prompts]
    pools, procs = {}, {}
    for role in ("prefill", "decode"):
        master, pports = free_port(), [free_port(), free_port()]
        pool = ["--role", role, "--data-parallel-size", "2", "--expert-parallel-size", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(master)]
        for r in (0, 1):
            kv = ["--kv-transfer-port", str(free_port())] if role == "prefill" else []
            procs[(role, r)] = serve(f"{role}-rank{r}", pports[r], *pool, "--data-parallel-rank", str(r), *kv)
        pools[role] = pports
    check(all(wait_health(p, seconds=120) for p in pools["prefill"] + pools["decode"]),
          "a prefill pool and a decode pool of two data-parallel ranks each healthy")
    pd_port = free_port()
    urls = {role: ",".join(f"http://127.0.0.1:{p}" for p in pools[role]) for role in pools}
    start("pd-router", ["router", "--prefill", urls["prefill"], "--decode", urls["decode"], "--model-path", MODEL,
                        "--host", "127.0.0.1", "--port", str(pd_port), "--health-check-interval-ms", "200"])
    check(wait_health(pd_port, seconds=60), "the router in front of both pools healthy")
    time.sleep(0.5)
    got = all_at_once([(pd_port, p) for p in long_prompts])
    received = [metrics(p).get('deepinfer_kv_transfer_blocks_total{direction="received"}', 0) for p in pools["decode"]]
    sent = [metrics(p).get('deepinfer_kv_transfer_blocks_total{direction="sent"}', 0) for p in pools["prefill"]]
    check(got == want_long and sum(received) > 0 and sum(received) == sum(sent),
          f"4 long prompts through prefill and decode pools of data-parallel ranks: the one-process text, KV blocks "
          f"sent {sent}, received {received}")

    # kill -9 decode rank 1 while three requests on decode rank 0 wait for their KV blocks from a prefill peer that
    # accepts and never answers (prompts no rank has cached): rank 0's group fails, and each of them gets a 503 before
    # rank 0 exits non-zero.
    stall = socket.socket()
    stall.bind(("127.0.0.1", 0))
    stall.listen(16)
    waiting = {}

    def fetching(k):
        try:
            waiting[k] = request(pools["decode"][0], "/v1/chat/completions", chat(f"Case {k}. " + long_prompts[k], 16, model="demo"),
                                 headers={"X-KV-Prefill-Endpoint": f"127.0.0.1:{stall.getsockname()[1]}"}, timeout=60)
        except OSError as e:
            waiting[k] = (None, f"no response: {e}")

    threads = [threading.Thread(target=fetching, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    procs[("decode", 1)].kill()
    t0 = time.time()
    code = exit_code(procs[("decode", 0)], 15)
    elapsed = time.time() - t0
    for t in threads:
        t.join(timeout=30)
    stall.close()
    statuses = [waiting.get(k, (None, "no answer"))[0] for k in range(3)]
    # ... each naming why (regression: a bare "the server is shutting down").
    named = all("group failed" in str(waiting.get(k, ("", ""))[1]) for k in range(3))
    check(statuses == [503] * 3 and named and code not in (None, 0),
          f"kill -9 decode rank 1 while 3 requests on rank 0 wait for KV blocks: they got {statuses} "
          f"({str(waiting.get(0, ('', ''))[1])[:100]!r}), rank 0 exited {code} after {elapsed:.1f} s")

    # A rank 1 that joins and then cannot start its server (its --kv-transfer-port is taken): rank 0 stops, saying
    # so (regression: rank 0 said rank 1 had been stopped with SIGTERM).
    master, taken = free_port(), socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    pair = ["--role", "prefill", "--data-parallel-size", "2", "--expert-parallel-size", "2", "--master-addr",
            "127.0.0.1", "--master-port", str(master)]
    late = [serve("late-rank0", free_port(), *pair, "--data-parallel-rank", "0", "--kv-transfer-port",
                  str(free_port())),
            serve("late-rank1", free_port(), *pair, "--data-parallel-rank", "1", "--kv-transfer-port",
                  str(taken.getsockname()[1]))]
    codes = [exit_code(p, 90) for p in late]
    taken.close()
    check(codes[0] not in (None, 0) and codes[1] not in (None, 0) and
          "rank 1 failed to start its server" in log_text("late-rank0"),
          f"a rank 1 whose --kv-transfer-port is taken: both exit ({codes}), rank 0 saying rank 1 failed to start")

    # Speculative decoding on data-parallel ranks: each step's verify is the one target pass the ranks make in lock
    # step; the drafts are each rank's own (the MTP layer's experts are whole on every rank, the DSpark module is
    # dense). MTP K=2 and DSpark with the demo's module give the one-process text; the MTP drafts are the real ones
    # (accepted at the demo's rate; a rank drafting with only its own experts would not be). The DSpark pair starts
    # twice: the second time rank 0 has its step-time table file and rank 1 has none, and the ranks agree to measure
    # again (regression: rank 0 would skip the measurement's target passes while rank 1 waits in them).
    tables = os.path.join(logdir, "dspark-tables")
    for name, flags, restarts in [("mtp", ["--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "2"], 1),
                                  ("dspark", ["--dspark-enable", "--max-num-seqs", "4"], 2)]:  # few sizes to time
        for attempt in range(restarts):
            master, sports = free_port(), [free_port(), free_port()]
            pair = ["--data-parallel-size", "2", "--expert-parallel-size", "2", "--master-addr", "127.0.0.1",
                    "--master-port", str(master), *flags]
            spec = []
            for r in (0, 1):
                table = ["--dspark-step-time-table", os.path.join(tables, f"rank{r}-{attempt * r}.json")] \
                    if name == "dspark" else []
                spec.append(serve(f"{name}{attempt}-rank{r}", sports[r], *pair, "--data-parallel-rank", str(r),
                                  *table))
            healthy = all(wait_health(p, seconds=120) for p in sports)
            jobs = [(sports[k % 2], p) for k, p in enumerate(PROMPTS)]
            got = all_at_once(jobs) if healthy else []
            drafted = sum(metrics(p).get("deepinfer_spec_draft_tokens_total", 0) for p in sports) if healthy else 0
            accepted = sum(metrics(p).get("deepinfer_spec_accepted_tokens_total", 0) for p in sports) if healthy else 0
            measured = [log_text(f"{name}{attempt}-rank{r}").count("step times measured") for r in (0, 1)]
            enough = accepted >= 0.3 * drafted if name == "mtp" else True
            check(healthy and got == [want[p] for _, p in jobs] and enough and
                  (name == "mtp" or measured == [1, 1]),
                  f"{name} on two data-parallel ranks{' (rank 1 without its table file)' if attempt else ''}: "
                  f"6 requests give the one-process text; {accepted:.0f} of {drafted:.0f} drafts accepted; step "
                  f"times measured {measured}")
            for p in spec:
                p.terminate()
            for p in spec:
                exit_code(p, 30)

    # Tensor parallel inside each data-parallel rank (DP=2 x TP=2: four processes): each rank's leader starts its
    # tensor-parallel rank 1, which joins the expert exchange of index 1 with the other rank's; the experts spread
    # over the data-parallel ranks and split over each rank's tensor-parallel pair. EPLB moves them while they run.
    master, tports = free_port(), [free_port(), free_port()]
    pair = ["--data-parallel-size", "2", "--expert-parallel-size", "2", "--tensor-parallel-size", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(master), "--num-redundant-experts", "2",
            "--enable-eplb", "--eplb-rebalance-num-iterations", "5"]
    dptp = [serve(f"dptp-rank{r}", tports[r], *pair, "--data-parallel-rank", str(r)) for r in (0, 1)]
    healthy = all(wait_health(p, seconds=120) for p in tports)
    jobs = [(tports[k % 2], p) for k, p in enumerate(PROMPTS * 2)]
    got = all_at_once(jobs) if healthy else []
    rebalances = [metrics(p).get("deepinfer_eplb_rebalances_total", 0) for p in tports] if healthy else []
    check(healthy and got == [want[p] for _, p in jobs] and all(r > 0 for r in rebalances),
          f"DP=2 x TP=2 (four processes): 12 requests over both ranks give the one-process text; EPLB rebalances "
          f"{rebalances}")
    # SIGTERM to both ranks while they answer (an orchestrator stopping the deployment): each drains its own
    # requests while making the passes the other's still need, and they leave together: every request answered, both
    # exit 0 (regression: the rank that drained first left, and the other failed its requests and exited 1).
    stopping = {}
    drain_jobs = [(tports[k % 2], p) for k, p in enumerate(PROMPTS)]
    t = threading.Thread(target=lambda: stopping.update(got=all_at_once(drain_jobs)))
    t.start()
    time.sleep(1.0)
    for p in dptp:
        p.terminate()
    codes = [exit_code(p, 60) for p in dptp]
    t.join(timeout=60)
    check(stopping.get("got") == [want[p] for _, p in drain_jobs] and codes == [0, 0],
          f"SIGTERM to both DP x TP ranks mid-requests: all 6 answered with the one-process text, exits {codes}")

    # Refusals at startup.
    base = ["--data-parallel-size", "2", "--expert-parallel-size", "2", "--master-port", str(free_port())]
    for args, words in [(["--data-parallel-size", "2", "--expert-parallel-size", "2"], "explicit --master-port"),
                        (["--data-parallel-size", "2", "--master-port", "29997"], "give both the same size"),
                        (base + ["--data-parallel-rank", "2"], "a rank, 0 to"),
                        (["--data-parallel-rank", "1"], "a rank, 0 to"),
                        (base + ["--tensor-parallel-size", "2", "--nnodes", "2"], "run on its own host"),
                        (["--data-parallel-size", "2", "--expert-parallel-size", "2", "--master-port", "29996",
                          "--device", "cuda"], "runs on the CPU"),
                        (base + ["--master-addr", "0.0.0.0"], "not a wildcard"),
                        (["--data-parallel-size", "0"], "must be a whole number from 1")]:
        out = subprocess.run([BIN, "serve", "--model-path", MODEL, "--port", str(free_port()), *args],
                             capture_output=True, text=True, timeout=60)
        check(out.returncode != 0 and words in out.stderr, f"refused {' '.join(args)}: {out.stderr.strip()[:140]}")


try:
    main()
finally:
    stop_all()
if failures:
    exit_failed(("rank0", "rank1", "router", "single"), lines=20)
print("all passed")
