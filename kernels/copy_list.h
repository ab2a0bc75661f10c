// Copy lists: the one mechanism by which a device worker moves a batch's bytes
// (queries into the batch buffer, draft rows into the pool, page-table entries
// into the device's table arena, per-request scalars, and afterwards each
// output row to where its caller wants it). A list is a header and an array of
// descriptors, each `rows` rows of `row_bytes` bytes with a pitch on either
// side. The CUDA kernels of copy_list.cu run a list inside a batch's graph;
// the CPU backend runs the same list with memcpy (RunCopyListOnHost), so the
// lists the worker builds are tested without a GPU.
//
// Plain structs: compiled by nvcc and by the host compiler.
#ifndef MLAVERIFY_KERNELS_COPY_LIST_H_
#define MLAVERIFY_KERNELS_COPY_LIST_H_

#include <cstdint>

#ifdef __CUDACC__
#define MLAVERIFY_HOST_DEVICE __host__ __device__
#else
#define MLAVERIFY_HOST_DEVICE
#endif

namespace mlaverify::kernels {

struct CopyDescriptor {
  uint64_t src;  // first byte of row 0, as the executing device addresses it
  uint64_t dst;
  uint32_t src_pitch;  // bytes from one row's start to the next
  uint32_t dst_pitch;
  uint32_t row_bytes;
  uint32_t rows;
};
static_assert(sizeof(CopyDescriptor) == 32, "descriptors are read as two 16-byte vectors");

// `count` descriptors follow the header, 16-byte aligned.
struct CopyListHeader {
  int32_t count;
  int32_t reserved[3];
};
static_assert(sizeof(CopyListHeader) == 16, "descriptors start 16-byte aligned");

MLAVERIFY_HOST_DEVICE inline CopyDescriptor* CopyListEntries(CopyListHeader* list) {
  return reinterpret_cast<CopyDescriptor*>(list + 1);
}
MLAVERIFY_HOST_DEVICE inline const CopyDescriptor* CopyListEntries(const CopyListHeader* list) {
  return reinterpret_cast<const CopyDescriptor*>(list + 1);
}
// Bytes a list of `capacity` descriptors occupies.
inline constexpr uint64_t CopyListBytes(int capacity) {
  return sizeof(CopyListHeader) + static_cast<uint64_t>(capacity) * sizeof(CopyDescriptor);
}

// The gather launch of a batch: copies the list at the start of slot
// `*cursor` of a ring of `num_slots` slots (pinned host memory) into `list`
// in device memory, advances the cursor, then runs that list; so one captured
// graph serves every slot (the host fills slot k for the k-th launch in
// stream order). One block fetches the list (a few round trips to host
// memory, not one per block of the copy grid).
struct GatherParams {
  const uint8_t* slots;  // [num_slots][slot_bytes], each slot starting with a list
  uint64_t slot_bytes;
  int32_t num_slots;
  int32_t* cursor;       // device memory: the slot of the next gather launch
  CopyListHeader* list;  // device memory for `capacity` descriptors
  int32_t capacity;      // descriptors the launch may run (grid.y)
  int32_t row_blocks;    // blocks per descriptor (grid.x); each takes every row_blocks-th row
  // Null, or [num_slots][2] nanosecond stamps (%globaltimer): the gather
  // writes [slot][0] as it starts (a step lane's per-layer timing).
  uint64_t* stamps;
};

// The scatter launch: runs a list in device memory (written there by the
// batch's gather).
struct ScatterParams {
  const CopyListHeader* list;
  int32_t capacity;
  int32_t row_blocks;
  // Null, or the gather's stamps: the scatter writes [slot][1] as it starts
  // (the attention done), the slot being the one before the gather's cursor.
  uint64_t* stamps;
  const int32_t* cursor;
  int32_t num_slots;
};

// The CUDA launchers are LaunchGatherCopies / LaunchScatterCopies
// (verify_attention_cuda.h). A descriptor's addresses, pitches and row size
// need only be multiples of the widest access they allow (16, 8, 4, 2 or 1
// bytes): the kernel picks it per descriptor.

// Runs a list on the host: every address is a host pointer.
void RunCopyListOnHost(const CopyListHeader* list);

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_COPY_LIST_H_
