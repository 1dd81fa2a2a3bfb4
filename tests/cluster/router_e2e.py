#!/usr/bin/env python3
"""`deepinfer router` end to end, several processes on loopback (issue 19, items 3 and 4): two `deepinfer serve`
workers on the built-in demo model with KV events, and a router in front of them.

Checks, each printed as a line of the fault table (case, what the request got, seconds, blocks left running):
  - greedy identity: the same requests through the router and straight to a worker give the same text; a stream's
    events reach the client as the worker makes them (not all at its end);
  - kv-aware: a conversation's later turns go where its prefix is cached (router metrics: cache_hit; the worker's
    usage.cached_tokens agrees with the router's prediction);
  - kill -9 a worker while streams run on it: each stream ends (an error event, never a hang), later requests are
    retried on the other worker and succeed, the router reports the worker unhealthy;
  - a stalled worker (SIGSTOP) past --first-byte-timeout-ms: the request is retried on the other worker and succeeds;
  - the stalled worker resumed, or restarted: the router takes it back (health), a restarted worker's old index
    entries are dropped (another instance id);
  - no healthy worker: a clear 503 in the request's dialect, at once;
  - after all that, no worker has a request running (deepinfer_num_requests_running 0, KV blocks back to zero).
Usage: router_e2e.py DEEPINFER_BINARY MODEL_DIR
"""
import http.client
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from harness import (chat, check, content, exit_failed, failures, free_port, init, metrics, print_table, request,
                     start, stop_all, wait_health)

BIN, MODEL, logdir = init("router-e2e-")
table = []
SYSTEM = "You answer questions about Debian packages."


def start_worker(index, port, events, replay):
    return start(f"worker{index}", ["serve", "--device", "cpu", "--model-path", MODEL, "--host", "127.0.0.1",
                                    "--port", str(port), "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                                    "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"])


def stream_collect(port, body, results, key, timeout=120):
    """Streams a chat completion; results[key] = (status, events text, time it ended, error or None)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        text = response.read().decode(errors="replace")
        results[key] = (response.status, text, time.time(), None)
    except Exception as e:  # the connection broke: also an ending, as long as it is not a hang
        results[key] = (0, "", time.time(), repr(e))


try:
    wports = [free_port(), free_port()]
    eports = [(free_port(), free_port()), (free_port(), free_port())]
    workers = [start_worker(i, wports[i], *eports[i]) for i in range(2)]
    rport = free_port()
    # The router first, before its workers are up: it must wait for them, answering 503 meanwhile.
    router = start("router", ["router", "--worker", f"http://127.0.0.1:{wports[0]}",
                              "--worker", f"http://127.0.0.1:{wports[1]}", "--model-path", MODEL, "--host",
                              "127.0.0.1", "--port", str(rport), "--health-check-interval-ms", "200",
                              "--first-byte-timeout-ms", "3000", "--stream-idle-timeout-ms", "5000"])
    check(all(wait_health(p, seconds=60) for p in wports), "both workers healthy")
    check(wait_health(rport, seconds=60), "the router healthy once a worker is")
    time.sleep(0.5)  # both workers seen healthy by the router

    # Greedy identity through the router.
    prompts = ["What does apt-get do?", "Name a text editor.", "How do I list files?", "What is dpkg?"]
    same = True
    for p in prompts:
        s1, direct = request(wports[0], "/v1/chat/completions", chat(p, 12, system=SYSTEM))
        s2, routed = request(rport, "/v1/chat/completions", chat(p, 12, system=SYSTEM))
        same = same and s1 == 200 and s2 == 200 and content(direct) == content(routed)
    check(same, f"greedy identity: {len(prompts)} chat completions through the router equal the worker's own")

    # A stream passes through as it is made (regression: the router read the worker's body 16 KiB at a time, so a
    # stream's events all reached the client at its end).
    def event_times(port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        started = time.time()
        conn.request("POST", "/v1/chat/completions", json.dumps(chat("Write about Debian.", 64, stream=True)),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        times = []
        while True:
            line = response.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                times.append(time.time() - started)
        conn.close()
        return times

    times = event_times(rport)
    check(len(times) > 32 and times[0] < 0.5 * times[-1],
          f"a stream through the router arrives as it is made: first event at {times[0] * 1000:.0f} ms, last at "
          f"{times[-1] * 1000:.0f} ms ({len(times)} events)" if times else "a stream through the router: no events")
    s, body = request(rport, "/v1/completions", {"prompt": [1000 + i for i in range(100)], "max_tokens": 8,
                                                "temperature": 0})
    s_direct, body_direct = request(wports[1], "/v1/completions", {"prompt": [1000 + i for i in range(100)],
                                                                 "max_tokens": 8, "temperature": 0})
    check(s == 200 and json.loads(body)["choices"][0]["text"] == json.loads(body_direct)["choices"][0]["text"],
          "greedy identity: a token-id completion too")

    # kv-aware: turns of one conversation with a long shared system prompt go where it is cached.
    system = "You are the Debian documentation assistant. " * 40
    before = metrics(rport)
    cached = []
    for turn in range(4):
        s, body = request(rport, "/v1/chat/completions", chat(f"Question {turn}: what is a package?", 4, system=system))
        cached.append(json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"])
        time.sleep(0.3)  # the KV events of the turn reach the router
    after = metrics(rport)
    hits = sum(v - before.get(k, 0) for k, v in after.items() if 'reason="cache_hit"' in k)
    check(hits >= 3 and all(c > 0 for c in cached[1:]),
          f"kv-aware: turns 2-4 routed by cache hit ({hits:.0f}), the worker served them from cache {cached[1:]}")
    predicted = sum(v - before.get(k, 0) for k, v in after.items()
                    if k.startswith("deepinfer_router_worker_predicted_cached_tokens_total"))
    check(predicted == sum(cached[1:]), f"the router's predicted cached tokens ({predicted:.0f}) equal the workers' "
                                        f"usage ({sum(cached[1:])})")

    # kill -9 a worker while streams run on it.
    results = {}
    threads = [threading.Thread(target=stream_collect,
                                args=(rport, chat(f"Tell me about package {i}.", 200, True, system=SYSTEM), results, i))
               for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    in_flight = metrics(rport)
    victim = max(range(2), key=lambda w: in_flight.get(
        f'deepinfer_router_worker_in_flight{{worker="http://127.0.0.1:{wports[w]}"}}', 0))
    killed_at = time.time()
    workers[victim].send_signal(signal.SIGKILL)
    workers[victim].wait()
    for t in threads:
        t.join(60)
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    ended = [results[i] for i in results]
    broke = [r for r in ended if r[3] is not None or '"error"' in r[1]]
    completed = [r for r in ended if r[0] == 200 and "[DONE]" in r[1] and '"error"' not in r[1]]
    to_error = max((r[2] - killed_at for r in broke), default=0.0)
    check(not hung and len(ended) == 4, f"kill -9 mid-stream: all 4 streams ended ({len(completed)} completed, "
                                        f"{len(broke)} ended with an error event), none hangs")
    table.append(("kill -9 a worker mid-stream", f"{len(completed)} completed, {len(broke)} error event",
                  f"{to_error:.2f} (kill to the last error event)"))
    # Requests after the kill: retried on the survivor, all succeed.
    started = time.time()
    statuses = [request(rport, "/v1/chat/completions", chat(f"after the kill {i}", 4, system=SYSTEM))[0]
                for i in range(4)]
    check(statuses == [200] * 4, f"after the kill: 4 requests all answered 200 ({statuses})")
    table.append(("requests after kill -9", "200 (retried on the other worker when routed to the dead one)",
                  f"{time.time() - started:.1f}"))
    m = metrics(rport)
    check(m.get(f'deepinfer_router_worker_healthy{{worker="http://127.0.0.1:{wports[victim]}"}}') == 0,
          "the router reports the killed worker unhealthy")

    # Restart the killed worker: it comes back; its old entries were dropped (new instance).
    workers[victim] = start_worker(victim, wports[victim], *eports[victim])
    check(wait_health(wports[victim], seconds=60), "the killed worker restarted")
    deadline = time.time() + 10
    while time.time() < deadline and metrics(rport).get(
            f'deepinfer_router_worker_healthy{{worker="http://127.0.0.1:{wports[victim]}"}}') != 1:
        time.sleep(0.2)
    m = metrics(rport)
    check(m.get(f'deepinfer_router_worker_healthy{{worker="http://127.0.0.1:{wports[victim]}"}}') == 1,
          "the router takes the restarted worker back")

    # A stalled worker: SIGSTOP, then requests routed to it wait --first-byte-timeout-ms (3 s) and go elsewhere.
    stalled = 1 - victim
    workers[stalled].send_signal(signal.SIGSTOP)
    started = time.time()
    statuses = []
    for i in range(3):
        statuses.append(request(rport, "/v1/chat/completions", chat(f"during the stall {i}", 4, system=SYSTEM),
                                timeout=30)[0])
    took = time.time() - started
    check(statuses == [200] * 3 and took < 15, f"a stalled worker: 3 requests answered {statuses} in {took:.1f} s "
                                               "(a request routed to it is retried after 3 s)")
    table.append(("stall a worker (SIGSTOP)", f"{statuses}, retried after --first-byte-timeout-ms", f"{took:.1f}"))
    workers[stalled].send_signal(signal.SIGCONT)
    check(wait_health(wports[stalled], seconds=60), "the stalled worker answers again after SIGCONT")

    # No healthy worker: stop both; the router answers 503 in the request's dialect at once.
    for w in workers:
        w.send_signal(signal.SIGSTOP)
    time.sleep(2.5)  # health checks (1 s timeout) fail
    started = time.time()
    s, body = request(rport, "/v1/messages", {"model": "demo", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    took = time.time() - started
    check(s == 503 and json.loads(body).get("type") == "error" and took < 2,
          f"no healthy worker: {s} Anthropic-shaped in {took:.2f} s")
    table.append(("no healthy worker", f"{s} {json.loads(body)['error']['message'][:60]}...", f"{took:.2f}"))
    s, _ = request(rport, "/health")
    check(s == 503, "the router's /health is 503 with no healthy worker")
    for w in workers:
        w.send_signal(signal.SIGCONT)
    check(wait_health(rport, seconds=60), "the router healthy again")
    time.sleep(1.0)

    # Nothing left running on any worker, nothing in flight on the router.
    for i, p in enumerate(wports):
        m = metrics(p)
        check(m.get("deepinfer_num_requests_running") == 0 and m.get("deepinfer_num_requests_waiting") == 0,
              f"worker {i}: no request left running or waiting")
    m = metrics(rport)
    check(all(v == 0 for k, v in m.items() if k.startswith("deepinfer_router_worker_in_flight")),
          "the router: nothing in flight")
finally:
    stop_all()

print_table(table)
if failures:
    exit_failed(("router", "worker0", "worker1"), lines=30)
print("router e2e: all checks passed")
