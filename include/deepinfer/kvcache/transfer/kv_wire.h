// The KV transfer's wire format between a decode worker (the receiver, which asks) and a prefill worker (the
// sender): prefill/decode disaggregation (src/server/kv_transfer.h runs it over TCP). One connection per
// transfer, in two phases: the sender writes the blocks as its chunked prefill computes them, then a completion
// record with a checksum per block; the receiver checks every block against it before the request may decode.
//
// Every frame: an 8-byte header, then `body_bytes` bytes. All integers little-endian.
//   header: u8 type, u8[3] zero, u32 body_bytes
//   kRequest (receiver -> sender), version 2 (1 had no first_block):
//     u32 version (1), u32 ttl_class, char[32] fingerprint (the block hashes' model fingerprint, lowercase hex:
//     both workers must run the same checkpoint), u32 first_block (the receiver holds blocks [0, first_block)
//     already: they are computed, or found in the sender's cache, but not sent), u32 num_tokens,
//     i32 tokens[num_tokens] (whole 64-token blocks of the prompt, optionally followed by the prompt's next token:
//     then the sender reuses every block its own cache holds and computes at least that one token, instead of
//     recomputing the last block)
//   kBlock (sender -> receiver): u32 block_index (first_block, first_block + 1, ... in order), then the block's
//     payload (the layout of block_mover.h: one 64-token block of every cache layer, in the cache dtype)
//   kDone (sender -> receiver): u32 num_blocks, u64 checksum[num_blocks] (XXH3-64, seed 0, of each payload sent,
//     in order)
//   kError (sender -> receiver): UTF-8 text, why the sender ended the transfer
// Thread-safety: pure functions.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "deepinfer/core/status.h"

namespace deepinfer::kvcache::transfer {

enum class FrameType : uint8_t { kRequest = 1, kBlock = 2, kDone = 3, kError = 4 };

inline constexpr size_t kFrameHeaderBytes = 8;
inline constexpr uint32_t kWireVersion = 2;

struct FrameHeader {
  FrameType type = FrameType::kError;
  uint32_t body_bytes = 0;
};

std::array<std::byte, kFrameHeaderBytes> encode_frame_header(FrameType type, uint32_t body_bytes);
// Errors: Corruption for an unknown type, nonzero padding, or a body over `max_body_bytes` (the reader's limit:
// a peer speaking something else never makes it allocate gigabytes).
Result<FrameHeader> decode_frame_header(std::span<const std::byte, kFrameHeaderBytes> bytes, uint32_t max_body_bytes);

struct KvTransferRequest {
  std::string fingerprint_hex;  // 32 lowercase hex digits
  uint32_t ttl_class = 0;
  uint32_t first_block = 0;     // blocks before it are not sent (the receiver holds them)
  std::vector<int32_t> tokens;  // a multiple of 64, or one more
};
// The whole frame (header and body). REQUIRES: fingerprint_hex has 32 characters.
std::vector<std::byte> encode_request(const KvTransferRequest& request);
// Errors: Corruption naming what is malformed (version, sizes).
Result<KvTransferRequest> decode_request(std::span<const std::byte> body);

// A kBlock frame's header and block index (the payload follows on the wire as it is).
std::array<std::byte, kFrameHeaderBytes + 4> encode_block_prefix(uint32_t block_index, size_t payload_bytes);
// The block index that leads a kBlock frame's body (its first 4 bytes).
uint32_t decode_block_index(std::span<const std::byte, 4> bytes);

std::vector<std::byte> encode_done(std::span<const uint64_t> checksums);
// Errors: Corruption when the body's size does not match its count.
Result<std::vector<uint64_t>> decode_done(std::span<const std::byte> body);

std::vector<std::byte> encode_error(std::string_view message);

// XXH3-64 (seed 0) of a block payload: the completion record's checksum.
uint64_t block_checksum(std::span<const std::byte> payload);

}  // namespace deepinfer::kvcache::transfer
