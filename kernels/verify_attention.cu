// Launchers of the verify attention kernels (plan, attention, combine). The
// only translation unit that includes verify_kernel.cuh.
#include <cuda_runtime.h>

#include "kernels/verify_kernel.cuh"
#include "kernels/verify_pipelined_kernel.cuh"
#include "kernels/verify_params.h"

namespace mlaverify::kernels {
namespace {

// Launches `kernel` with programmatic stream serialisation when asked: the
// grid may begin launching while its predecessor runs and waits for it in
// griddepcontrol.wait. Captured into CUDA graphs as a programmatic edge.
template <typename Kernel>
cudaError_t LaunchWithDependency(Kernel kernel, dim3 grid, dim3 block, int smem_bytes,
                                 bool programmatic, cudaStream_t stream, const VerifyParams& p) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic ? 1 : 0;
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

template <int kKSlices>
cudaError_t PreparePipelined() {
  const int bytes = verify::pipelined::Shape<kKSlices>::SMEM_BYTES;
  cudaError_t err = cudaFuncSetAttribute(verify::PipelinedAttentionKernel<kKSlices, true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err != cudaSuccess) return err;
  return cudaFuncSetAttribute(verify::PipelinedAttentionKernel<kKSlices, false>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// Page ids through the shared ring below 16 tokens per page.
template <int kKSlices>
cudaError_t LaunchPipelined(const VerifyParams& p, bool programmatic_launch, cudaStream_t stream) {
  using Shape = verify::pipelined::Shape<kKSlices>;
  return LaunchWithDependency(p.page_size_log2 < verify::pipelined::RING_BELOW_PAGE_LOG2
                                  ? verify::PipelinedAttentionKernel<kKSlices, true>
                                  : verify::PipelinedAttentionKernel<kKSlices, false>,
                              dim3(p.max_work), dim3(Shape::NUM_THREADS), Shape::SMEM_BYTES,
                              programmatic_launch, stream, p);
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

cudaError_t LaunchVerifyKernels(const VerifyParams& p, AttentionVariant variant,
                                bool programmatic_launch, cudaStream_t stream) {
  if (!IsSupportedAttentionVariant(variant)) return cudaErrorInvalidValue;
  if (p.plan_in_warp && p.batch > kPlanInWarpMaxBatch) return cudaErrorInvalidValue;
  if (p.stream_plan && !RunsStreamPlan(variant)) return cudaErrorInvalidValue;
  cudaError_t err = cudaSuccess;
  if (!p.plan_in_warp) {
    verify::PlanKernel<<<1, verify::PLAN_THREADS, 0, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  switch (variant) {
    case AttentionVariant::kPipelined:
      err = LaunchPipelined<2>(p, programmatic_launch, stream);
      break;
    case AttentionVariant::kPipelined16:
      err = LaunchPipelined<4>(p, programmatic_launch, stream);
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
