#!/usr/bin/env python3
"""Checks the deployment files that cannot be run here (no registry, no cluster) against
what can: the Kubernetes manifests and the Dockerfile parse, every server flag they pass
is one the built binary accepts (its --help), the probes use /health on the served port,
the grace period outlasts the drain deadline, the autoscaler's metrics are ones the server
exports (src/server/metrics.rs) and the adapter renames, and the gateway hashes the same
session header as deploy/haproxy.cfg.

    python3 deploy/check_manifests.py path/to/llama-burn-server   (needs PyYAML)
"""

import os
import re
import subprocess
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    with open(os.path.join(HERE, "k8s", name)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def main():
    binary = sys.argv[1]
    help_text = subprocess.run([binary, "--help"], check=True, capture_output=True,
                               text=True).stdout
    flags = set(re.findall(r"--[a-z][a-z-]+", help_text))
    problems = []

    def check(condition, message):
        if not condition:
            problems.append(message)

    deployment, service = load("deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    for arg in args:
        check(arg.split("=")[0] in flags, f"deployment passes {arg}, unknown to the server")
    port = container["ports"][0]
    check(port["containerPort"] == 8080, "the container port is not 8080")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        check(get["path"] == "/health", f"{probe} does not use /health")
        check(get["port"] == port["name"], f"{probe} uses another port")
    timeout = next(int(a.split("=")[1]) for a in args if a.startswith("--shutdown-timeout="))
    check(pod["terminationGracePeriodSeconds"] > timeout + 5,
          "terminationGracePeriodSeconds does not outlast --shutdown-timeout and preStop")
    check(service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"],
          "the service selects other pods")

    with open(os.path.join(HERE, "Dockerfile")) as f:
        docker = f.read()
    check("EXPOSE 8080" in docker and '"--port", "8080"' in docker,
          "the Dockerfile serves another port")
    for flag in re.findall(r'"(--[a-z-]+)"', docker):
        check(flag in flags, f"the Dockerfile passes {flag}, unknown to the server")

    with open(os.path.join(HERE, "..", "src", "server", "metrics.rs")) as f:
        exported = set(re.findall(r'"(llama_burn:[a-z_]+)"', f.read()))
    rules = load("prometheus-adapter-rules.yaml")[0]["rules"]["custom"]
    renamed = {}
    for rule in rules:
        series = rule["seriesQuery"].split("{")[0].strip("'")
        check(series in exported, f"the adapter reads {series}, which the server lacks")
        renamed[rule["name"]["as"]] = series
    hpa = load("hpa.yaml")[0]
    for metric in hpa["spec"]["metrics"]:
        name = metric["pods"]["metric"]["name"]
        check(name in renamed, f"the autoscaler uses {name}, which no adapter rule makes")

    route, policy = load("gateway.yaml")
    check(route["spec"]["rules"][0]["backendRefs"][0]["name"] == service["metadata"]["name"],
          "the route sends to another service")
    header = policy["spec"]["loadBalancer"]["consistentHash"]["header"]["name"]
    with open(os.path.join(HERE, "haproxy.cfg")) as f:
        check(f"req.hdr({header.lower()})" in f.read(),
              f"the gateway hashes {header}, the balancer another header")
    for name in ("servicemonitor.yaml", "gpu-patch.yaml"):
        check(load(name), f"{name} is empty")

    if problems:
        print("\n".join(problems))
        return 1
    print(f"deployment files agree with the server ({len(args)} flags, "
          f"{len(rules)} adapter rules, {len(hpa['spec']['metrics'])} autoscaler metrics)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
