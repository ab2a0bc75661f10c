#!/usr/bin/env python3
"""What waiting for torch's current CUDA stream costs a Python client per
call (the CUDA plane's prepare step), on an idle device, in a tight loop:
Stream objects fetched each time or kept, synchronize() or query(), events.

    python3 bench/research/torch_sync_probe.py
"""
import time, torch
d = torch.device("cuda:0"); x = torch.zeros(1024, device=d); torch.cuda.synchronize()
def t(name, f, k=20000):
    for _ in range(200): f()
    a = time.perf_counter()
    for _ in range(k): f()
    print(f"{name:48s} {(time.perf_counter()-a)/k*1e6:7.2f} us", flush=True)
s = torch.cuda.current_stream(d)
t("current_stream(d)", lambda: torch.cuda.current_stream(d))
t("current_stream(d).synchronize()", lambda: torch.cuda.current_stream(d).synchronize())
t("cached stream .synchronize()", s.synchronize)
t("current_stream(d).query()", lambda: torch.cuda.current_stream(d).query())
t("cached stream .query()", s.query)
t("torch.cuda.synchronize(d)", lambda: torch.cuda.synchronize(d))
t("_cuda_getCurrentRawStream(0)", lambda: torch._C._cuda_getCurrentRawStream(0))
ev = torch.cuda.Event()
t("event record+synchronize", lambda: (ev.record(s), ev.synchronize()))
t("event record+query", lambda: (ev.record(s), ev.query()))
def busy():
    x.add_(1); torch.cuda.current_stream(d).synchronize()
t("after a tiny kernel: current_stream.synchronize", busy, 5000)
print(torch.__version__, torch.version.cuda)
