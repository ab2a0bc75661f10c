#!/usr/bin/env python3
"""Checks deploy/ and the Dockerfile against the server they deploy:

- promtool: the Prometheus config and its rules parse (where promtool is
  built without Kubernetes discovery, as Debian's is, the config is checked
  with a static target in place of kubernetes_sd_configs); a live CPU
  server's /metrics passes `promtool check metrics`;
- every metric that the alerting rules and the Grafana dashboard name exists
  in that output or, for families without series until an event, is
  registered in server/admin/metrics.cc (so a renamed metric breaks this
  test); every metric family (exported or registered) is on the dashboard or
  listed under "Not on the dashboard" in server/admin/README.md;
- every alert has a summary, a description and a runbook_url naming a
  section of docs/runbook.md, and every section there is an alert's;
- every dashboard query parses (`promtool check rules` on them as recording
  rules, the dashboard's variables replaced by values);
- every flag that the ConfigMap, the StatefulSet, the scheduler-sidecar
  example and the Dockerfile pass is a flag of `mlaverify-server --help`,
  and the ConfigMap's flags file starts a real server (with CPU overrides on
  the command line, which win);
- ports and probes agree with the flags (--listen, --admin-port, /healthz,
  /readyz answer), the grace period covers preStop + drain;
- the Dockerfile sets no LD_LIBRARY_PATH; its HEALTHCHECK probes CMD's
  --admin-port and, run against the live server, passes, and fails once the
  server has exited;
- `kubectl kustomize` renders the manifests, where kubectl is installed.

  deploy_check.py SERVER_BINARY CLIENT_BINARY
Exit 77 (skipped) without promtool or PyYAML.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from test_support import dashboard_expr

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEPLOY = os.path.join(ROOT, "deploy")
failures = []


def fail(message):
    failures.append(message)
    print("FAIL:", message)


def run(*cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


def metric_names(text):
    """mlaverify_* names in PromQL, histogram suffixes dropped."""
    names = set(re.findall(r"\bmlaverify_[a-z0-9_]+", text))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def main():
    server, client = sys.argv[1], sys.argv[2]
    try:
        import yaml
    except ImportError:
        print("SKIPPED: python3 has no yaml module (python3-yaml; scripts/install_deps.sh installs yamllint, which brings it)")
        return 77
    if shutil.which("promtool") is None:
        print("SKIPPED: promtool is not installed (Debian's prometheus package; scripts/install_deps.sh installs it)")
        return 77

    # ---- Prometheus config and rules ---------------------------------------
    r = run("promtool", "check", "rules", os.path.join(DEPLOY, "prometheus", "rules.yml"))
    if r.returncode != 0:
        fail(f"promtool check rules: {r.stdout}{r.stderr}")
    config_path = os.path.join(DEPLOY, "prometheus", "prometheus.yml")
    r = run("promtool", "check", "config", config_path)
    if r.returncode != 0 and "kubernetes_sd_configs not found" in r.stdout + r.stderr:
        # Debian's Prometheus is built without Kubernetes discovery: check
        # everything else (relabelling, rule files) with a static target in
        # its place, in a copy beside rules.yml.
        print("note: this promtool has no kubernetes_sd_configs; prometheus.yml checked with "
              "static_configs in its place")
        text = open(config_path).read()
        text = re.sub(r"kubernetes_sd_configs:\n(\s+)- role: pod",
                      r"static_configs:\n\1- targets: ['127.0.0.1:9090']", text)
        if "static_configs" not in text:
            fail("prometheus.yml: could not put static_configs in place of kubernetes_sd_configs")
        copy_dir = tempfile.mkdtemp(prefix="mlaverify-prometheus-")
        shutil.copy(os.path.join(DEPLOY, "prometheus", "rules.yml"), copy_dir)
        with open(os.path.join(copy_dir, "prometheus.yml"), "w") as f:
            f.write(text)
        r = run("promtool", "check", "config", os.path.join(copy_dir, "prometheus.yml"))
        shutil.rmtree(copy_dir)
    if r.returncode != 0:
        fail(f"promtool check config: {r.stdout}{r.stderr}")

    # ---- alert annotations and the runbook -----------------------------------
    with open(os.path.join(DEPLOY, "prometheus", "rules.yml")) as f:
        rules = yaml.safe_load(f)
    with open(os.path.join(ROOT, "docs", "runbook.md")) as f:
        sections = {line[3:].strip() for line in f if line.startswith("## ")}
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    for rule in alerts:
        annotations = rule.get("annotations") or {}
        for key in ("summary", "description", "runbook_url"):
            if not annotations.get(key):
                fail(f"rules.yml: alert {rule['alert']} has no {key} annotation")
        url = annotations.get("runbook_url", "")
        if url != f"docs/runbook.md#{rule['alert'].lower()}" or rule["alert"] not in sections:
            fail(f"rules.yml: alert {rule['alert']}'s runbook_url {url!r} does not name its "
                 "section of docs/runbook.md")
    for section in sections - {r["alert"] for r in alerts}:
        fail(f"docs/runbook.md: section {section!r} is no alert of rules.yml")
    print(f"ok: {len(alerts)} alerts, each with a description and its runbook section")
    # Recorded series the dashboard reads (level:metric:operation) are
    # recorded by rules.yml, and every recording rule is read by a panel.
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    board_text = open(os.path.join(DEPLOY, "grafana", "mlaverify.json")).read()
    read = set(re.findall(r"\b[a-z_]+:mlaverify_[a-z0-9_]+:[a-z0-9_]+", board_text))
    for name in sorted(read - recorded):
        fail(f"the dashboard reads {name}, which rules.yml does not record")
    for name in sorted(recorded - read):
        fail(f"rules.yml records {name}, which no dashboard panel reads")
    print(f"ok: {len(recorded)} recording rules, each read by the dashboard")

    # ---- the server's flags -------------------------------------------------
    help_text = run(server, "--help").stdout
    flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", help_text, re.M))
    if "--config" not in flags or "--listen" not in flags:
        fail(f"could not read the flags from {server} --help")

    manifests = {}
    for name in os.listdir(os.path.join(DEPLOY, "kubernetes")):
        if name.endswith(".yaml"):
            with open(os.path.join(DEPLOY, "kubernetes", name)) as f:
                for doc in yaml.safe_load_all(f):
                    if doc and "metadata" in doc:
                        manifests[(doc["kind"], doc["metadata"]["name"])] = doc
    # The flags file kustomize turns into the ConfigMap mlaverify-flags.
    toml = open(os.path.join(DEPLOY, "kubernetes", "mlaverify.toml")).read()
    for key in re.findall(r"^([a-z0-9-]+)\s*=", toml, re.M):
        if f"--{key}" not in flags:
            fail(f"mlaverify.toml (ConfigMap mlaverify-flags) sets '{key}', which is not a server flag")

    sts = manifests[("StatefulSet", "mlaverify")]
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = {}
    for arg in container["args"]:
        name, _, value = arg.partition("=")
        if name not in flags:
            fail(f"StatefulSet passes {name}, which is not a server flag")
        args[name] = value
    with open(os.path.join(DEPLOY, "scheduler-sidecar", "sidecar-patch.yaml")) as f:
        for op in yaml.safe_load(f):
            if op.get("path", "").endswith("/args/-"):
                name = op["value"].partition("=")[0]
                if name not in flags:
                    fail(f"scheduler-sidecar passes {name}, which is not a server flag")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    if args.get("--listen", "").rsplit(":", 1)[-1] != str(ports.get("grpc")):
        fail(f"--listen {args.get('--listen')} does not match containerPort grpc {ports.get('grpc')}")
    if args.get("--admin-port") != str(ports.get("admin")):
        fail(f"--admin-port {args.get('--admin-port')} does not match containerPort admin {ports.get('admin')}")
    probe_paths = set()
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        probe_paths.add(get["path"])
        if get["port"] not in ("admin", ports.get("admin")):
            fail(f"{probe} probes port {get['port']}, not the admin port")
    if container["readinessProbe"]["httpGet"]["path"] != "/readyz":
        fail("the readiness probe must use /readyz (503 while starting or draining)")
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    sleep_s = float(pre_stop[-1]) if "sleep" in pre_stop[0] else 0.0
    needed = sleep_s + float(args.get("--drain-grace-s", 5)) + float(args.get("--drain-timeout-s", 10)) + 5
    if pod["terminationGracePeriodSeconds"] < needed:
        fail(f"terminationGracePeriodSeconds {pod['terminationGracePeriodSeconds']} < preStop + "
             f"drain grace + drain timeout + 5 s = {needed}")
    for svc in ("mlaverify", "mlaverify-headless"):
        for p in manifests[("Service", svc)]["spec"]["ports"]:
            if p["targetPort"] not in ports:
                fail(f"Service {svc} targets port {p['targetPort']}, which the pod does not name")

    dockerfile = open(os.path.join(ROOT, "Dockerfile")).read()
    exposed = set(re.findall(r"^EXPOSE\s+(.*)$", dockerfile, re.M)[0].split())
    if exposed != {str(ports["grpc"]), str(ports["admin"])}:
        fail(f"Dockerfile EXPOSE {exposed} differs from the pod's ports {ports}")
    # One CMD per image target: the GPU image on CUDA only, the CPU image
    # (the default, last stage) on the CPU; the same flags otherwise.
    stage_cmds = {}
    for stage, body in re.findall(r"^FROM \S+ AS (\w+)\s*$(.*?)(?=^FROM |\Z)",
                                  dockerfile.replace("\\\n", " "), re.M | re.S):
        found = re.search(r"^CMD (\[.*?\])\s*$", body, re.M)
        if found:
            stage_cmds[stage] = json.loads(found.group(1))
    if set(stage_cmds) != {"gpu", "cpu"} or not re.search(r"^FROM runtime AS cpu\s*$(?![\s\S]*^FROM )",
                                                           dockerfile, re.M):
        fail(f"the Dockerfile needs a CMD in stages gpu and cpu, cpu last (the default target); "
             f"found {sorted(stage_cmds)}")
    for stage, want in (("gpu", "cuda"), ("cpu", "cpu")):
        got = stage_cmds.get(stage, [])
        if "--backend" not in got or got[got.index("--backend") + 1] != want:
            fail(f"the Dockerfile's {stage} image must pass --backend {want}: {got}")
    if stage_cmds.get("gpu", [])[:-2] != stage_cmds.get("cpu", [])[:-2]:
        fail(f"the gpu and cpu CMDs differ beyond --backend: {stage_cmds}")
    cmd = stage_cmds.get("cpu", [])
    for word in cmd:
        if word.startswith("--") and word not in flags:
            fail(f"Dockerfile CMD passes {word}, which is not a server flag")
    # /readyz: a container is healthy once it serves and while its gRPC port
    # answers (--readiness-grpc-timeout-ms), not merely while the process lives.
    if "/readyz" not in re.search(r"HEALTHCHECK.*", dockerfile.replace("\\\n", " ")).group(0):
        fail("the Dockerfile's HEALTHCHECK must probe /readyz")
    if re.search(r"^ENV\b.*\bLD_LIBRARY_PATH=", dockerfile.replace("\\\n", " "), re.M):
        fail("the Dockerfile sets LD_LIBRARY_PATH; the runtime stage's libraries come from packages")
    # The health check (exec form) probes the admin port that CMD sets; it is
    # run against the live server below, and once more after it has exited.
    health = json.loads(re.search(r"^HEALTHCHECK\b.*?\bCMD (\[.*\])\s*$", dockerfile.replace("\\\n", " "),
                                  re.M).group(1))
    health_port = re.search(r"/dev/tcp/127\.0\.0\.1/(\d+)\b", health[-1]).group(1)
    if health_port != cmd[cmd.index("--admin-port") + 1]:
        fail(f"the Dockerfile's HEALTHCHECK probes port {health_port}, CMD sets --admin-port "
             f"{cmd[cmd.index('--admin-port') + 1]}")

    def health_check(admin_port):
        command = health[:-1] + [health[-1].replace(f"/dev/tcp/127.0.0.1/{health_port}",
                                                    f"/dev/tcp/127.0.0.1/{admin_port}")]
        return subprocess.run(command, capture_output=True, text=True, timeout=5).returncode

    # ---- a live server started from the ConfigMap's flags file ------------
    tmp = tempfile.mkdtemp(prefix="mlaverify-deploy-check-")
    config = os.path.join(tmp, "mlaverify.toml")
    open(config, "w").write(toml)
    port_file = os.path.join(tmp, "ports")
    log = open(os.path.join(tmp, "server.log"), "w")
    proc = subprocess.Popen([server, "--config", config, "--backend", "cpu", "--devices", "0",
                             "--heads", "8", "--layers", "4", "--pool-bytes", "64MiB",
                             "--listen", "127.0.0.1:0", "--admin-host", "127.0.0.1",
                             "--admin-port", "0", "--port-file", port_file, "--drain-grace-s", "0"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            if os.path.exists(port_file) and os.path.getsize(port_file) > 0:
                break
            if proc.poll() is not None:
                fail(f"the server did not start from the ConfigMap's flags: {open(log.name).read()}")
                return 1
            time.sleep(0.05)
        grpc_port, admin_port = open(port_file).read().split()
        target = f"127.0.0.1:{grpc_port}"
        # Traffic, so that the histograms and per-RPC series exist; one
        # failing call for an error code.
        r = run(client, "--target", target, "demo", "--sequences", "2", "--prompt-len", "40",
                "--steps", "2", "--drafts", "4")
        if r.returncode != 0:
            fail(f"demo against the ConfigMap-configured server: {r.stdout}{r.stderr}")
        run(client, "--target", target, "load", "--concurrency", "2", "--duration-s", "1",
            "--prompt-len", "16", "--drafts", "2")
        for path in sorted(probe_paths | {"/readyz"}):
            try:
                code = urllib.request.urlopen(f"http://127.0.0.1:{admin_port}{path}", timeout=5).status
            except urllib.error.HTTPError as e:
                code = e.code
            if code != 200:
                fail(f"probe path {path} answered {code} on a serving server")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=5).read().decode()
        if health_check(admin_port) != 0:
            fail("the Dockerfile's HEALTHCHECK fails against a serving server")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if health_check(admin_port) == 0:
        fail("the Dockerfile's HEALTHCHECK passes with no server on the admin port")

    r = run("promtool", "check", "metrics", input=metrics)
    if r.returncode != 0:
        fail(f"promtool check metrics: {r.stdout}{r.stderr}")
    exported = set(re.findall(r"^# TYPE (mlaverify_[a-z0-9_]+) ", metrics, re.M))
    referenced = {
        "deploy/prometheus/rules.yml": metric_names(open(os.path.join(DEPLOY, "prometheus", "rules.yml")).read()),
        "deploy/grafana/mlaverify.json": metric_names(open(os.path.join(DEPLOY, "grafana", "mlaverify.json")).read()),
    }
    # Families with no series until an event (CUDA graph replays on a CPU
    # server) are not in the scrape; server/admin/metrics.cc registers them.
    source = open(os.path.join(ROOT, "server", "admin", "metrics.cc")).read()
    families = exported | set(re.findall(r'"(mlaverify_[a-z0-9_]+)"', source))
    for where, names in referenced.items():
        if not names:
            fail(f"{where} names no metric")
        for name in sorted(names - families):
            fail(f"{where} uses {name}, which the server neither exports nor registers")
    # Every dashboard query parses as PromQL: each becomes a recording rule
    # (the dashboard's variables replaced by values) for promtool check rules.
    board = json.load(open(os.path.join(DEPLOY, "grafana", "mlaverify.json")))
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}",
         "expr": dashboard_expr(e)}
        for i, e in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        json.dump(rules, f)
    r = run("promtool", "check", "rules", f.name)
    os.unlink(f.name)
    if r.returncode != 0 or "$" in json.dumps(rules):
        fail(f"dashboard queries (variables substituted) do not all parse: {r.stdout}{r.stderr}")

    # Every metric family is on the dashboard or listed in
    # server/admin/README.md as deliberately left off it.
    admin_readme = open(os.path.join(ROOT, "server", "admin", "README.md")).read()
    section = re.search(r"^### Not on the dashboard\n(.*?)(?=^#|\Z)", admin_readme, re.M | re.S)
    if section is None:
        fail("server/admin/README.md has no '### Not on the dashboard' section")
        left_off = set()
    else:
        left_off = set(re.findall(r"^\| `(mlaverify_[a-z0-9_]+)` \|", section.group(1), re.M))
    dashboard = referenced["deploy/grafana/mlaverify.json"]
    for name in sorted(families - dashboard - left_off):
        fail(f"{name} is neither on the dashboard nor listed under 'Not on the dashboard' "
             "in server/admin/README.md")
    for name in sorted(left_off & dashboard):
        fail(f"{name} is on the dashboard and also listed as left off it in server/admin/README.md")
    for name in sorted(left_off - families):
        fail(f"server/admin/README.md lists {name} as left off the dashboard; no such family")
    print(f"metric families: {len(families)}, on the dashboard {len(families & dashboard)}, "
          f"left off with a reason {len(left_off & families)}")

    if shutil.which("kubectl"):
        r = run("kubectl", "kustomize", os.path.join(DEPLOY, "kubernetes"))
        if r.returncode != 0:
            fail(f"kubectl kustomize deploy/kubernetes: {r.stderr}")
    else:
        print("note: kubectl not installed; the manifests were parsed with PyYAML only")

    checked = sum(len(v) for v in referenced.values())
    print(f"deploy_check: {len(flags)} server flags, {checked} metric references, "
          f"{len(manifests)} manifests: {'FAIL' if failures else 'ok'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
