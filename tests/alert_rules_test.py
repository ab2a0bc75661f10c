#!/usr/bin/env python3
"""Unit tests of the alerting rules (CTest `alert_rules`):

- `promtool check rules deploy/prometheus/rules.yml` passes;
- `promtool test rules deploy/prometheus/rules_test.yml` passes;
- every alert in rules.yml has at least one case in rules_test.yml where it
  must fire (non-empty exp_alerts) and one where it must stay silent (empty
  exp_alerts), and rules_test.yml names no alert that rules.yml lacks.

Exit 77 (skipped) without promtool or PyYAML.
"""

import os
import shutil
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROM = os.path.join(ROOT, "deploy", "prometheus")


def main():
    try:
        import yaml
    except ImportError:
        print("SKIPPED: python3 has no yaml module (python3-yaml; scripts/install_deps.sh installs yamllint, which brings it)")
        return 77
    if shutil.which("promtool") is None:
        print("SKIPPED: promtool is not installed (Debian's prometheus package; scripts/install_deps.sh installs it)")
        return 77
    failures = []

    for args in (["check", "rules", "rules.yml"], ["test", "rules", "rules_test.yml"]):
        r = subprocess.run(["promtool", *args], cwd=PROM, capture_output=True, text=True, timeout=120)
        print(f"promtool {' '.join(args)}: rc {r.returncode}")
        if r.returncode != 0:
            failures.append(f"promtool {' '.join(args)}:\n{r.stdout}{r.stderr}")

    with open(os.path.join(PROM, "rules.yml")) as f:
        rules = yaml.safe_load(f)
    with open(os.path.join(PROM, "rules_test.yml")) as f:
        tests = yaml.safe_load(f)
    alerts = [rule["alert"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule]
    fires, silent = set(), set()
    for test in tests["tests"]:
        for case in test.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else silent).add(case["alertname"])
    for alert in alerts:
        if alert not in fires:
            failures.append(f"{alert}: rules_test.yml has no case where it fires")
        if alert not in silent:
            failures.append(f"{alert}: rules_test.yml has no case where it stays silent")
    for name in sorted((fires | silent) - set(alerts)):
        failures.append(f"rules_test.yml tests {name}, which rules.yml does not define")

    for message in failures:
        print("FAIL:", message)
    print(f"alert_rules: {len(alerts)} alerts, each with firing and silent cases: "
          f"{'FAIL' if failures else 'ok'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
