// Launchers of the verify attention kernels (plan, attention, combine). The
// only translation unit that includes verify_kernel.cuh.
#include <cuda_runtime.h>

#include "kernels/verify_kernel.cuh"
#include "kernels/verify_params.h"
#include "kernels/verify_pipelined_kernel.cuh"

namespace mlaverify::kernels {
namespace {

// Launches `kernel` with programmatic stream serialisation when asked: the
// grid may begin launching while its predecessor runs and waits for it in
// griddepcontrol.wait. Captured into CUDA graphs as a programmatic edge.
// `cooperative`: every CTA of the grid is resident at once or the launch
// fails (the fused combine's CTAs wait for each other).
template <typename Kernel>
cudaError_t LaunchWithDependency(Kernel kernel, dim3 grid, dim3 block, int smem_bytes,
                                 bool programmatic, cudaStream_t stream, const VerifyParams& p,
                                 bool cooperative = false) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  int count = 0;
  if (programmatic) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cooperative) {
    attributes[count].id = cudaLaunchAttributeCooperative;
    attributes[count].val.cooperative = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace

int VerifyAttentionSharedBytes() { return verify::pipelined::Shape::SMEM_BYTES; }

namespace {

// Page ids through the shared ring below 16 tokens per page.
template <bool kFused, bool kFp8>
cudaError_t LaunchPipelinedInstance(const VerifyParams& p, bool programmatic_launch,
                                    cudaStream_t stream) {
  using Shape = verify::pipelined::Shape;
  return LaunchWithDependency(p.page_size_log2 < verify::pipelined::RING_BELOW_PAGE_LOG2
                                  ? verify::PipelinedAttentionKernel<true, kFused, kFp8>
                                  : verify::PipelinedAttentionKernel<false, kFused, kFp8>,
                              dim3(p.max_work), dim3(Shape::NUM_THREADS), Shape::SMEM_BYTES,
                              programmatic_launch, stream, p, /*cooperative=*/kFused);
}

template <bool kFused>
cudaError_t LaunchPipelined(const VerifyParams& p, bool programmatic_launch, cudaStream_t stream) {
  return p.fp8_pool ? LaunchPipelinedInstance<kFused, true>(p, programmatic_launch, stream)
                    : LaunchPipelinedInstance<kFused, false>(p, programmatic_launch, stream);
}

}  // namespace

// Raises the shared-memory limit of every attention instance (both page
// paths, fused combine or not, bf16 or fp8 pool). The first reference to
// each instance in this file sets the order of the kernels in the PTX, from
// which ptxas lays out the constant bank of the fused instances' printf:
// fused first, as in the build the kernels' figures come from, keeps their
// SASS identical to it; the fp8 instances follow the bf16 ones.
cudaError_t PrepareVerifyKernels() {
  using verify::PipelinedAttentionKernel;
  using Kernel = void (*)(VerifyParams);
  const Kernel kernels[] = {
      PipelinedAttentionKernel<true, true, false>,  PipelinedAttentionKernel<false, true, false>,
      PipelinedAttentionKernel<true, false, false>, PipelinedAttentionKernel<false, false, false>,
      PipelinedAttentionKernel<true, true, true>,   PipelinedAttentionKernel<false, true, true>,
      PipelinedAttentionKernel<true, false, true>,  PipelinedAttentionKernel<false, false, true>};
  const int bytes = VerifyAttentionSharedBytes();
  for (const Kernel kernel : kernels) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t LaunchInitFusedWorkspace(unsigned int* arrivals, unsigned int* done, int keys,
                                     unsigned long long* magic, cudaStream_t stream) {
  verify::InitFusedWorkspaceKernel<<<1, 256, 0, stream>>>(arrivals, done, keys, magic);
  return cudaGetLastError();
}

bool PhaseStampsCompiledIn() {
#ifdef MLAVERIFY_PHASE_STAMPS
  return true;
#else
  return false;
#endif
}

cudaError_t SetPhaseStampBuffer(unsigned long long* stamps) {
#ifdef MLAVERIFY_PHASE_STAMPS
  return cudaMemcpyToSymbol(verify::g_phase_stamps, &stamps, sizeof(stamps));
#else
  (void)stamps;
  return cudaErrorNotSupported;
#endif
}

int FusedAttentionCtasPerSm() {
  int ctas = 0;
  const int bytes = VerifyAttentionSharedBytes();
  const int threads = verify::pipelined::Shape::NUM_THREADS;
  // The fewest over the fused instances (both page paths, both pool dtypes).
  using Kernel = void (*)(VerifyParams);
  const Kernel fused[] = {verify::PipelinedAttentionKernel<true, true, false>,
                          verify::PipelinedAttentionKernel<false, true, false>,
                          verify::PipelinedAttentionKernel<true, true, true>,
                          verify::PipelinedAttentionKernel<false, true, true>};
  bool first = true;
  for (const Kernel kernel : fused) {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, bytes) != cudaSuccess)
      return 0;
    if (first || n < ctas) ctas = n;
    first = false;
  }
  return ctas;
}

cudaError_t LaunchVerifyKernels(const VerifyParams& p, bool programmatic_launch, bool launch_plan,
                                cudaStream_t stream) {
  if (p.plan_in_warp && p.batch > kPlanInWarpMaxBatch) return cudaErrorInvalidValue;
  // The fused combine never runs beside PDL (an early-launched dependent grid
  // could hold the SMs a waiting CTA's partners need).
  if (p.fused_combine && programmatic_launch) return cudaErrorInvalidValue;
  if (!p.plan_in_warp && launch_plan) {
    verify::PlanKernel<<<1, verify::PLAN_THREADS, 0, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (p.fused_combine) return LaunchPipelined<true>(p, programmatic_launch, stream);
  const cudaError_t err = LaunchPipelined<false>(p, programmatic_launch, stream);
  if (err != cudaSuccess) return err;
  return LaunchWithDependency(verify::CombineKernel, dim3(p.max_work),
                              dim3(verify::COMBINE_THREADS), 0, programmatic_launch, stream, p);
}

}  // namespace mlaverify::kernels
