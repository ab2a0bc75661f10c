// Thin wrappers over the PTX instructions the kernels use. Everything here
// exists from sm_80 up (mma.sync, ldmatrix, cp.async), except the
// programmatic-dependent-launch controls, which compile to nothing below
// sm_90, and the e4m3 conversion (sm_89 up; the builds target sm_90 and
// sm_120). No wgmma, TMA or tcgen05: the kernels must run on sm_120.
#ifndef MLAVERIFY_KERNELS_PTX_CUH_
#define MLAVERIFY_KERNELS_PTX_CUH_

#include <cstdint>

namespace mlaverify::kernels::ptx {

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that bypasses L1. With valid == false nothing
// is read and the 16 bytes are zero-filled, so padding rows never touch
// memory (unused pool rows may hold NaN).
__device__ __forceinline__ void CpAsync16(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}

// 4-byte variant (through L1: .ca is the only cache mode for sizes below 16).
__device__ __forceinline__ void CpAsync4(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_bytes));
}

// Brings the 128-byte line holding `p` into L2; no register result, no fault
// semantics beyond an ordinary load's (callers stay inside allocations).
__device__ __forceinline__ void PrefetchL2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// A value ptxas must keep in registers: it cannot see through the move, so
// it cannot rebuild the value from kernel parameters where it is used.
template <typename T>
__device__ __forceinline__ T* Opaque(T* p) {
  uint64_t v = reinterpret_cast<uint64_t>(p);
  asm volatile("mov.b64 %0, %0;" : "+l"(v));
  return reinterpret_cast<T*>(v);
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// D = A * B + D for one m16n8k16 tile: bf16 inputs, fp32 accumulators.
// (Dropping `volatile` here was measured: no gain, page-size-1 rows slower.)
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch: a dependent grid waits here until the grid
// before it has completed and its writes are visible.
__device__ __forceinline__ void GridDependencyWait() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next grid in the stream start launching (it still waits in
// GridDependencyWait for this grid's completion).
__device__ __forceinline__ void GridDependencyLaunchDependents() {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

// Barrier 0 over the whole block, like __syncthreads, usable from call sites
// that differ between warps (warp-specialised roles); orders shared memory.
__device__ __forceinline__ void BlockBarrier() { asm volatile("bar.sync 0;\n" ::: "memory"); }

// Named barriers for warp-specialised kernels: `count` threads (a multiple of
// 32, whole warps) take part. Sync waits for all of them; arrive counts this
// warp in and goes on (a producer signalling a consumer). Both order the
// shared-memory accesses before them for the threads that sync.
__device__ __forceinline__ void NamedBarrierSync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// bar.sync on named barrier `id` for `count` threads that also returns
// whether any of them passed `pred` true (barrier.cta.red.or).
__device__ __forceinline__ bool NamedBarrierAny(int id, int count, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n barrier.cta.red.or.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(count)
      : "memory");
  return any != 0;
}

__device__ __forceinline__ void NamedBarrierArrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// 2^x with flush-to-zero: one MUFU.EX2 (exp2f adds a range fix-up of three
// instructions for results below 2^-126, which a softmax weight of that size
// does not need). ex2(-inf) = +0.
__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Two e4m3 codes (the low byte first) times `scale`, as bf16x2: each code
// exactly to fp16 (cvt.rn.f16x2.e4m3x2, sm_89 and up; e4m3 is a subset of
// fp16) and on to fp32, then code * scale in fp32 (not contracted: the same
// product as E4m3ToFloat(code) * scale on the host, subnormals kept), rounded
// to nearest-even bf16.
__device__ __forceinline__ uint32_t E4m3x2ScaledToBf16x2(uint32_t codes, float scale) {
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(halves) : "h"(static_cast<unsigned short>(codes)));
  float lo, hi;
  asm("{\n .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
      : "=f"(lo), "=f"(hi)
      : "r"(halves));
  return PackBf16x2(__fmul_rn(lo, scale), __fmul_rn(hi, scale));
}

// Plain shared-memory accesses at a shared address; "memory" keeps them in
// program order with the barriers around them (ConvertFp8Row overwrites bytes
// other lanes have just read).
__device__ __forceinline__ uint2 LdShared64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ uint4 LdShared128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void StShared128(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Shared-memory words read and written by warps that do not synchronise
// (relaxed: a read returns some value the word held, never a torn one).
__device__ __forceinline__ float LdRelaxedShared(const float* p) {
  float v;
  asm volatile("ld.relaxed.cta.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(SmemAddress(p)));
  return v;
}
__device__ __forceinline__ void StRelaxedShared(float* p, float v) {
  asm volatile("st.relaxed.cta.shared.f32 [%0], %1;\n" ::"r"(SmemAddress(p)), "f"(v));
}

// a * b per bf16 half, rounded to nearest (fma.rn.bf16x2 with -0 added, so
// that +0 stays +0). With b a power of two the product is exact unless it
// falls below bf16's normal range.
__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
  return r;
}

}  // namespace mlaverify::kernels::ptx

#endif  // MLAVERIFY_KERNELS_PTX_CUH_
