// Phase stamps: a diagnostic build of the verify kernels that records, per
// CTA, the %globaltimer (ns) at which thread 0 of a role passes each phase of
// the attention and combine kernels, to find where the time of a small-batch
// launch goes (bench/NOTES.md, "Kernel figures"). Compiled in only with the CMake option
// MLAVERIFY_PHASE_STAMPS=ON (a separate build directory): the default build
// has no stamp code at all, so its SASS is untouched. The benchmark reads them
// with `mlaverify-bench --phase-stamps FILE`.
//
// Layout of the device buffer: [ctas][kPhaseSlots] uint64, slot = PhaseSlot;
// 0 = not reached. Under the stream plan a CTA runs several segments: the
// per-segment slots then hold the last segment's time.
#ifndef MLAVERIFY_KERNELS_PHASE_STAMPS_H_
#define MLAVERIFY_KERNELS_PHASE_STAMPS_H_

namespace mlaverify::kernels {

enum PhaseSlot : int {
  kStampEntry = 0,          // attention CTA starts (thread 0, before the plan)
  kStampPlanned = 1,        // its item is known (after the plan's block barrier)
  kStampQReady = 2,         // score warps: Q in registers
  kStampFirstTile = 3,      // score warps: KV tile 0 landed
  kStampScoreDone = 4,      // score warps: last tile's P handed over
  kStampPvFirstTile = 5,    // PV warps: P(0) received
  kStampPvDone = 6,         // PV warps: last tile's MMAs done
  kStampStored = 7,         // PV warps: output / partial stored
  kStampArrived = 8,        // after the segment hook (fused: the split counted in)
  kStampMergeWaited = 9,    // fused: the row tile's splits have all arrived
  kStampMergeDone = 10,     // fused: this CTA's merge done
  kStampCombineEntry = 11,  // combine kernel CTA starts
  kStampCombineReady = 12,  // combine: summary and item read
  kStampCombineDone = 13,   // combine: merge done
  kStampLengths = 14,       // warp plan: the requests' lengths have arrived
  kStampPageIds = 15,       // score warps: page ids of the first tiles have arrived
  kStampPlanTotals = 16,    // warp plan: the batch totals are reduced
  kStampPlanChunk = 17,     // warp plan: the chunk length is chosen
  kStampPlanItems = 18,     // warp plan: the items are counted and scanned
  kStampPlanItem = 19,      // warp plan: this CTA's item is made
  // Inside a merge (fused or combine kernel), warp 0, the CTA's first row:
  kStampMergeStart = 20,   // the merge begins (the block barrier after the wait is passed)
  kStampMergeLoaded = 21,  // warp 0's first round of partials has landed
  kStampMergeSummed = 22,  // warp 0's splits are summed
  kStampMergeShared = 23,  // the row's warps have met in shared memory (before the row is written)
  // Raw values, not times (kFirstRawSlot on): the SM clock the CTA ran at,
  // as clock64 cycles over %globaltimer ns between its entry and the PV
  // warps' last tile, and the cycles per tile (bench/NOTES.md, "The card and the
  // floors": the SM clock under mma.sync).
  kStampClockEntry = 24,   // clock64 where kStampEntry is taken
  kStampClockPvDone = 25,  // clock64 where kStampPvDone is taken (the CTA's last segment)
  kStampTiles = 26,        // KV tiles the CTA's PV warps ran, summed over its segments
  kPhaseSlots = 27,
};
constexpr int kFirstRawSlot = kStampClockEntry;

inline const char* PhaseSlotName(int slot) {
  switch (slot) {
    case kStampEntry:
      return "entry";
    case kStampPlanned:
      return "planned";
    case kStampQReady:
      return "q_ready";
    case kStampFirstTile:
      return "first_tile";
    case kStampScoreDone:
      return "score_done";
    case kStampPvFirstTile:
      return "pv_first_tile";
    case kStampPvDone:
      return "pv_done";
    case kStampStored:
      return "stored";
    case kStampArrived:
      return "arrived";
    case kStampMergeWaited:
      return "merge_waited";
    case kStampMergeDone:
      return "merge_done";
    case kStampCombineEntry:
      return "combine_entry";
    case kStampCombineReady:
      return "combine_ready";
    case kStampCombineDone:
      return "combine_done";
    case kStampLengths:
      return "lengths";
    case kStampPageIds:
      return "page_ids";
    case kStampPlanTotals:
      return "plan_totals";
    case kStampPlanChunk:
      return "plan_chunk";
    case kStampPlanItems:
      return "plan_items";
    case kStampPlanItem:
      return "plan_item";
    case kStampMergeStart:
      return "merge_start";
    case kStampMergeLoaded:
      return "merge_loaded";
    case kStampMergeSummed:
      return "merge_summed";
    case kStampMergeShared:
      return "merge_shared";
    // (The bench's JSON holds these derived figures in the raw slots.)
    case kStampClockEntry:
      return "sm_mhz";
    case kStampClockPvDone:
      return "cycles_per_tile";
    case kStampTiles:
      return "tiles";
    default:
      return nullptr;
  }
}

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_PHASE_STAMPS_H_
