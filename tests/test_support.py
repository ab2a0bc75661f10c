"""What the Python test scripts of tests/ share (imported from the script's
own folder, which Python puts first on sys.path)."""

import socket


def free_port():
    """A TCP port free on 127.0.0.1 now (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_expr(expr):
    """A Grafana dashboard query as Prometheus takes it: the dashboard's
    variables replaced by values that match every series ($namespace, $pod),
    Grafana's $__rate_interval by 1m (at least four scrape intervals of the
    tests' Prometheus), $kv_bytes_per_token by the demo geometry's 70272."""
    return (expr.replace("$namespace", ".*").replace("$pod", ".*")
            .replace("$__rate_interval", "1m").replace("$kv_bytes_per_token", "70272"))
