// EncodeInPlace: the bytes gRPC sends are exactly protobuf's serialization,
// large fields are referenced in the message instead of copied, and the
// message lives exactly as long as the encoded bytes reference it.
#include "server/transport/message_encoding.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "mlaverify/v1/verify.pb.h"

namespace mlaverify::transport {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

// A Verify answer of `items` results, out `out_bytes` and lse `lse_bytes` each.
std::shared_ptr<v1::VerifyResponse> Answer(int items, size_t out_bytes, size_t lse_bytes) {
  auto r = std::make_shared<v1::VerifyResponse>();
  r->set_request_id(77);
  r->set_layer(3);
  for (int k = 0; k < items; ++k) {
    v1::VerifyResult* result = r->add_results();
    result->set_sequence_id(1000 + k);
    result->set_prefix_len(4096 + k);
    result->mutable_out()->set_dtype(v1::DTYPE_BF16);
    for (int64_t d : {16, 8, 512}) result->mutable_out()->add_shape(d);
    result->mutable_out()->set_raw(RandomBytes(out_bytes, 2 * k + 1));
    result->mutable_lse()->set_dtype(v1::DTYPE_FP32);
    for (int64_t d : {16, 8}) result->mutable_lse()->add_shape(d);
    result->mutable_lse()->set_raw(RandomBytes(lse_bytes, 2 * k + 2));
  }
  return r;
}

std::vector<grpc::Slice> SlicesOf(const grpc::ByteBuffer& bytes) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bytes.Dump(&slices).ok());
  return slices;
}

std::string Flat(const grpc::ByteBuffer& bytes) {
  std::string s;
  for (const grpc::Slice& slice : SlicesOf(bytes)) {
    s.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return s;
}

// Whether a slice of `bytes` starts at `data` (the field referenced in place).
bool Referenced(const grpc::ByteBuffer& bytes, const std::string& field) {
  for (const grpc::Slice& slice : SlicesOf(bytes)) {
    if (reinterpret_cast<const char*>(slice.begin()) == field.data()) return true;
  }
  return false;
}

TEST(EncodeInPlaceTest, VerifyAnswerIsProtobufsBytesWithTheOutTensorsReferenced) {
  std::shared_ptr<v1::VerifyResponse> answer = Answer(3, 16 * 8 * 512 * 2, 16 * 8 * 4);
  const std::string expected = answer->SerializeAsString();
  grpc::ByteBuffer bytes;
  ASSERT_TRUE(EncodeInPlace(answer, &bytes).ok());
  EXPECT_EQ(bytes.Length(), expected.size());
  EXPECT_EQ(Flat(bytes), expected);
  for (const v1::VerifyResult& result : answer->results()) {
    EXPECT_TRUE(Referenced(bytes, result.out().raw()));   // 128 KiB: not copied
    EXPECT_FALSE(Referenced(bytes, result.lse().raw()));  // 512 bytes: copied with the framing
  }
  v1::VerifyResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flat(bytes)));
  EXPECT_EQ(parsed.results(2).out().raw(), answer->results(2).out().raw());
}

TEST(EncodeInPlaceTest, FieldsFromTheThresholdOnAreReferencedShorterOnesCopied) {
  for (size_t n : {kAliasMinBytes - 1, kAliasMinBytes, kAliasMinBytes + 1, 3 * kAliasMinBytes}) {
    std::shared_ptr<v1::VerifyResponse> answer = Answer(5, n, n);
    grpc::ByteBuffer bytes;
    ASSERT_TRUE(EncodeInPlace(answer, &bytes).ok());
    EXPECT_EQ(Flat(bytes), answer->SerializeAsString()) << n;
    for (const v1::VerifyResult& result : answer->results()) {
      EXPECT_EQ(Referenced(bytes, result.out().raw()), n >= kAliasMinBytes) << n;
      EXPECT_EQ(Referenced(bytes, result.lse().raw()), n >= kAliasMinBytes) << n;
    }
  }
}

TEST(EncodeInPlaceTest, MessageLivesUntilTheLastCopyOfItsBytesIsGone) {
  std::shared_ptr<v1::VerifyResponse> answer = Answer(2, 64 << 10, 64);
  const std::string expected = answer->SerializeAsString();
  std::weak_ptr<v1::VerifyResponse> alive = answer;
  auto bytes = std::make_unique<grpc::ByteBuffer>();
  ASSERT_TRUE(EncodeInPlace(std::move(answer), bytes.get()).ok());
  EXPECT_FALSE(alive.expired());
  grpc::ByteBuffer copy(*bytes);  // as gRPC holds it while writing
  bytes.reset();
  EXPECT_FALSE(alive.expired());
  EXPECT_EQ(Flat(copy), expected);
  copy.Clear();
  EXPECT_TRUE(alive.expired());
}

TEST(EncodeInPlaceTest, SmallAndEmptyMessagesAreCopiedAndTheirMessageFreedAtOnce) {
  for (int items : {0, 1}) {
    std::shared_ptr<v1::VerifyResponse> answer = Answer(items, 100, 16);
    if (items == 0) answer->Clear();
    const std::string expected = answer->SerializeAsString();
    std::weak_ptr<v1::VerifyResponse> alive = answer;
    grpc::ByteBuffer bytes;
    ASSERT_TRUE(EncodeInPlace(std::move(answer), &bytes).ok());
    EXPECT_TRUE(alive.expired()) << items;  // nothing referenced
    EXPECT_EQ(Flat(bytes), expected) << items;
    EXPECT_EQ(bytes.Length(), expected.size()) << items;
  }
}

TEST(EncodeInPlaceTest, ManySmallFieldsSpanBlocks) {
  // More framing than one block holds: blocks follow one another in order.
  std::shared_ptr<v1::VerifyResponse> answer = Answer(400, 200, 300);
  grpc::ByteBuffer bytes;
  ASSERT_TRUE(EncodeInPlace(answer, &bytes).ok());
  EXPECT_EQ(Flat(bytes), answer->SerializeAsString());
}

}  // namespace
}  // namespace mlaverify::transport
