// The KV transfer's frames (kv_wire.h): fixed little-endian fields, no library needed for eight-byte headers.
#include "deepinfer/kvcache/transfer/kv_wire.h"

#include <xxhash.h>

#include <cstring>

namespace deepinfer::kvcache::transfer {
namespace {

void put_u32(std::byte* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
void put_u64(std::byte* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}
uint32_t get_u32(const std::byte* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(in[i]) << (8 * i);
  return v;
}
uint64_t get_u64(const std::byte* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

std::vector<std::byte> frame(FrameType type, size_t body_bytes) {
  std::vector<std::byte> out(kFrameHeaderBytes + body_bytes);
  const auto header = encode_frame_header(type, static_cast<uint32_t>(body_bytes));
  std::memcpy(out.data(), header.data(), header.size());
  return out;
}

constexpr size_t kRequestFixedBytes = 4 + 4 + 32 + 4 + 4;

}  // namespace

std::array<std::byte, kFrameHeaderBytes> encode_frame_header(FrameType type, uint32_t body_bytes) {
  std::array<std::byte, kFrameHeaderBytes> out{};
  out[0] = static_cast<std::byte>(type);
  put_u32(out.data() + 4, body_bytes);
  return out;
}

Result<FrameHeader> decode_frame_header(std::span<const std::byte, kFrameHeaderBytes> bytes, uint32_t max_body_bytes) {
  const auto type = static_cast<uint8_t>(bytes[0]);
  if (type < static_cast<uint8_t>(FrameType::kRequest) || type > static_cast<uint8_t>(FrameType::kError)) {
    return Status::corruption("KV transfer: unknown frame type " + std::to_string(type) +
                              " (is the peer a deepinfer KV transfer endpoint?)");
  }
  if (bytes[1] != std::byte{0} || bytes[2] != std::byte{0} || bytes[3] != std::byte{0}) {
    return Status::corruption("KV transfer: a frame header with nonzero padding");
  }
  FrameHeader header{static_cast<FrameType>(type), get_u32(bytes.data() + 4)};
  if (header.body_bytes > max_body_bytes) {
    return Status::corruption("KV transfer: a frame of " + std::to_string(header.body_bytes) +
                              " bytes, over the limit of " + std::to_string(max_body_bytes));
  }
  return header;
}

std::vector<std::byte> encode_request(const KvTransferRequest& request) {
  std::vector<std::byte> out = frame(FrameType::kRequest, kRequestFixedBytes + 4 * request.tokens.size());
  std::byte* p = out.data() + kFrameHeaderBytes;
  put_u32(p, kWireVersion);
  put_u32(p + 4, request.ttl_class);
  std::memcpy(p + 8, request.fingerprint_hex.data(), 32);
  put_u32(p + 40, request.first_block);
  put_u32(p + 44, static_cast<uint32_t>(request.tokens.size()));
  for (size_t i = 0; i < request.tokens.size(); ++i) put_u32(p + 48 + 4 * i, static_cast<uint32_t>(request.tokens[i]));
  return out;
}

Result<KvTransferRequest> decode_request(std::span<const std::byte> body) {
  if (body.size() < kRequestFixedBytes) return Status::corruption("KV transfer: a request frame too short");
  const uint32_t version = get_u32(body.data());
  if (version != kWireVersion) {
    return Status::corruption("KV transfer: wire version " + std::to_string(version) + "; this worker speaks " +
                              std::to_string(kWireVersion));
  }
  KvTransferRequest request;
  request.ttl_class = get_u32(body.data() + 4);
  request.fingerprint_hex.assign(reinterpret_cast<const char*>(body.data() + 8), 32);
  request.first_block = get_u32(body.data() + 40);
  const uint32_t n = get_u32(body.data() + 44);
  if (body.size() != kRequestFixedBytes + 4 * static_cast<size_t>(n)) {
    return Status::corruption("KV transfer: a request frame of " + std::to_string(body.size()) + " bytes for " +
                              std::to_string(n) + " tokens");
  }
  request.tokens.resize(n);
  for (uint32_t i = 0; i < n; ++i) request.tokens[i] = static_cast<int32_t>(get_u32(body.data() + 48 + 4 * i));
  return request;
}

std::array<std::byte, kFrameHeaderBytes + 4> encode_block_prefix(uint32_t block_index, size_t payload_bytes) {
  std::array<std::byte, kFrameHeaderBytes + 4> out{};
  const auto header = encode_frame_header(FrameType::kBlock, static_cast<uint32_t>(4 + payload_bytes));
  std::memcpy(out.data(), header.data(), header.size());
  put_u32(out.data() + kFrameHeaderBytes, block_index);
  return out;
}

uint32_t decode_block_index(std::span<const std::byte, 4> bytes) { return get_u32(bytes.data()); }

std::vector<std::byte> encode_done(std::span<const uint64_t> checksums) {
  std::vector<std::byte> out = frame(FrameType::kDone, 4 + 8 * checksums.size());
  std::byte* p = out.data() + kFrameHeaderBytes;
  put_u32(p, static_cast<uint32_t>(checksums.size()));
  for (size_t i = 0; i < checksums.size(); ++i) put_u64(p + 4 + 8 * i, checksums[i]);
  return out;
}

Result<std::vector<uint64_t>> decode_done(std::span<const std::byte> body) {
  if (body.size() < 4) return Status::corruption("KV transfer: a completion record too short");
  const uint32_t n = get_u32(body.data());
  if (body.size() != 4 + 8 * static_cast<size_t>(n)) {
    return Status::corruption("KV transfer: a completion record of " + std::to_string(body.size()) + " bytes for " +
                              std::to_string(n) + " blocks");
  }
  std::vector<uint64_t> checksums(n);
  for (uint32_t i = 0; i < n; ++i) checksums[i] = get_u64(body.data() + 4 + 8 * i);
  return checksums;
}

std::vector<std::byte> encode_error(std::string_view message) {
  std::vector<std::byte> out = frame(FrameType::kError, message.size());
  std::memcpy(out.data() + kFrameHeaderBytes, message.data(), message.size());
  return out;
}

uint64_t block_checksum(std::span<const std::byte> payload) { return XXH3_64bits(payload.data(), payload.size()); }

}  // namespace deepinfer::kvcache::transfer
