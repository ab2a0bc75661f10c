#!/usr/bin/env python3
"""Checks the Kubernetes manifests as Kubernetes will see them: the output of
`kubectl kustomize` for deploy/kubernetes, the deploy/scheduler-sidecar
example and the deploy/http2-front exposure overlay (CTest `k8s_manifests`).

For every pod template (StatefulSet, Deployment, DaemonSet, Job, Pod):
- Pod Security "restricted": runAsNonRoot, no UID 0, seccompProfile
  RuntimeDefault or Localhost, and in every container allowPrivilegeEscalation
  false and capabilities drop ALL (add at most NET_BIND_SERVICE); nothing
  privileged, no host namespaces, ports or hostPath, only the volume types the
  profile allows. On top of the profile: readOnlyRootFilesystem in every
  container, with an emptyDir on /tmp.
- QoS Guaranteed: every container has cpu and memory limits, and requests
  equal to limits for every resource (nvidia.com/gpu included).
- GPU pods (nvidia.com/gpu requested) carry a nodeSelector and a toleration
  for GPU nodes, and a topology spread constraint.
- The `server` container: startupProbe on /readyz with a budget of at least
  10 minutes, livenessProbe on /healthz, readinessProbe on /readyz, all on the
  admin port; /dev/shm is an emptyDir with medium Memory and a sizeLimit; its
  image names a registry and kustomization.yaml's `images:` can replace it.
Every rendered kustomization carries a NetworkPolicy over the pods: Ingress
only, each rule naming ports the pod's containers declare and admitting
named sources (never everyone), the grpc port only scheduler-labelled pods,
the admin port a rule of its own.
Then deploy/kubernetes/podmonitor.yaml: it selects the pods' label, scrapes
the port the server container names `admin`, and takes `job` from the label
whose value rules.yml expects (mlaverify). And `yamllint -s` with
deploy/.yamllint over deploy/ and tests/deploy/, where yamllint is installed.

  k8s_check.py              check the manifests of this repository
  k8s_check.py --self-test  the same, then check that deliberately broken
                            manifests fail: one mutation per requirement of
                            the rendered StatefulSet, and
                            tests/deploy/bad-statefulset.yaml, each with the
                            problem it must report
  k8s_check.py FILE...      check these YAML files (already rendered)
Exit 77 (skipped) without kubectl or PyYAML.
"""

import copy
import os
import shutil
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
KUSTOMIZATIONS = ["deploy/kubernetes", "deploy/scheduler-sidecar", "deploy/http2-front"]
POD_KINDS = {"StatefulSet", "Deployment", "DaemonSet", "ReplicaSet", "Job", "Pod"}
# Volume types Pod Security "restricted" allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
STARTUP_BUDGET_S = 600

yaml = None


def pod_spec(obj):
    if obj["kind"] == "Pod":
        return obj["spec"]
    if obj["kind"] == "Job":
        return obj["spec"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


def containers_of(spec):
    return [(kind, c) for kind in ("initContainers", "containers", "ephemeralContainers")
            for c in spec.get(kind) or []]


def quantity(value):
    """A Kubernetes quantity as a float (enough to compare requests and limits)."""
    s = str(value)
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
                "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
                "P": 1e15, "E": 1e18}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * suffixes[suffix]
    return float(s)


def check_restricted(name, spec):
    problems = []
    psc = spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            problems.append(f"{name}: {field} is set")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"{name}: volume {volume['name']} is {sorted(kinds)}, not a type "
                            "Pod Security 'restricted' allows")
    if psc.get("runAsUser") == 0:
        problems.append(f"{name}: pod securityContext runAsUser is 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        problems.append(f"{name}: pod seccompProfile is {pod_seccomp}")
    empty_dirs = {v["name"] for v in spec.get("volumes") or [] if "emptyDir" in v}
    for kind, c in containers_of(spec):
        where = f"{name}: {kind[:-1]} {c['name']}"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"{where}: privileged")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            problems.append(f"{where}: runAsNonRoot is not true (pod or container)")
        if sc.get("runAsUser") == 0:
            problems.append(f"{where}: runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where}: seccompProfile is {seccomp}, not RuntimeDefault or Localhost")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{where}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where}: adds capabilities {sorted(caps['add'])}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                problems.append(f"{where}: hostPort {port['hostPort']}")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: readOnlyRootFilesystem is not true")
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
        if kind == "containers" and mounts.get("/tmp") not in empty_dirs:
            problems.append(f"{where}: /tmp is not an emptyDir (the root filesystem is read-only)")
    return problems


def check_guaranteed(name, spec):
    problems = []
    for kind, c in containers_of(spec):
        if kind == "ephemeralContainers":
            continue
        where = f"{name}: {kind[:-1]} {c['name']}"
        res = c.get("resources") or {}
        limits, requests = res.get("limits") or {}, res.get("requests") or {}
        for r in ("cpu", "memory"):
            if r not in limits:
                problems.append(f"{where}: no {r} limit (QoS would not be Guaranteed)")
        for r in set(limits) | set(requests):
            # A request left out defaults to the limit.
            if r not in limits:
                problems.append(f"{where}: {r} requested without a limit (QoS not Guaranteed)")
            elif r in requests and quantity(requests[r]) != quantity(limits[r]):
                problems.append(f"{where}: {r} request {requests[r]} != limit {limits[r]} "
                                "(QoS not Guaranteed)")
    return problems


def http_path(probe):
    return ((probe or {}).get("httpGet") or {}).get("path")


def check_server(name, spec, kustomization):
    problems = []
    servers = [c for c in spec.get("containers") or [] if c["name"] == "server"]
    if not servers:
        return [f"{name}: no container named server"]
    c = servers[0]
    admin = [p for p in c.get("ports") or [] if p.get("name") == "admin"]
    if not admin:
        problems.append(f"{name}: server container names no admin port")
    admin_ports = {"admin"} | {p["containerPort"] for p in admin}
    wanted = {"startupProbe": "/readyz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in wanted.items():
        got = http_path(c.get(probe))
        if got != path:
            problems.append(f"{name}: {probe} path is {got}, not {path}")
        elif c[probe]["httpGet"].get("port") not in admin_ports:
            problems.append(f"{name}: {probe} port is {c[probe]['httpGet'].get('port')}, not admin")
    startup = c.get("startupProbe") or {}
    budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    if budget < STARTUP_BUDGET_S:
        problems.append(f"{name}: startupProbe allows {budget} s, under {STARTUP_BUDGET_S} s for "
                        "pools and graphs")
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    shm = [m for m in c.get("volumeMounts") or [] if m["mountPath"] == "/dev/shm"]
    empty = (volumes.get(shm[0]["name"], {}).get("emptyDir") if shm else None) or {}
    if empty.get("medium") != "Memory" or not empty.get("sizeLimit"):
        problems.append(f"{name}: /dev/shm is not an emptyDir with medium Memory and a sizeLimit")
    gpus = (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu")
    if gpus:
        if not spec.get("nodeSelector"):
            problems.append(f"{name}: requests GPUs without a nodeSelector for GPU nodes")
        if not any("gpu" in (t.get("key") or "") for t in spec.get("tolerations") or []):
            problems.append(f"{name}: requests GPUs without a toleration for GPU nodes")
        if not spec.get("topologySpreadConstraints"):
            problems.append(f"{name}: no topologySpreadConstraints")
    image = c.get("image", "")
    repo = image.rsplit(":", 1)[0] if ":" in image.split("/")[-1] else image
    if "/" not in repo or "." not in repo.split("/")[0]:
        problems.append(f"{name}: server image {image} names no registry")
    if kustomization is not None:
        names = {i.get("name") for i in kustomization.get("images") or []}
        if repo not in names:
            problems.append(f"{name}: server image {repo} has no `images:` entry in "
                            "kustomization.yaml to override it")
    return problems


def check_front(objects):
    """The exposure overlay: the server listens on loopback only, and the port
    the Services target (grpc) belongs to the front container, which reads
    its nghttpx.conf from a mounted ConfigMap."""
    problems = []
    for obj in objects:
        if not obj or obj.get("kind") not in POD_KINDS:
            continue
        spec = pod_spec(obj)
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        by_name = {c["name"]: c for _, c in containers_of(spec)}
        server, front = by_name.get("server"), by_name.get("front")
        if server is None or front is None:
            problems.append(f"{name}: needs containers server and front")
            continue
        listen = [a for a in server.get("args") or [] if a.startswith("--listen=")]
        if not listen or not listen[-1].startswith("--listen=127.0.0.1:"):
            problems.append(f"{name}: the server must listen on loopback only, got {listen}")
        if any(p.get("name") == "grpc" for p in server.get("ports") or []):
            problems.append(f"{name}: the server container still names the grpc port")
        if not any(p.get("name") == "grpc" for p in front.get("ports") or []):
            problems.append(f"{name}: the front container names no grpc port")
        mounts = {m["mountPath"]: m["name"] for m in front.get("volumeMounts") or []}
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        conf = [a for a in front.get("args") or [] if a.startswith("--conf=")]
        directory = os.path.dirname(conf[0][len("--conf="):]) if conf else None
        if directory not in mounts or "configMap" not in volumes.get(mounts[directory], {}):
            problems.append(f"{name}: the front's --conf is not read from a mounted ConfigMap")
    return problems


def check_objects(objects, kustomization=None):
    problems = []
    for obj in objects:
        if not obj or obj.get("kind") not in POD_KINDS:
            continue
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        spec = pod_spec(obj)
        problems += check_restricted(name, spec)
        problems += check_guaranteed(name, spec)
        problems += check_server(name, spec, kustomization)
    return problems


def check_podmonitor(objects, rendered):
    problems = []
    monitors = [o for o in objects if o and o.get("kind") == "PodMonitor"]
    if not monitors:
        return ["podmonitor.yaml holds no PodMonitor"]
    sts = [o for o in rendered if o and o.get("kind") == "StatefulSet"][0]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    server = [c for c in pod_spec(sts)["containers"] if c["name"] == "server"][0]
    ports = {p.get("name") for p in server.get("ports") or []}
    for m in monitors:
        spec = m["spec"]
        for k, v in spec["selector"].get("matchLabels", {}).items():
            if labels.get(k) != v:
                problems.append(f"PodMonitor {m['metadata']['name']} selects {k}={v}, which the "
                                "pods do not carry")
        for ep in spec.get("podMetricsEndpoints") or []:
            if ep.get("port") not in ports or ep.get("port") != "admin":
                problems.append(f"PodMonitor scrapes port {ep.get('port')}, not the admin port")
            if ep.get("path", "/metrics") != "/metrics":
                problems.append(f"PodMonitor scrapes {ep.get('path')}, not /metrics")
        if labels.get(spec.get("jobLabel")) != "mlaverify":
            problems.append(f"PodMonitor's jobLabel {spec.get('jobLabel')} does not give "
                            "job=\"mlaverify\", which rules.yml matches")
    return problems


SCHEDULER_LABEL = ("mlaverify.io/role", "scheduler")


def check_network_policy(objects):
    """The pods' NetworkPolicy (deploy/kubernetes/networkpolicy.yaml)."""
    problems = []
    pods = [o for o in objects if o and o.get("kind") in POD_KINDS]
    policies = [o for o in objects if o and o.get("kind") == "NetworkPolicy"]
    for pod in pods:
        labels = pod["spec"]["template"]["metadata"].get("labels") or {}
        ports = {p.get("name") for _, c in containers_of(pod_spec(pod)) for p in c.get("ports") or []}
        mine = [n for n in policies
                if all(labels.get(k) == v for k, v in
                       (n["spec"].get("podSelector", {}).get("matchLabels") or {}).items())]
        name = f"{pod['kind']}/{pod['metadata']['name']}"
        if not mine:
            problems.append(f"{name}: no NetworkPolicy selects its pods")
            continue
        covered = {}
        for policy in mine:
            spec = policy["spec"]
            if "Ingress" not in (spec.get("policyTypes") or []):
                problems.append(f"NetworkPolicy {policy['metadata']['name']}: policyTypes has "
                                "no Ingress")
            for rule in spec.get("ingress") or []:
                sources = rule.get("from") or []
                rule_ports = [p.get("port") for p in rule.get("ports") or []]
                if not sources:
                    problems.append(f"NetworkPolicy {policy['metadata']['name']}: a rule for "
                                    f"{rule_ports or 'every port'} admits every source")
                if not rule_ports:
                    problems.append(f"NetworkPolicy {policy['metadata']['name']}: a rule names "
                                    "no port")
                for port in rule_ports:
                    if port not in ports:
                        problems.append(f"NetworkPolicy {policy['metadata']['name']}: port "
                                        f"{port} names no port of {name}")
                    covered.setdefault(port, []).extend(sources)
        for port in ("grpc", "admin"):
            if port in ports and port not in covered:
                problems.append(f"{name}: no NetworkPolicy rule admits anyone to port {port}")
        for source in covered.get("grpc", []):
            selector = (source.get("podSelector") or {}).get("matchLabels") or {}
            if selector.get(SCHEDULER_LABEL[0]) != SCHEDULER_LABEL[1]:
                problems.append(f"{name}: port grpc admits sources that are not pods labelled "
                                f"{SCHEDULER_LABEL[0]}={SCHEDULER_LABEL[1]}")
    return problems


def render(kubectl, directory):
    r = subprocess.run([kubectl, "kustomize", os.path.join(ROOT, directory)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory}: {r.stderr}")
    with open(os.path.join(ROOT, directory, "kustomization.yaml")) as f:
        kustomization = yaml.safe_load(f)
    return list(yaml.safe_load_all(r.stdout)), kustomization


def check_repository(kubectl):
    problems = []
    base = None
    for directory in KUSTOMIZATIONS:
        objects, kustomization = render(kubectl, directory)
        if not any(o and o.get("kind") in POD_KINDS for o in objects):
            problems.append(f"{directory}: renders no pod template")
        # The base's `images:` entry is the one that replaces the server's
        # image; an overlay inherits it.
        found = check_objects(objects, kustomization if directory == KUSTOMIZATIONS[0] else None)
        print(f"{directory}: {len(objects)} objects, {len(found)} problems")
        problems += [f"{directory}: {p}" for p in found]
        problems += [f"{directory}: {p}" for p in check_network_policy(objects)]
        if directory == "deploy/kubernetes":
            base = objects
        if directory == "deploy/http2-front":
            problems += [f"{directory}: {p}" for p in check_front(objects)]
    with open(os.path.join(ROOT, "deploy/kubernetes/podmonitor.yaml")) as f:
        problems += check_podmonitor(list(yaml.safe_load_all(f)), base)
    return problems, base


# One mutation per requirement: (what it breaks, the change, a substring of
# the problem the checker must report).
def server_of(o):
    return [c for c in pod_spec(o)["containers"] if c["name"] == "server"][0]


MUTATIONS = [
    ("pod runAsNonRoot", lambda o: (pod_spec(o)["securityContext"].pop("runAsNonRoot"),
                                    server_of(o)["securityContext"].pop("runAsNonRoot")),
     "runAsNonRoot is not true"),
    ("runAsUser 0", lambda o: server_of(o)["securityContext"].update(runAsUser=0),
     "runAsUser is 0"),
    ("seccomp Unconfined", lambda o: server_of(o)["securityContext"].update(
        seccompProfile={"type": "Unconfined"}), "seccompProfile is Unconfined"),
    ("no seccomp anywhere", lambda o: (pod_spec(o)["securityContext"].pop("seccompProfile"),
                                       server_of(o)["securityContext"].pop("seccompProfile")),
     "seccompProfile is None"),
    ("allowPrivilegeEscalation", lambda o: server_of(o)["securityContext"].pop(
        "allowPrivilegeEscalation"), "allowPrivilegeEscalation is not false"),
    ("capabilities", lambda o: server_of(o)["securityContext"].pop("capabilities"),
     "capabilities do not drop ALL"),
    ("added capability", lambda o: server_of(o)["securityContext"]["capabilities"].update(
        add=["SYS_ADMIN"]), "adds capabilities"),
    ("privileged", lambda o: server_of(o)["securityContext"].update(privileged=True),
     "privileged"),
    ("hostIPC", lambda o: pod_spec(o).update(hostIPC=True), "hostIPC is set"),
    ("hostPath volume", lambda o: pod_spec(o)["volumes"].append(
        {"name": "host", "hostPath": {"path": "/dev/shm"}}), "not a type Pod Security"),
    ("hostPort", lambda o: server_of(o)["ports"][0].update(hostPort=50051), "hostPort 50051"),
    ("writable root", lambda o: server_of(o)["securityContext"].update(
        readOnlyRootFilesystem=False), "readOnlyRootFilesystem is not true"),
    ("no /tmp", lambda o: server_of(o).update(volumeMounts=[
        m for m in server_of(o)["volumeMounts"] if m["mountPath"] != "/tmp"]),
     "/tmp is not an emptyDir"),
    ("memory limit", lambda o: server_of(o)["resources"]["limits"].pop("memory"),
     "no memory limit"),
    ("cpu request < limit", lambda o: server_of(o)["resources"]["requests"].update(cpu="8"),
     "cpu request 8 != limit"),
    ("gpu request only", lambda o: server_of(o)["resources"]["limits"].pop("nvidia.com/gpu"),
     "nvidia.com/gpu requested without a limit"),
    ("startup on /healthz", lambda o: server_of(o)["startupProbe"]["httpGet"].update(
        path="/healthz"), "startupProbe path is /healthz"),
    ("short startup", lambda o: server_of(o)["startupProbe"].update(failureThreshold=12),
     "startupProbe allows 60 s"),
    ("liveness on /readyz", lambda o: server_of(o)["livenessProbe"]["httpGet"].update(
        path="/readyz"), "livenessProbe path is /readyz"),
    ("readiness on /healthz", lambda o: server_of(o)["readinessProbe"]["httpGet"].update(
        path="/healthz"), "readinessProbe path is /healthz"),
    ("probe on grpc port", lambda o: server_of(o)["livenessProbe"]["httpGet"].update(
        port="grpc"), "livenessProbe port is grpc"),
    ("/dev/shm on disk", lambda o: [v["emptyDir"].pop("medium") for v in pod_spec(o)["volumes"]
                                    if v["name"] == "dshm"],
     "/dev/shm is not an emptyDir with medium Memory"),
    ("no nodeSelector", lambda o: pod_spec(o).pop("nodeSelector"), "without a nodeSelector"),
    ("no toleration", lambda o: pod_spec(o).pop("tolerations"), "without a toleration"),
    ("no spread", lambda o: pod_spec(o).pop("topologySpreadConstraints"),
     "no topologySpreadConstraints"),
    ("image without registry", lambda o: server_of(o).update(image="mlaverify:gpu"),
     "names no registry"),
]

POLICY_MUTATIONS = [
    ("no policy", lambda p, objects: objects.remove(p), "no NetworkPolicy selects its pods"),
    ("open grpc rule", lambda p, objects: p["spec"]["ingress"][0].pop("from"),
     "admits every source"),
    ("any pod of an allowed namespace",
     lambda p, objects: p["spec"]["ingress"][0]["from"][1].pop("podSelector"),
     "not pods labelled mlaverify.io/role=scheduler"),
    ("misnamed port", lambda p, objects: p["spec"]["ingress"][1]["ports"][0].update(port="metrics"),
     "port metrics names no port"),
    ("egress only", lambda p, objects: p["spec"].update(policyTypes=["Egress"]),
     "policyTypes has no Ingress"),
    ("no admin rule", lambda p, objects: p["spec"]["ingress"].pop(1),
     "no NetworkPolicy rule admits anyone to port admin"),
]

# What tests/deploy/bad-statefulset.yaml must be reported for.
BAD_FILE_PROBLEMS = [
    "hostNetwork is set",
    "container server: runAsNonRoot is not true",
    "container server: allowPrivilegeEscalation is not false",
    "container server: capabilities do not drop ALL",
    "container server: readOnlyRootFilesystem is not true",
    "container server: no memory limit",
    "container sidecar: cpu request 1 != limit 2",
    "startupProbe path is /healthz",
    "livenessProbe path is /readyz",
    "/dev/shm is not an emptyDir with medium Memory",
    "without a toleration",
]


def self_test(base):
    failures = []
    sts = [o for o in base if o and o.get("kind") == "StatefulSet"][0]
    kustomization = {"images": [{"name": server_of(sts)["image"].rsplit(":", 1)[0]}]}
    for what, mutate, expected in MUTATIONS:
        broken = copy.deepcopy(sts)
        mutate(broken)
        found = check_objects([broken], kustomization)
        if not any(expected in p for p in found):
            failures.append(f"mutation '{what}' was not reported as '{expected}' (got {found})")
    path = os.path.join(ROOT, "tests", "deploy", "bad-statefulset.yaml")
    with open(path) as f:
        found = check_objects(list(yaml.safe_load_all(f)))
    for expected in BAD_FILE_PROBLEMS:
        if not any(expected in p for p in found):
            failures.append(f"{os.path.relpath(path, ROOT)}: '{expected}' not reported")
    # The front overlay's own requirements: the base (server on every
    # address, no front) breaks each of them.
    front_found = check_front([sts])
    if not any("needs containers server and front" in p for p in front_found):
        failures.append(f"check_front: the base StatefulSet was not reported (got {front_found})")
    with_front = copy.deepcopy(sts)
    pod_spec(with_front)["containers"].append({"name": "front", "args": ["--conf=/x/n.conf"]})
    front_found = check_front([with_front])
    for expected in ("listen on loopback only", "still names the grpc port",
                     "names no grpc port", "not read from a mounted ConfigMap"):
        if not any(expected in p for p in front_found):
            failures.append(f"check_front: '{expected}' not reported (got {front_found})")
    # The NetworkPolicy: each requirement broken once on the rendered base.
    for what, mutate, expected in POLICY_MUTATIONS:
        broken = copy.deepcopy(base)
        policy = [o for o in broken if o and o.get("kind") == "NetworkPolicy"][0]
        mutate(policy, broken)
        found = check_network_policy(broken)
        if not any(expected in p for p in found):
            failures.append(f"policy mutation '{what}' was not reported as '{expected}' "
                            f"(got {found})")
    print(f"self-test: {len(MUTATIONS)} mutations of the rendered StatefulSet, "
          f"{len(POLICY_MUTATIONS)} of the NetworkPolicy, "
          f"{len(BAD_FILE_PROBLEMS)} problems of tests/deploy/bad-statefulset.yaml "
          f"({len(found)} reported): {'FAIL' if failures else 'ok'}")
    return failures


def main(argv):
    global yaml
    try:
        import yaml as yaml_module
    except ImportError:
        print("SKIPPED: python3 has no yaml module (python3-yaml; scripts/install_deps.sh installs yamllint, which brings it)")
        return 77
    yaml = yaml_module
    files = [a for a in argv if not a.startswith("--")]
    if files:
        problems = []
        for path in files:
            with open(path) as f:
                problems += check_objects(list(yaml.safe_load_all(f)))
        for p in problems:
            print("FAIL:", p)
        return 1 if problems else 0
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print("SKIPPED: kubectl is not installed (Debian's kubernetes-client; scripts/install_deps.sh installs it)")
        return 77
    problems, base = check_repository(kubectl)
    if shutil.which("yamllint"):
        r = subprocess.run(["yamllint", "-s", "-c", "deploy/.yamllint", "deploy", "tests/deploy"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        print(f"yamllint -s -c deploy/.yamllint deploy tests/deploy: rc {r.returncode}")
        if r.returncode != 0:
            problems.append(f"yamllint:\n{r.stdout}{r.stderr}")
    else:
        print("note: yamllint is not installed; the YAML was not linted")
    for p in problems:
        print("FAIL:", p)
    if "--self-test" in argv:
        for f in self_test(base):
            print("FAIL:", f)
            problems.append(f)
    print(f"k8s_check: {'FAIL' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
