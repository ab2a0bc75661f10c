#!/usr/bin/env python3
"""Checks the kernels' register and local-memory budget on every target arch.

The kernel issue asks for sm_90 and sm_120 builds from one source with no
spills in `-Xptxas -v` on either. The build prints those lines but nothing
failed when a change made ptxas spill (v13b and v27 each spilled 8 bytes in
an attention kernel on sm_90: bench/NOTES.md), so this compiles the CUDA sources again
with the build's flags, once for all archs, and fails when any kernel

  - spills (spill stores or loads > 0), or uses a stack frame (local memory),
  - needs more than 255 registers per thread,
  - or when an expected kernel is missing from ptxas's report on an arch
    (a check that reads nothing would pass vacuously).

It prints each kernel's registers per arch: the table of bench/NOTES.md, "Build facts".

    ptxas_budget.py --nvcc /usr/local/cuda/bin/nvcc --root REPO --arch 90 --arch 120 \\
        [--flags "-DMLAVERIFY_..."] kernels/verify_attention.cu kernels/kv_cache.cu
    ptxas_budget.py --self-test    # the parser must find a spill planted in a canned report

No dependencies beyond python3; CTest runs both (tests/CMakeLists.txt).
"""
import argparse
import re
import subprocess
import sys
import tempfile

# Kernels every CUDA build must report on each arch (substrings of the
# mangled names), by source file name.
EXPECTED = {
    "verify_attention.cu": ["PipelinedAttentionKernel", "CombineKernel", "PlanKernel", "InitFusedWorkspaceKernel"],
    "kv_cache.cu": ["Kernel"],
}
MAX_REGISTERS = 255

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def parse(report):
    """[(arch, kernel, registers, stack, spill_stores, spill_loads)] of a ptxas -v report."""
    kernels = []
    current = None
    for line in report.splitlines():
        m = ENTRY.search(line)
        if m:
            current = {"kernel": m.group(1), "arch": m.group(2), "regs": None, "frame": None}
            kernels.append(current)
            continue
        if current is None:
            continue
        m = FRAME.search(line)
        if m and current["frame"] is None:
            current["frame"] = tuple(int(x) for x in m.groups())
        m = USED.search(line)
        if m and current["regs"] is None:
            current["regs"] = int(m.group(1))
    return [(k["arch"], k["kernel"], k["regs"], *(k["frame"] or (None, None, None))) for k in kernels]


def problems(rows, archs, expected):
    """What breaks the budget, one line each (empty: within it)."""
    out = []
    for arch, kernel, regs, frame, stores, loads in rows:
        if regs is None or frame is None:
            out.append(f"{arch} {kernel}: ptxas printed no register or frame line")
            continue
        if stores or loads:
            out.append(f"{arch} {kernel}: spills {stores} bytes stored, {loads} bytes loaded")
        if frame:
            out.append(f"{arch} {kernel}: {frame} bytes stack frame (local memory)")
        if regs > MAX_REGISTERS:
            out.append(f"{arch} {kernel}: {regs} registers")
    for arch in archs:
        for name in expected:
            if not any(a == arch and name in k for a, k, *_ in rows):
                out.append(f"{arch}: no kernel named *{name}* in ptxas's report")
    return out


def short(kernel):
    """The kernel's readable name: c++filt (binutils, with the compiler) without
    the namespaces, e.g. PipelinedAttentionKernel<false, true>; the mangled
    name where c++filt is missing."""
    try:
        name = subprocess.run(["c++filt", "-p", kernel], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return kernel
    return re.sub(r"^(?:[\w]+::)+", "", name.replace("(anonymous namespace)::", ""))


def compile_report(nvcc, root, archs, flags, source):
    gencode = []
    for arch in archs:
        gencode += [f"--generate-code=arch=compute_{arch},code=sm_{arch}"]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-c", "-o", f"{tmp}/k.o", "-O3", "-DNDEBUG", "-DMLAVERIFY_HAVE_CUDA=1", f"-I{root}",
               "-lineinfo", "-Xptxas=-v", "--expt-relaxed-constexpr", "-std=c++17", *gencode, *flags,
               f"{root}/{source}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"nvcc failed on {source}:\n{run.stdout}{run.stderr}")
    return run.stdout + run.stderr


CANNED = """ptxas info    : Compiling entry function '_ZN9mlaverify7kernels6verify10PlanKernelENS0_12VerifyParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN9mlaverify7kernels6verify10PlanKernelENS0_12VerifyParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 57 registers, used 1 barriers, 8192 bytes smem
ptxas info    : Compiling entry function '_ZN9mlaverify7kernels6verify24PipelinedAttentionKernelILb0ELb0EEEvNS0_12VerifyParamsE' for 'sm_90'
ptxas info    : Function properties for _ZN9mlaverify7kernels6verify24PipelinedAttentionKernelILb0ELb0EEEvNS0_12VerifyParamsE
    8 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 128 registers, used 16 barriers, 1408 bytes smem
"""


def self_test():
    """The spill planted in CANNED (the size of v13b's) must be reported, and a missing kernel too."""
    found = problems(parse(CANNED), ["sm_90"], ["PlanKernel", "PipelinedAttentionKernel", "CombineKernel"])
    spill = any("PipelinedAttentionKernel" in p and "spills 8 bytes stored, 16 bytes loaded" in p for p in found)
    frame = any("8 bytes stack frame" in p for p in found)
    missing = any("*CombineKernel*" in p for p in found)
    clean = problems(parse(CANNED.replace("8 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads",
                                          "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")),
                     ["sm_90"], ["PlanKernel", "PipelinedAttentionKernel"])
    if spill and frame and missing and not clean:
        print("self-test: planted spill found, planted stack frame found, missing kernel found, clean report passes")
        return 0
    print("self-test FAILED:", found, clean)
    return 1


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvcc")
    ap.add_argument("--root", default=".")
    ap.add_argument("--arch", action="append", default=[], help="90, 120, ... (repeatable)")
    ap.add_argument("--flags", default="", help="extra nvcc flags (the build's CMAKE_CUDA_FLAGS)")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("sources", nargs="*")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.nvcc or not a.arch or not a.sources:
        ap.error("--nvcc, --arch and sources are required")
    archs = [f"sm_{x}" for x in a.arch]
    failures = []
    for source in a.sources:
        rows = parse(compile_report(a.nvcc, a.root, a.arch, a.flags.split(), source))
        expected = next((v for k, v in EXPECTED.items() if source.endswith(k)), [])
        failures += problems(rows, archs, expected)
        print(f"{source}: {len(rows)} kernel builds")
        for arch, kernel, regs, frame, stores, loads in sorted(rows):
            print(f"  {arch:7} {regs!s:>4} registers  stack {frame!s:>3}  spills {stores}/{loads}  {short(kernel)}")
    if failures:
        print("OVER BUDGET:")
        for f in failures:
            print("  " + f)
        return 1
    print(f"within budget on {', '.join(archs)}: no spills, no stack frames, <= {MAX_REGISTERS} registers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
