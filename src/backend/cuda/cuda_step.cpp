// The step of the CUDA backend: begin_step validates the layout, packs every per-row array into one pinned staging
// buffer and uploads it with one copy; embed and store_kv are the ops that read those arrays directly. The copy's
// destination is a grow-only device buffer at the same offsets for the same shapes, so that a CUDA graph captured
// on one step (run_graph) reads the next step's arrays when replayed after its begin_step.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "cuda_backend.h"
#include "deepinfer/kernels/cuda/backend_ops.h"
#include "deepinfer/core/types.h"

namespace deepinfer::backend::cuda {
namespace {

namespace kc = kernels::cuda;

constexpr int64_t kBlockTokens = ::deepinfer::kBlockTokens;  // core/types.h

std::string row_text(size_t t) { return "row " + std::to_string(t); }

}  // namespace

Status CudaBackend::begin_step(const StepLayout& layout) {
  BACKEND_CHECK(!capturing_, "begin_step inside run_graph's ops");
  activate();
  join_side_lane();  // a lane left pending by the previous step's ops ends with that step
  // Whatever happens below, no op may run on the previous step's arrays: until this call succeeds the step has no
  // rows (ops given rows then fail their shape checks).
  step_ = StepState{};
  head_ = HeadResult{};
  // An error of the previous step not yet reported: report it now rather than run on a broken state.
  if (failed()) return take_sticky();
  recycle_descriptor_arenas();
  if (failed()) return take_sticky();
  const size_t T = layout.token_ids.size();
  const size_t S = layout.block_tables.size();
  // No block tables: a model with its own cache (DeepSeek-V4); row_sequence and slots are not read.
  const bool own_cache = S == 0;
  if (own_cache && layout.positions.size() != T)
    return Status::invalid_argument("begin_step: " + std::to_string(T) + " token ids but " +
                                    std::to_string(layout.positions.size()) + " positions");
  if (!own_cache && (layout.positions.size() != T || layout.row_sequence.size() != T || layout.slots.size() != T))
    return Status::invalid_argument("begin_step: " + std::to_string(T) + " token ids but " +
                                    std::to_string(layout.positions.size()) + " positions, " +
                                    std::to_string(layout.row_sequence.size()) + " row sequences, " +
                                    std::to_string(layout.slots.size()) + " slots");
  std::vector<int32_t> rows_of_sequence(S, 0);
  for (size_t t = 0; t < T && !own_cache; ++t) {
    const int32_t seq = layout.row_sequence[t], pos = layout.positions[t];
    if (seq < 0 || static_cast<size_t>(seq) >= S)
      return Status::invalid_argument("begin_step: " + row_text(t) + " names sequence " + std::to_string(seq) + " of " +
                                      std::to_string(S));
    if (pos < 0 || pos / kBlockTokens >= static_cast<int64_t>(layout.block_tables[seq].size()))
      return Status::invalid_argument("begin_step: " + row_text(t) + " at position " + std::to_string(pos) +
                                      " but its block table covers " +
                                      std::to_string(layout.block_tables[seq].size() * kBlockTokens) + " tokens");
    if (layout.slots[t] < 0)
      return Status::invalid_argument("begin_step: " + row_text(t) + " has cache slot " +
                                      std::to_string(layout.slots[t]));
    ++rows_of_sequence[static_cast<size_t>(seq)];
  }
  for (size_t i = 0; i < layout.logits_rows.size(); ++i)
    if (layout.logits_rows[i] < 0 || static_cast<size_t>(layout.logits_rows[i]) >= T ||
        (i > 0 && layout.logits_rows[i] <= layout.logits_rows[i - 1]))
      return Status::invalid_argument("begin_step: logits_rows must ascend within [0, " + std::to_string(T) +
                                      "); entry " + std::to_string(i) + " is " + std::to_string(layout.logits_rows[i]));

  StepState st;  // becomes step_ only once everything is on its way to the device
  st.rows = static_cast<int64_t>(T);
  st.token_ids.assign(layout.token_ids.begin(), layout.token_ids.end());
  st.positions.assign(layout.positions.begin(), layout.positions.end());
  st.logits_rows.assign(layout.logits_rows.begin(), layout.logits_rows.end());
  st.sequences = static_cast<int64_t>(S);
  st.one_row_per_sequence = true;
  for (int32_t n : rows_of_sequence) st.one_row_per_sequence = st.one_row_per_sequence && n <= 1;
  st.table_rows = own_cache ? 0 : st.one_row_per_sequence ? static_cast<int64_t>(T) : static_cast<int64_t>(S);
  auto table_of_row = [&](int64_t table_row) -> const std::vector<int32_t>& {
    return layout.block_tables[st.one_row_per_sequence ? static_cast<size_t>(layout.row_sequence[table_row])
                                                       : static_cast<size_t>(table_row)];
  };
  int64_t longest = 1;
  for (int64_t r = 0; r < st.table_rows; ++r)
    longest = std::max<int64_t>(longest, static_cast<int64_t>(table_of_row(r).size()));
  if (layout.block_table_stride < 0 || (layout.block_table_stride != 0 && layout.block_table_stride < longest))
    return Status::invalid_argument("begin_step: block_table_stride " + std::to_string(layout.block_table_stride) +
                                    " is below the longest block table (" + std::to_string(longest) + " blocks)");
  st.max_blocks = layout.block_table_stride != 0 ? layout.block_table_stride : longest;

  // The expanded form: consecutive rows of one sequence form a group at consecutive positions (from 0 when
  // rows_start_at_zero); a sequence appears in one group only (cu_seqlens over the groups, in row order).
  std::vector<int32_t> cu_seqlens, q_positions, group_tables;
  st.rows_start_at_zero = layout.rows_start_at_zero;
  st.grouped = T > 0 && !own_cache;
  st.num_groups = 0;
  st.max_group_rows = 0;
  {
    std::vector<bool> seen(S, false);
    cu_seqlens.push_back(0);
    for (size_t t = 0; t < T && st.grouped; ++t) {
      const int32_t seq = layout.row_sequence[t];
      const bool starts = t == 0 || layout.row_sequence[t - 1] != seq;
      if (starts) {
        if (seen[static_cast<size_t>(seq)]) {
          if (layout.rows_start_at_zero)
            return Status::invalid_argument("begin_step: rows_start_at_zero but the rows of sequence " +
                                            std::to_string(seq) + " are not consecutive");
          st.grouped = false;
          break;
        }
        seen[static_cast<size_t>(seq)] = true;
        if (t > 0) cu_seqlens.push_back(static_cast<int32_t>(t));
        q_positions.push_back(layout.positions[t]);
        // The group's block-table row: its sequence's, or this row's on a one-row-per-sequence step.
        group_tables.push_back(st.one_row_per_sequence ? static_cast<int32_t>(t) : seq);
      }
      const int32_t local = static_cast<int32_t>(t) - cu_seqlens.back();  // back(): where this group starts
      if (layout.rows_start_at_zero && layout.positions[t] != local)
        return Status::invalid_argument("begin_step: rows_start_at_zero but " + row_text(t) + " is at position " +
                                        std::to_string(layout.positions[t]) + ", not " + std::to_string(local));
      if (layout.positions[t] != q_positions.back() + local) st.grouped = false;
    }
    if (st.grouped) {
      cu_seqlens.push_back(static_cast<int32_t>(T));
      st.num_groups = static_cast<int32_t>(cu_seqlens.size()) - 1;
      for (int32_t g = 0; g < st.num_groups; ++g) {
        const int32_t rows = cu_seqlens[g + 1] - cu_seqlens[g];
        st.max_group_rows = std::max(st.max_group_rows, rows);
        st.group_rows.push_back(rows);
        st.group_contexts.push_back(q_positions[static_cast<size_t>(g)] + rows);
      }
    } else {
      cu_seqlens.clear();
      q_positions.clear();
      group_tables.clear();
    }
  }

  // One staging layout, the same offsets in the pinned host buffer and in the device step buffer.
  ScratchLayout l;
  const size_t o_tokens = l.add(T * 4), o_positions = l.add(T * 4), o_row_table = l.add(T * 4),
               o_context = l.add(T * 4), o_slots = l.add(T * 8), o_logits = l.add(st.logits_rows.size() * 4),
               o_table = l.add(static_cast<size_t>(st.table_rows * st.max_blocks) * 4),
               o_cu = l.add(cu_seqlens.size() * 4), o_qpos = l.add(q_positions.size() * 4),
               o_gctx = l.add(st.group_contexts.size() * 4), o_gtab = l.add(group_tables.size() * 4);
  const size_t bytes = std::max<size_t>(l.bytes, 256);  // never empty: an empty step still gets valid pointers
  // The previous step's copy may still be reading the staging buffer.
  if (cudaError_t err = cudaEventSynchronize(staging_copied_); err != cudaSuccess) {
    check_cuda(err, "begin_step (waiting for the previous upload)");
    return take_sticky();
  }
  if (bytes > staging_bytes_) {
    if (staging_ != nullptr) cudaFreeHost(staging_);
    staging_ = nullptr;
    staging_bytes_ = 0;
    const size_t grown = bytes + bytes / 4;  // headroom: pinned allocations are slow, step sizes vary
    if (cudaError_t err = cudaHostAlloc(&staging_, grown, cudaHostAllocDefault); err != cudaSuccess) {
      cudaGetLastError();
      staging_ = nullptr;
      return Status::resource_exhausted("begin_step: pinned staging of " + std::to_string(grown) +
                                        " bytes: " + cudaGetErrorString(err));
    }
    staging_bytes_ = grown;
  }
  char* host = static_cast<char*>(staging_);
  std::memset(host, 0, bytes);  // also the block table's padding
  auto* row_table = reinterpret_cast<int32_t*>(host + o_row_table);
  auto* context = reinterpret_cast<int32_t*>(host + o_context);
  auto* table = reinterpret_cast<int32_t*>(host + o_table);
  if (T > 0) {
    std::memcpy(host + o_tokens, layout.token_ids.data(), T * 4);
    std::memcpy(host + o_positions, layout.positions.data(), T * 4);
    if (!own_cache) std::memcpy(host + o_slots, layout.slots.data(), T * 8);
  }
  if (!st.logits_rows.empty()) std::memcpy(host + o_logits, st.logits_rows.data(), st.logits_rows.size() * 4);
  if (!cu_seqlens.empty()) std::memcpy(host + o_cu, cu_seqlens.data(), cu_seqlens.size() * 4);
  if (!q_positions.empty()) {
    std::memcpy(host + o_qpos, q_positions.data(), q_positions.size() * 4);
    std::memcpy(host + o_gctx, st.group_contexts.data(), st.group_contexts.size() * 4);
    std::memcpy(host + o_gtab, group_tables.data(), group_tables.size() * 4);
  }
  for (size_t t = 0; t < T; ++t) {
    row_table[t] = own_cache ? 0 : st.one_row_per_sequence ? static_cast<int32_t>(t) : layout.row_sequence[t];
    context[t] = layout.positions[t] + 1;
  }
  for (int64_t r = 0; r < st.table_rows; ++r) {
    const std::vector<int32_t>& blocks = table_of_row(r);
    if (!blocks.empty()) std::memcpy(table + r * st.max_blocks, blocks.data(), blocks.size() * 4);
  }

  char* device = reserve(step_buffer_, bytes);
  if (device == nullptr) return take_sticky();
  check_cuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_), "begin_step upload");
  check_cuda(cudaEventRecord(staging_copied_, stream_), "begin_step (cudaEventRecord)");
  if (failed()) return take_sticky();
  st.token_ids_device = reinterpret_cast<const int32_t*>(device + o_tokens);
  st.positions_device = reinterpret_cast<const int32_t*>(device + o_positions);
  st.row_table_device = reinterpret_cast<const int32_t*>(device + o_row_table);
  st.row_context_device = reinterpret_cast<const int32_t*>(device + o_context);
  st.slots_device = reinterpret_cast<const int64_t*>(device + o_slots);
  st.logits_rows_device = reinterpret_cast<const int32_t*>(device + o_logits);
  st.block_table_device = reinterpret_cast<const int32_t*>(device + o_table);
  st.cu_seqlens_device = reinterpret_cast<const int32_t*>(device + o_cu);
  st.q_positions_device = reinterpret_cast<const int32_t*>(device + o_qpos);
  st.group_contexts_device = reinterpret_cast<const int32_t*>(device + o_gctx);
  st.group_tables_device = reinterpret_cast<const int32_t*>(device + o_gtab);
  step_ = std::move(st);
  return Status();
}

void CudaBackend::embed(const Weight& table, Tensor out, int64_t first_id) {
  const MatrixRef m = matrix_of(table, 0);
  BACKEND_CHECK(table.count == 1, "embed: the table must be one matrix");
  BACKEND_CHECK(out.dtype == DType::kBF16 && out.rows == step_.rows && out.cols == m.cols,
                "embed: out must be bf16 [" + std::to_string(step_.rows) + ", " + std::to_string(m.cols) + "]");
  if (failed() || out.rows == 0) return;
  kc::GatherRowsParams p;
  p.rows = out.rows;
  p.cols = m.cols;
  p.indices = step_.token_ids_device;
  p.first_index = first_id;
  p.sharded = true;  // ids outside the table: another rank's shard (the model checked them against the vocabulary)
  p.format = m.precision == Precision::kF32    ? kc::TableFormat::kF32
             : m.precision == Precision::kBF16 ? kc::TableFormat::kBF16
                                               : kc::TableFormat::kFP8;
  p.table = m.values;
  p.table_rows = m.rows;
  p.table_stride = m.stride;
  p.scales = m.scales;
  p.scale_ld = m.scale_ld;
  p.dst = static_cast<uint16_t*>(out.data);
  p.dst_stride = out.stride;
  p.stream = stream_;
  check_cuda(kc::run_gather_rows(p), "embed");
}

void CudaBackend::gather_step_rows(const Tensor& src, Tensor out) {
  BACKEND_CHECK(
      src.dtype == DType::kBF16 && out.dtype == DType::kBF16 && out.rows == step_.rows && out.cols == src.cols,
      "gather_step_rows: src and out must be bf16 with the same cols, out [" + std::to_string(step_.rows) + ", cols]");
  if (failed() || out.rows == 0) return;
  kc::GatherRowsParams p;
  p.rows = out.rows;
  p.cols = out.cols;
  p.indices = step_.token_ids_device;
  p.format = kc::TableFormat::kBF16;
  p.table = src.data;
  p.table_rows = src.rows;
  p.table_stride = src.stride;
  p.dst = static_cast<uint16_t*>(out.data);
  p.dst_stride = out.stride;
  p.stream = stream_;
  check_cuda(kc::run_gather_rows(p), "gather_step_rows");
}

void CudaBackend::store_kv(const Tensor& kv, const Buffer& cache_layer) {
  const size_t entry_bytes = static_cast<size_t>(kv.cols) * 2;
  BACKEND_CHECK(kv.dtype == DType::kBF16 && kv.rows == step_.rows,
                "store_kv: kv must be bf16 with the step's " + std::to_string(step_.rows) + " rows");
  BACKEND_CHECK(cache_layer.bytes % (entry_bytes * kBlockTokens) == 0,
                "store_kv: a cache layer of " + std::to_string(cache_layer.bytes) + " bytes is not whole blocks of " +
                    std::to_string(kBlockTokens) + " bf16 entries of " + std::to_string(kv.cols));
  if (failed() || kv.rows == 0) return;
  kc::StoreKvParams p;
  p.rows = kv.rows;
  p.dim = kv.cols;
  p.kv = static_cast<const uint16_t*>(kv.data);
  p.kv_stride = kv.stride;
  p.slots = step_.slots_device;
  p.cache = static_cast<uint16_t*>(cache_layer.data());
  p.num_slots = static_cast<int64_t>(cache_layer.bytes / entry_bytes);
  p.stream = stream_;
  check_cuda(kc::run_store_kv(p), "store_kv");
}

}  // namespace deepinfer::backend::cuda
