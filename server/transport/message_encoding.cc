#include "server/transport/message_encoding.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace mlaverify::transport {
namespace {

using Owner = std::shared_ptr<const google::protobuf::Message>;

// Drops one slice's reference to the message whose bytes it points into.
void ReleaseOwner(void* owner) { delete static_cast<Owner*>(owner); }

// The serializer's output as gRPC slices. Bytes the serializer writes go
// into blocks handed out in windows of kAliasMinBytes: protobuf copies a
// field into its current buffer only when the field fits the space left, so
// every field of kAliasMinBytes or more reaches WriteAliasedRaw, which
// references it instead (shorter ones it copies).
class SliceWriter final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  SliceWriter(Owner owner, size_t expected) : owner_(std::move(owner)), expected_(expected) {}

  bool Next(void** data, int* size) override {
    if (used_ == block_.size()) NewBlock();
    const size_t n = std::min(kAliasMinBytes, block_.size() - used_);
    *data = const_cast<uint8_t*>(block_.begin()) + used_;
    *size = static_cast<int>(n);
    used_ += n;
    total_ += static_cast<int64_t>(n);
    return true;
  }

  void BackUp(int count) override {
    used_ -= static_cast<size_t>(count);
    total_ -= count;
  }

  int64_t ByteCount() const override { return total_; }

  bool AllowsAliasing() const override { return true; }

  bool WriteAliasedRaw(const void* data, int size) override {
    if (static_cast<size_t>(size) < kAliasMinBytes) return Copy(data, size);
    Cut();
    slices_.emplace_back(const_cast<void*>(data), static_cast<size_t>(size), &ReleaseOwner,
                         new Owner(owner_));
    total_ += size;
    return true;
  }

  // The slices written, in order (the last block cut at what it holds).
  std::vector<grpc::Slice> TakeSlices() {
    Cut();
    return std::move(slices_);
  }

 private:
  bool Copy(const void* data, int size) {
    const auto* from = static_cast<const uint8_t*>(data);
    while (size > 0) {
      void* to = nullptr;
      int room = 0;
      Next(&to, &room);
      const int n = std::min(room, size);
      std::memcpy(to, from, static_cast<size_t>(n));
      if (n < room) BackUp(room - n);
      from += n;
      size -= n;
    }
    return true;
  }

  // The block's bytes not yet in a slice become one (sharing its memory).
  void Cut() {
    if (used_ > cut_) slices_.push_back(block_.sub(cut_, used_));
    cut_ = used_;
  }

  // A fresh block sized for what is still expected (at least 64 bytes, at
  // most kMaxBlockBytes): a small message takes one allocation of its size.
  void NewBlock() {
    Cut();
    constexpr size_t kMaxBlockBytes = 8 * kAliasMinBytes;
    const size_t left =
        expected_ > static_cast<size_t>(total_) ? expected_ - static_cast<size_t>(total_) : 0;
    block_ = grpc::Slice(std::clamp<size_t>(left, 64, kMaxBlockBytes));
    used_ = 0;
    cut_ = 0;
  }

  const Owner owner_;
  const size_t expected_;
  grpc::Slice block_;  // empty until the first Next
  size_t used_ = 0;    // bytes of block_ handed out and not backed up
  size_t cut_ = 0;     // bytes of block_ already in slices_
  int64_t total_ = 0;
  std::vector<grpc::Slice> slices_;
};

}  // namespace

absl::Status EncodeInPlace(Owner message, grpc::ByteBuffer* bytes) {
  const size_t size = message->ByteSizeLong();
  if (size > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InternalError(absl::StrCat("cannot encode the ",
                                            message->GetDescriptor()->full_name(), " answer of ",
                                            size, " bytes: over protobuf's 2 GiB"));
  }
  SliceWriter writer(message, size);
  {
    google::protobuf::io::CodedOutputStream coded(&writer);
    coded.EnableAliasing(true);
    message->SerializeWithCachedSizes(&coded);
    if (coded.HadError()) {
      return absl::InternalError(
          absl::StrCat("cannot encode the ", message->GetDescriptor()->full_name(), " answer"));
    }
  }  // (the stream gives back what it did not use here)
  if (writer.ByteCount() != static_cast<int64_t>(size)) {
    return absl::InternalError(absl::StrCat("the ", message->GetDescriptor()->full_name(),
                                            " answer changed while it was encoded"));
  }
  const std::vector<grpc::Slice> slices = writer.TakeSlices();
  grpc::ByteBuffer encoded(slices.data(), slices.size());
  bytes->Swap(&encoded);
  return absl::OkStatus();
}

}  // namespace mlaverify::transport
