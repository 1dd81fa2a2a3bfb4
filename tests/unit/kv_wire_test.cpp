// The KV transfer's wire format (kvcache/transfer/kv_wire.h): round trips, and every malformed frame refused with
// Corruption rather than trusted (the byte layout itself is pinned by tests/cluster/pd_e2e.py, which speaks it from
// Python against the real workers).
#include "deepinfer/kvcache/transfer/kv_wire.h"

#include <gtest/gtest.h>

#include <cstring>

namespace deepinfer::kvcache::transfer {
namespace {

std::span<const std::byte, kFrameHeaderBytes> header_of(const std::vector<std::byte>& frame) {
  return std::span<const std::byte, kFrameHeaderBytes>(frame.data(), kFrameHeaderBytes);
}

TEST(KvWire, RequestRoundTrip) {
  KvTransferRequest request{"0123456789abcdef0123456789abcdef", 2, 1, {}};
  for (int i = 0; i < 128; ++i) request.tokens.push_back(1000 + i);
  request.tokens[5] = -1;  // the sender validates ids; the codec carries any int32
  const std::vector<std::byte> frame = encode_request(request);
  Result<FrameHeader> header = decode_frame_header(header_of(frame), 1 << 20);
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(header->type, FrameType::kRequest);
  ASSERT_EQ(header->body_bytes, frame.size() - kFrameHeaderBytes);
  Result<KvTransferRequest> back = decode_request(std::span(frame).subspan(kFrameHeaderBytes));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->fingerprint_hex, request.fingerprint_hex);
  EXPECT_EQ(back->ttl_class, 2u);
  EXPECT_EQ(back->first_block, 1u);
  EXPECT_EQ(back->tokens, request.tokens);
}

TEST(KvWire, MalformedFramesAreRefused) {
  std::vector<std::byte> frame = encode_request({"0123456789abcdef0123456789abcdef", 0, 0, {1, 2, 3}});
  // A body over the reader's limit.
  EXPECT_EQ(decode_frame_header(header_of(frame), 8).status().code(), StatusCode::kCorruption);
  // Unknown type, nonzero padding.
  std::vector<std::byte> bad = frame;
  bad[0] = std::byte{9};
  EXPECT_EQ(decode_frame_header(header_of(bad), 1 << 20).status().code(), StatusCode::kCorruption);
  bad = frame;
  bad[2] = std::byte{1};
  EXPECT_EQ(decode_frame_header(header_of(bad), 1 << 20).status().code(), StatusCode::kCorruption);
  // A token count that disagrees with the body; another wire version; a short body.
  std::span<const std::byte> body = std::span(frame).subspan(kFrameHeaderBytes);
  EXPECT_EQ(decode_request(body.first(body.size() - 4)).status().code(), StatusCode::kCorruption);
  std::vector<std::byte> other(body.begin(), body.end());
  other[0] = std::byte{7};  // no such version
  EXPECT_EQ(decode_request(other).status().code(), StatusCode::kCorruption);
  EXPECT_EQ(decode_request(body.first(10)).status().code(), StatusCode::kCorruption);
}

TEST(KvWire, CompletionRecordRoundTripAndChecksums) {
  std::vector<std::byte> a(1000, std::byte{7}), b = a;
  b[999] = std::byte{8};
  const std::vector<uint64_t> sums{block_checksum(a), block_checksum(b)};
  EXPECT_NE(sums[0], sums[1]);  // one byte apart: different checksums
  const std::vector<std::byte> frame = encode_done(sums);
  Result<std::vector<uint64_t>> back = decode_done(std::span(frame).subspan(kFrameHeaderBytes));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, sums);
  EXPECT_EQ(decode_done(std::span(frame).subspan(kFrameHeaderBytes, 12)).status().code(), StatusCode::kCorruption);
}

TEST(KvWire, BlockPrefixCarriesIndexAndSize) {
  const auto prefix = encode_block_prefix(7, 4096);
  Result<FrameHeader> header =
      decode_frame_header(std::span<const std::byte, kFrameHeaderBytes>(prefix.data(), kFrameHeaderBytes), 1 << 20);
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(header->type, FrameType::kBlock);
  EXPECT_EQ(header->body_bytes, 4096u + 4);
  uint32_t index = 0;
  std::memcpy(&index, prefix.data() + kFrameHeaderBytes, 4);
  EXPECT_EQ(index, 7u);
  const std::vector<std::byte> error = encode_error("no");
  EXPECT_EQ(decode_frame_header(header_of(error), 16)->type, FrameType::kError);
}

}  // namespace
}  // namespace deepinfer::kvcache::transfer
