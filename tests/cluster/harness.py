"""The cluster tests' shared helpers (pd_e2e.py, pd_ucx_e2e.py, router_e2e.py, tp_serve_e2e.py): free ports, checks,
HTTP requests to a server on loopback, its /metrics, waiting for /health, starting and stopping `deepinfer` processes
with a log each, chat bodies and their answers. Python 3 stdlib only.
"""
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

failures = []  # what check() found wrong
procs = []  # every process start() started, for stop_all()
names = []  # their log names, in the same order
BIN = MODEL = logdir = None  # set by init()


def init(prefix):
    """The test's command line (DEEPINFER_BINARY MODEL_DIR) and a fresh log directory: (BIN, MODEL, logdir)."""
    global BIN, MODEL, logdir
    BIN, MODEL = sys.argv[1], sys.argv[2]
    logdir = tempfile.mkdtemp(prefix=prefix)
    default_hook = sys.excepthook

    def print_logs_then_raise(kind, value, trace):  # a test that stops on an exception still shows its servers' logs
        default_hook(kind, value, trace)
        print_logs(names, lines=25)
    sys.excepthook = print_logs_then_raise
    return BIN, MODEL, logdir


_given_ports = set()


def free_port():
    """A port free now and below the kernel's ephemeral range, so that no socket bound to port 0 meanwhile (UCX's
    listeners, the TCP stores, outgoing connections) can take it before the server it is meant for binds it: a
    decode worker lost its --port to a UCX listener of the prefill worker started before it (CI, pd_ucx_e2e)."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _given_ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given_ports.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def check(ok, what):
    print(("ok: " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        failures.append(what)


def request(port, path, body=None, timeout=60, headers=None, method=None):
    """(status, body text); POST with a JSON body, else GET, unless `method` says otherwise."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    all_headers = {"Content-Type": "application/json"}
    all_headers.update(headers or {})
    conn.request(method or ("POST" if body is not None else "GET"), path,
                 body=json.dumps(body) if body is not None else None, headers=all_headers)
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, text


def metrics(port):
    """/metrics as {name with labels: value}."""
    out = {}
    for line in request(port, "/metrics")[1].splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def wait_health(port, seconds, want=200):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if request(port, "/health", timeout=2)[0] == want:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def unhealthy(ports, seconds):
    """{name: port} -> the names whose /health is not 200 within `seconds` (all waited for together)."""
    deadline = time.time() + seconds
    return [name for name, port in ports.items() if not wait_health(port, max(0.5, deadline - time.time()))]


def wait_listening(port, seconds):  # a server whose /health is not 200 by design: until it answers at all
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            request(port, "/health", timeout=2)
            return True
        except OSError:
            time.sleep(0.1)
    return False


def start(name, args):
    """`deepinfer ARGS`, its output in logdir/NAME.log."""
    log = open(os.path.join(logdir, f"{name}.log"), "a")
    if name not in names:
        names.append(name)
    p = subprocess.Popen([BIN] + args, stdout=log, stderr=subprocess.STDOUT)
    procs.append(p)
    return p


def stop_all():
    """SIGCONT (a test may leave one stopped) and SIGTERM to every process started; SIGKILL to one still up 10 s on."""
    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
            p.terminate()
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def chat(text, max_tokens, stream=False, system=None, model=None):
    """A greedy chat completion body: the user's `text`, after a `system` prompt where given."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": text}]
    body = {"model": model} if model is not None else {}
    body.update({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream})
    return body


def content(body):
    return json.loads(body)["choices"][0]["message"]["content"]


def streamed_text(body):
    """A streamed completion's text: its events' content deltas (an event without choices adds none)."""
    text = ""
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choices = json.loads(line[6:])["choices"]
            if choices:
                text += choices[0]["delta"].get("content") or ""
    return text


def print_table(table, case="case"):
    """The fault table: (case, what the request got, seconds) rows, as markdown."""
    print(f"\n| {case} | what the request got | seconds |\n|---|---|---|")
    for row in table:
        print(f"| {row[0]} | {row[1]} | {row[2]} |")


def exit_failed(logs, lines):
    """How many checks failed and the last `lines` of each log in `logs` (names without .log); exit 1."""
    print(f"\n{len(failures)} failed; logs in {logdir}")
    print_logs(logs, lines)
    sys.exit(1)


def print_logs(logs, lines):
    """The last `lines` of each log in `logs` (names without .log) that exists."""
    for name in logs:
        path = os.path.join(logdir, f"{name}.log")
        if os.path.exists(path):
            print(f"--- {name}.log")
            print("".join(open(path).readlines()[-lines:]), flush=True)
