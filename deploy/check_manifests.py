#!/usr/bin/env python3
"""Checks deploy/k8s/*.yaml with no cluster (kubectl's dry run needs an API server to map kinds): every document
parses and has apiVersion, kind and metadata.name; a workload's selector matches its pod labels; probes and
Services name ports that exist; every volume mount has a volume; each Service selects a workload; the
`deepinfer serve` / `deepinfer router` arguments are flags the built binary's --help lists; the router's
--worker / --prefill / --decode URLs name pods of a StatefulSet of that --role. Usage: check_manifests.py DEEPINFER_BINARY [FILES...]"""
import glob
import os
import re
import subprocess
import sys

import yaml

binary = sys.argv[1]
files = sys.argv[2:] or sorted(glob.glob(os.path.join(os.path.dirname(__file__), "k8s", "*.yaml")))
errors = []
docs = []
for path in files:
    for doc in yaml.safe_load_all(open(path)):
        if doc is None:
            continue
        name = f"{os.path.basename(path)}: {doc.get('kind', '?')}/{doc.get('metadata', {}).get('name', '?')}"
        for key in ("apiVersion", "kind", "metadata"):
            if key not in doc:
                errors.append(f"{name}: no {key}")
        if not doc.get("metadata", {}).get("name"):
            errors.append(f"{name}: no metadata.name")
        docs.append((name, doc))

help_flags = {}
for command in ("serve", "router"):
    text = subprocess.run([binary, command, "--help"], capture_output=True, text=True, check=True).stdout
    help_flags[command] = set(re.findall(r"(--[a-z0-9-]+)", text))

workloads = [(n, d) for n, d in docs if d.get("kind") in ("Deployment", "StatefulSet")]
statefulsets = {d["metadata"]["name"]: d for n, d in workloads if d["kind"] == "StatefulSet"}
for name, doc in workloads:
    spec = doc.get("spec", {})
    template = spec.get("template", {})
    labels = template.get("metadata", {}).get("labels", {})
    selector = spec.get("selector", {}).get("matchLabels", {})
    if not selector or any(labels.get(k) != v for k, v in selector.items()):
        errors.append(f"{name}: spec.selector.matchLabels {selector} does not match the pod labels {labels}")
    pod = template.get("spec", {})
    volumes = {v["name"] for v in pod.get("volumes", [])}
    volumes |= {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    for container in pod.get("containers", []):
        cname = f"{name}/{container.get('name')}"
        if not container.get("image"):
            errors.append(f"{cname}: no image")
        ports = {p.get("name") for p in container.get("ports", [])} | {p.get("containerPort") for p in container.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            spec_probe = container.get(probe)
            if not spec_probe:
                continue
            port = (spec_probe.get("httpGet") or spec_probe.get("tcpSocket") or {}).get("port")
            if port not in ports:
                errors.append(f"{cname}: {probe} names port {port!r}, which the container does not expose")
        for mount in container.get("volumeMounts", []):
            if mount["name"] not in volumes:
                errors.append(f"{cname}: volumeMount {mount['name']} has no volume")
        args = container.get("args", [])
        if args and args[0] in help_flags:
            for arg in args[1:]:
                flag = arg.split("=", 1)[0]
                if flag.startswith("--") and flag not in help_flags[args[0]]:
                    errors.append(f"{cname}: `deepinfer {args[0]}` has no flag {flag}")
            if args[0] == "router":
                for arg in args[1:]:
                    if not arg.startswith(("--worker=", "--prefill=", "--decode=")):
                        continue
                    m = re.fullmatch(r"--(?:worker|prefill|decode)=http://([a-z0-9-]+)-(\d+)\.([a-z0-9-]+):(\d+)", arg)
                    sts = statefulsets.get(m.group(1)) if m else None
                    if not m or sts is None or sts["spec"].get("serviceName") != m.group(3) or \
                            int(m.group(2)) >= sts["spec"].get("replicas", 1):
                        errors.append(f"{cname}: {arg} names no pod of a worker StatefulSet")
                        continue
                    role = next((a.split("=", 1)[1] for a in sts["spec"]["template"]["spec"]["containers"][0]["args"]
                                 if a.startswith("--role=")), "both")
                    want = {"--worker": "both", "--prefill": "prefill", "--decode": "decode"}[arg.split("=", 1)[0]]
                    if role != want:
                        errors.append(f"{cname}: {arg} names a pod of --role {role}, not {want}")
for name, doc in docs:
    if doc.get("kind") != "Service":
        continue
    selector = doc.get("spec", {}).get("selector", {})
    targets = [d for n, d in workloads
               if all(d["spec"]["template"]["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())]
    if not targets:
        errors.append(f"{name}: selects no workload")
        continue
    ports = {p.get("name") for d in targets for c in d["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    for port in doc["spec"].get("ports", []):
        if isinstance(port.get("targetPort"), str) and port["targetPort"] not in ports:
            errors.append(f"{name}: targetPort {port['targetPort']} is no container port of what it selects")

for e in errors:
    print("FAIL:", e)
print(f"deploy manifests: {len(docs)} documents in {len(files)} files, {len(errors)} problems")
sys.exit(1 if errors else 0)
