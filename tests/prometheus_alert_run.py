#!/usr/bin/env python3
"""The alerting rules in a real Prometheus, on loopback (CTest
`prometheus_alert_run`; its log is deploy/prometheus/alert-run-*.log):

1. starts a CPU server made slow on purpose by its shapes (64 heads, one CPU
   thread per verify, 1024-token prompts: a Verify takes hundreds of ms; no
   testing flag), and `prometheus` with a temporary configuration that
   scrapes it every second and evaluates deploy/prometheus/rules.yml every
   second, every `for:` of the rules replaced by 5s (the replacements are
   printed);
2. runs `mlaverify-client load --stream` (VerifyStream only: it asserts that
   no unary Verify series exists) and waits until Prometheus' /api/v1/alerts
   shows MlaverifyVerifyLatencyHigh pending, then firing;
3. evaluates every query of deploy/grafana/mlaverify.json against this
   Prometheus (variables replaced): each must be accepted, and the acceptance
   rate, device utilisation and AppendKv panels must return data;
4. kills the server (SIGKILL) and waits until MlaverifyDown and
   MlaverifyAbsent go pending, then firing.

  prometheus_alert_run.py SERVER_BINARY CLIENT_BINARY [LOG]
LOG (default: none) receives a copy of what is printed. Exit 0 when every
step happened, 1 otherwise; 77 (skipped) without prometheus or PyYAML.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from test_support import dashboard_expr, free_port

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROM_DIR = os.path.join(ROOT, "deploy", "prometheus")
FOR_IN_RUN = "5s"
PHASE_TIMEOUT_S = 90
START = time.monotonic()
log_file = None


def say(message):
    line = f"[{time.monotonic() - START:6.1f} s] {message}"
    print(line, flush=True)
    if log_file:
        log_file.write(line + "\n")
        log_file.flush()


def get_json(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def query(prom, expr):
    return get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def alert_states(prom):
    """{alertname: state} of the alerts Prometheus holds now."""
    states = {}
    for a in get_json(f"{prom}/api/v1/alerts")["data"]["alerts"]:
        name = a["labels"]["alertname"]
        # firing wins over pending when several series carry the name
        if states.get(name) != "firing":
            states[name] = a["state"]
    return states


def wait_for_alerts(prom, names, what):
    """Waits until every alert in names has been seen pending and then
    firing; logs each state change. Returns True when all fired."""
    seen = {n: [] for n in names}
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while time.monotonic() < deadline:
        states = alert_states(prom)
        for n in names:
            state = states.get(n, "inactive")
            if not seen[n] or seen[n][-1] != state:
                seen[n].append(state)
                say(f"{what}: {n} is {state}")
        if all("firing" in s for s in seen.values()):
            break
        time.sleep(0.5)
    ok = True
    for n, states in seen.items():
        if "pending" not in states or "firing" not in states or \
                states.index("pending") > states.index("firing"):
            say(f"FAIL: {n} went {' -> '.join(states)}, not pending then firing")
            ok = False
    return ok


def main():
    global log_file
    server, client = sys.argv[1], sys.argv[2]
    if len(sys.argv) > 3:
        log_file = open(sys.argv[3], "w")
    try:
        import yaml  # noqa: F401
    except ImportError:
        print("SKIPPED: python3 has no yaml module (python3-yaml; scripts/install_deps.sh installs yamllint, which brings it)")
        return 77
    if shutil.which("prometheus") is None:
        print("SKIPPED: prometheus is not installed (Debian's prometheus package; scripts/install_deps.sh installs it)")
        return 77
    say(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()) + ": tests/prometheus_alert_run.py " +
        " ".join(os.path.relpath(a) if os.path.exists(a) else a for a in sys.argv[1:]))
    version = subprocess.run(["prometheus", "--version"], capture_output=True, text=True)
    say(f"prometheus: {(version.stdout + version.stderr).splitlines()[0]}")

    tmp = tempfile.mkdtemp(prefix="mlaverify-alert-run-")
    procs = []
    ok = True
    try:
        # ---- the server -----------------------------------------------------
        port_file = os.path.join(tmp, "ports")
        server_cmd = [server, "--backend", "cpu", "--devices", "0", "--cpu-threads", "1",
                      "--heads", "64", "--layers", "2", "--pool-bytes", "256MiB",
                      "--listen", "127.0.0.1:0", "--admin-host", "127.0.0.1", "--admin-port", "0",
                      "--port-file", port_file, "--drain-grace-s", "0", "--slow-call-ms", "0"]
        say("server: " + " ".join(os.path.basename(a) if i == 0 else a
                                  for i, a in enumerate(server_cmd)))
        server_proc = subprocess.Popen(server_cmd, stdout=open(os.path.join(tmp, "server.log"), "w"),
                                       stderr=subprocess.STDOUT)
        procs.append(server_proc)
        for _ in range(300):
            if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
                break
            if server_proc.poll() is not None:
                say("FAIL: the server exited: " + open(os.path.join(tmp, "server.log")).read())
                return 1
            time.sleep(0.05)
        grpc_port, admin_port = open(port_file).read().split()

        # ---- rules with short `for:`, and Prometheus -------------------------
        import yaml
        with open(os.path.join(PROM_DIR, "rules.yml")) as f:
            rules = yaml.safe_load(f)
        for group in rules["groups"]:
            for rule in group["rules"]:
                if "for" in rule:
                    say(f"rules.yml: {rule['alert']} for: {rule['for']} -> {FOR_IN_RUN} in this run")
                    rule["for"] = FOR_IN_RUN
        with open(os.path.join(tmp, "rules.yml"), "w") as f:
            yaml.safe_dump(rules, f)
        web_port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yml"],
            "scrape_configs": [{
                "job_name": "mlaverify",
                "static_configs": [{"targets": [f"127.0.0.1:{admin_port}"],
                                    "labels": {"namespace": "alert-run", "pod": "mlaverify-0"}}],
                "relabel_configs": [{"target_label": "instance", "replacement": "mlaverify-0"}],
            }],
        }
        with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
            json.dump(config, f)
        say("prometheus.yml: scrape 127.0.0.1:<admin port> every 1 s as job=mlaverify, "
            "namespace=alert-run, pod=instance=mlaverify-0; rules every 1 s")
        prom_proc = subprocess.Popen(
            ["prometheus", f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
             f"--web.listen-address=127.0.0.1:{web_port}"],
            stdout=open(os.path.join(tmp, "prometheus.log"), "w"), stderr=subprocess.STDOUT)
        procs.append(prom_proc)
        prom = f"http://127.0.0.1:{web_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if query(prom, 'up{job="mlaverify"} == 1')["data"]["result"]:
                    break
            except OSError:
                pass
            if prom_proc.poll() is not None or time.monotonic() > deadline:
                say("FAIL: prometheus did not scrape the server: " +
                    open(os.path.join(tmp, "prometheus.log")).read()[-2000:])
                return 1
            time.sleep(0.5)
        say("prometheus scrapes the server (up == 1)")

        # ---- (b) a VerifyStream-only load on a slow device --------------------
        load_cmd = [client, "--target", f"127.0.0.1:{grpc_port}", "load", "--stream",
                    "--concurrency", "2", "--duration-s", "120", "--warmup-s", "0",
                    "--prompt-len", "1024", "--drafts", "8", "--progress", "false"]
        say("load: " + " ".join(os.path.basename(a) if i == 0 else a
                                for i, a in enumerate(load_cmd)))
        load_proc = subprocess.Popen(load_cmd, stdout=open(os.path.join(tmp, "load.log"), "w"),
                                     stderr=subprocess.STDOUT)
        procs.append(load_proc)
        ok &= wait_for_alerts(prom, ["MlaverifyVerifyLatencyHigh"], "VerifyStream-only load")
        unary = query(prom, 'mlaverify_requests_total{rpc="Verify"}')["data"]["result"]
        streamed = query(prom, 'sum(mlaverify_requests_total{rpc="VerifyStream"})')["data"]["result"]
        p99 = query(prom, 'histogram_quantile(0.99, sum by (le) (rate('
                    'mlaverify_request_duration_seconds_bucket{rpc=~"Verify|VerifyStream"}[5m])))')
        p99 = p99["data"]["result"]
        say(f"unary Verify series: {len(unary)}; VerifyStream messages: "
            f"{streamed[0]['value'][1] if streamed else 0}; "
            f"p99 over Verify|VerifyStream: {float(p99[0]['value'][1]) * 1e3:.0f} ms" if p99 else
            "p99: no data")
        if unary:
            say("FAIL: the load sent unary Verify calls; the run must be VerifyStream only")
            ok = False

        # ---- the dashboard's queries ------------------------------------------
        board = json.load(open(os.path.join(ROOT, "deploy", "grafana", "mlaverify.json")))
        must_have_data = {"Acceptance rate", "Device utilisation", "AppendKv write rate",
                          "Calls/s by RPC", "Build info (version, backend)"}
        answered, with_data = 0, 0
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                expr = dashboard_expr(target["expr"])
                r = query(prom, expr)
                if r.get("status") != "success":
                    say(f"FAIL: dashboard '{panel['title']}': {r}")
                    ok = False
                    continue
                answered += 1
                if r["data"]["result"]:
                    with_data += 1
                elif panel["title"] in must_have_data:
                    say(f"FAIL: dashboard '{panel['title']}' returned no data under load")
                    ok = False
                if panel["title"] in ("Acceptance rate", "Device utilisation") and r["data"]["result"]:
                    values = [float(s["value"][1]) for s in r["data"]["result"]]
                    say(f"dashboard '{panel['title']}': {', '.join(f'{v:.3f}' for v in values)}")
        say(f"dashboard: {answered} queries accepted, {with_data} with data now (rates over "
            "1m/5m windows holding seconds of data are diluted: rate() divides by the window)")

        load_proc.terminate()
        load_proc.wait(timeout=30)

        # ---- (a) the server exits ------------------------------------------------
        say("SIGKILL to the server")
        server_proc.send_signal(signal.SIGKILL)
        server_proc.wait(timeout=30)
        ok &= wait_for_alerts(prom, ["MlaverifyDown", "MlaverifyAbsent"], "server killed")
        ready = query(prom, "mlaverify_ready")["data"]["result"]
        say(f"mlaverify_ready series now: {len(ready)} (MlaverifyNotServing cannot see a dead server)")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"prometheus_alert_run: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
