// Launchers of the verify attention kernels (plan, attention, combine). The
// only translation unit that includes verify_kernel.cuh.
#include <cuda_runtime.h>

#include <vector>

#include "kernels/verify_kernel.cuh"
#include "kernels/verify_pipelined_kernel.cuh"
#include "kernels/verify_params.h"

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

int VerifyAttentionSharedBytes(AttentionVariant variant) {
  switch (variant) {
    case AttentionVariant::kPipelined:
      return verify::pipelined::Shape<2>::SMEM_BYTES;
    case AttentionVariant::kPipelined16:
      return verify::pipelined::Shape<4>::SMEM_BYTES;
    default:
      return verify::SMEM_BYTES;
  }
}

bool IsSupportedAttentionVariant(AttentionVariant variant) {
  return variant == AttentionVariant::kSplitK8 || variant == AttentionVariant::kSplitK16 ||
         variant == AttentionVariant::kPipelined || variant == AttentionVariant::kPipelined16;
}

namespace {

// Raises the shared-memory limit of every instance of a pipelined shape (both
// page paths; for `pipelined` also the fused-combine ones).
template <int kKSlices>
cudaError_t PreparePipelined() {
  using verify::PipelinedAttentionKernel;
  using Kernel = void (*)(VerifyParams);
  const int bytes = verify::pipelined::Shape<kKSlices>::SMEM_BYTES;
  std::vector<Kernel> kernels = {PipelinedAttentionKernel<kKSlices, true, false>,
                                 PipelinedAttentionKernel<kKSlices, false, false>};
  if constexpr (kKSlices == 2) {
    kernels.push_back(PipelinedAttentionKernel<kKSlices, true, true>);
    kernels.push_back(PipelinedAttentionKernel<kKSlices, false, true>);
  }
  for (const Kernel kernel : kernels) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// Page ids through the shared ring below 16 tokens per page.
template <int kKSlices, bool kFused>
cudaError_t LaunchPipelined(const VerifyParams& p, bool programmatic_launch, cudaStream_t stream) {
  using Shape = verify::pipelined::Shape<kKSlices>;
  return LaunchWithDependency(p.page_size_log2 < verify::pipelined::RING_BELOW_PAGE_LOG2
                                  ? verify::PipelinedAttentionKernel<kKSlices, true, kFused>
                                  : verify::PipelinedAttentionKernel<kKSlices, false, kFused>,
                              dim3(p.max_work), dim3(Shape::NUM_THREADS), Shape::SMEM_BYTES,
                              programmatic_launch, stream, p, /*cooperative=*/kFused);
}

}  // namespace

cudaError_t PrepareVerifyKernels() {
  cudaError_t err = cudaFuncSetAttribute(
      verify::AttentionKernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, verify::SMEM_BYTES);
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(verify::AttentionKernel<16>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, verify::SMEM_BYTES);
  if (err != cudaSuccess) return err;
  err = PreparePipelined<2>();
  if (err != cudaSuccess) return err;
  return PreparePipelined<4>();
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
  const int bytes = verify::pipelined::Shape<2>::SMEM_BYTES;
  const int threads = verify::pipelined::Shape<2>::NUM_THREADS;
  int ring = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &ring, verify::PipelinedAttentionKernel<2, true, true>, threads, bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &ctas, verify::PipelinedAttentionKernel<2, false, true>, threads, bytes) != cudaSuccess) {
    return 0;
  }
  return ctas < ring ? ctas : ring;
}

cudaError_t LaunchVerifyKernels(const VerifyParams& p, AttentionVariant variant,
                                bool programmatic_launch, bool launch_plan, cudaStream_t stream) {
  if (!IsSupportedAttentionVariant(variant)) return cudaErrorInvalidValue;
  if (p.plan_in_warp && p.batch > kPlanInWarpMaxBatch) return cudaErrorInvalidValue;
  if (p.stream_plan && !RunsStreamPlan(variant)) return cudaErrorInvalidValue;
  // The fused combine: `pipelined` only, never beside PDL (an early-launched
  // dependent grid could hold the SMs a waiting CTA's partners need).
  if (p.fused_combine && (variant != AttentionVariant::kPipelined || programmatic_launch)) {
    return cudaErrorInvalidValue;
  }
  cudaError_t err = cudaSuccess;
  if (!p.plan_in_warp && launch_plan) {
    verify::PlanKernel<<<1, verify::PLAN_THREADS, 0, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  switch (variant) {
    case AttentionVariant::kPipelined:
      if (p.fused_combine) return LaunchPipelined<2, true>(p, programmatic_launch, stream);
      err = LaunchPipelined<2, false>(p, programmatic_launch, stream);
      break;
    case AttentionVariant::kPipelined16:
      err = LaunchPipelined<4, false>(p, programmatic_launch, stream);
      break;
    case AttentionVariant::kSplitK16:
      err = LaunchWithDependency(verify::AttentionKernel<16>, dim3(p.max_work),
                                 dim3(verify::WarpLayout<16>::NUM_THREADS), verify::SMEM_BYTES,
                                 programmatic_launch, stream, p);
      break;
    case AttentionVariant::kSplitK8:
      err = LaunchWithDependency(verify::AttentionKernel<8>, dim3(p.max_work),
                                 dim3(verify::WarpLayout<8>::NUM_THREADS), verify::SMEM_BYTES,
                                 programmatic_launch, stream, p);
      break;
  }
  if (err != cudaSuccess) return err;
  return LaunchWithDependency(verify::CombineKernel, dim3(p.max_work),
                              dim3(verify::COMBINE_THREADS), 0, programmatic_launch, stream, p);
}

}  // namespace mlaverify::kernels
