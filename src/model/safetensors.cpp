// Safetensors files and checkpoints: POSIX mmap, a header validated in full before any tensor is exposed,
// sharded directories through model.safetensors.index.json, and float32 / int64 conversion of tensors.
// Format: huggingface/safetensors README; validation follows what its reference loader rejects.
#include "deepinfer/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <boost/json.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <system_error>

#include "convert.h"
#include "json_text.h"

namespace deepinfer::model {
namespace {

namespace json = boost::json;
namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; add byte swaps");

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the reference loader's limit
constexpr uintmax_t kMaxIndexBytes = 64u << 20;     // DeepSeek-V3's index is about 9 MiB
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleFileName = "model.safetensors";

struct DTypeSpec {
  std::string_view name;
  DType dtype;
  size_t size;
};

constexpr DTypeSpec kDTypes[] = {
    {"F64", DType::kF64, 8},        {"F32", DType::kF32, 4}, {"F16", DType::kF16, 2},   {"BF16", DType::kBF16, 2},
    {"F8_E4M3", DType::kF8E4M3, 1}, {"F8_E8M0", DType::kF8E8M0, 1}, {"I64", DType::kI64, 8}, {"I32", DType::kI32, 4},   {"I16", DType::kI16, 2},
    {"I8", DType::kI8, 1},          {"U8", DType::kU8, 1},   {"BOOL", DType::kBool, 1},
};

// Defined by the safetensors format, but not loaded by this build.
constexpr std::string_view kOtherFormatDTypes[] = {"F8_E5M2", "F6_E2M3", "F6_E3M2", "F4",
                                                   "U16",     "U32",     "U64",     "C64"};

std::optional<DType> parse_dtype(std::string_view name) {
  for (const DTypeSpec& spec : kDTypes) {
    if (spec.name == name) return spec.dtype;
  }
  return std::nullopt;
}

std::string shape_string(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::string shown(const json::value& value) { return detail::json_text(value); }

std::string quote_name(std::string_view text) {
  constexpr size_t kMaxChars = 200;  // a hostile header may hold a megabyte-long name
  std::string out(1, '\'');          // built by append: g++ 12 misreports "literal" + string (-Wrestrict, PR 105329)
  out.append(text.substr(0, kMaxChars));
  if (text.size() > kMaxChars) out += "...";
  out += '\'';
  return out;
}

std::optional<uint64_t> as_uint64(const json::value& value) {
  if (value.is_uint64()) return value.get_uint64();
  if (value.is_int64() && value.get_int64() >= 0) return static_cast<uint64_t>(value.get_int64());
  return std::nullopt;
}

std::string errno_message(int error) { return std::error_code(error, std::generic_category()).message(); }

Result<json::value> parse_json_file(const fs::path& path, uintmax_t max_bytes) {
  const std::string file = path.string();
  std::error_code ec;
  uintmax_t size = fs::file_size(path, ec);
  if (ec) return Status::io_error(file + ": cannot stat: " + ec.message());
  if (size > max_bytes) {
    return Status::corruption(file + ": " + std::to_string(size) + " bytes, over the limit of " +
                              std::to_string(max_bytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error(file + ": cannot open for reading");
  std::ostringstream text;
  text << in.rdbuf();
  json::error_code parse_error;
  json::value root = json::parse(text.str(), parse_error);
  if (parse_error) return Status::corruption(file + ": not valid JSON: " + parse_error.message());
  return root;
}

// A shard name from the index: a plain file name in the checkpoint directory, nothing that climbs out of it.
bool is_plain_file_name(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\\') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

struct IndexEntry {
  std::string tensor;
  std::string shard;
};

Status parse_index(const fs::path& index_path, std::vector<IndexEntry>& entries) {
  const std::string file = index_path.string();
  Result<json::value> root = parse_json_file(index_path, kMaxIndexBytes);
  if (!root.ok()) return root.status();
  if (!root->is_object()) return Status::corruption(file + ": expected a JSON object at the top level");
  const json::value* weight_map = root->get_object().if_contains("weight_map");
  if (weight_map == nullptr) return Status::corruption(file + ": missing 'weight_map'");
  if (!weight_map->is_object() || weight_map->get_object().empty()) {
    return Status::corruption(file + ": 'weight_map' must be a non-empty object of tensor name -> shard file");
  }
  for (const auto& item : weight_map->get_object()) {
    const std::string tensor(item.key());
    if (!item.value().is_string()) {
      return Status::corruption(file + ": weight_map[" + quote_name(tensor) + "] = " + shown(item.value()) +
                                ": expected a shard file name");
    }
    std::string shard(item.value().get_string());
    if (!is_plain_file_name(shard)) {
      return Status::corruption(file + ": weight_map[" + quote_name(tensor) + "] = " + quote_name(shard) +
                                ": a shard must be a plain file name inside the checkpoint directory");
    }
    entries.push_back({tensor, std::move(shard)});
  }
  return Status();
}

bool shape_equals(const std::vector<int64_t>& shape, std::span<const int64_t> expected) {
  return std::equal(shape.begin(), shape.end(), expected.begin(), expected.end());
}

}  // namespace

std::string_view dtype_name(DType dtype) {
  for (const DTypeSpec& spec : kDTypes) {
    if (spec.dtype == dtype) return spec.name;
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  for (const DTypeSpec& spec : kDTypes) {
    if (spec.dtype == dtype) return spec.size;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;  // bounded at open(): numel * dtype_size fits in the file
  return count;
}

// ---------------------------------------------------------------------------------------------------------
// SafetensorsFile

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const fs::path& path) {
  const std::string file = path.string();
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int error = errno;
    if (error == ENOENT) return Status::not_found(file + ": no such file");
    return Status::io_error(file + ": cannot open: " + errno_message(error));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    int error = errno;
    ::close(fd);
    return Status::io_error(file + ": cannot stat: " + errno_message(error));
  }
  if (!S_ISREG(info.st_mode)) {
    ::close(fd);
    return Status::io_error(file + ": not a regular file");
  }
  const size_t size = static_cast<size_t>(info.st_size);
  if (size < 8) {
    ::close(fd);
    return Status::corruption(file + ": " + std::to_string(size) +
                              " bytes, shorter than the 8-byte header size that starts a safetensors file");
  }
  void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_error = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (mapping == MAP_FAILED)
    return Status::io_error(file + ": mmap of " + std::to_string(size) + " bytes failed: " + errno_message(map_error));

  std::unique_ptr<SafetensorsFile> result(new SafetensorsFile());
  result->path_ = path;
  result->mapping_ = mapping;
  result->mapping_size_ = size;
  try {
    Status status = result->parse_header();
    if (!status.ok()) return status;
  } catch (const std::exception& e) {  // allocation failure; JSON errors come back as error codes
    return Status::internal(file + ": reading the header: " + e.what());
  }
  return result;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

Status SafetensorsFile::parse_header() {
  const std::string file = path_.string();
  const auto* base = static_cast<const std::byte*>(mapping_);
  uint64_t header_size = 0;
  std::memcpy(&header_size, base, sizeof(header_size));
  if (header_size > kMaxHeaderBytes) {
    return Status::corruption(file + ": header size " + std::to_string(header_size) + " bytes exceeds the limit of " +
                              std::to_string(kMaxHeaderBytes) + " (100 MiB); not a safetensors file?");
  }
  if (header_size > mapping_size_ - 8) {
    return Status::corruption(file + ": header size " + std::to_string(header_size) +
                              " bytes runs past the end of the file (" + std::to_string(mapping_size_) +
                              " bytes); truncated?");
  }
  const char* header_text = reinterpret_cast<const char*>(base + 8);
  json::stream_parser parser;
  json::error_code ec;
  size_t parsed = parser.write(header_text, header_size, ec);
  if (!ec) parser.finish(ec);
  if (ec) {
    return Status::corruption(file + ": header is not valid JSON (near byte " + std::to_string(parsed) + " of " +
                              std::to_string(header_size) + "): " + ec.message());
  }
  json::value root = parser.release();
  if (!root.is_object()) return Status::corruption(file + ": header is not a JSON object");

  const std::byte* data = base + 8 + header_size;
  const uint64_t data_size = mapping_size_ - 8 - header_size;
  struct ByteRange {
    uint64_t begin;
    uint64_t end;
    size_t tensor;
  };
  std::vector<ByteRange> ranges;
  tensors_.reserve(root.get_object().size());
  for (const auto& item : root.get_object()) {
    const std::string_view name = item.key();
    const json::value& entry = item.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) return Status::corruption(file + ": '__metadata__' is not an object of strings");
      for (const auto& field : entry.get_object()) {
        if (!field.value().is_string()) {
          return Status::corruption(file + ": '__metadata__' entry " + quote_name(field.key()) + " = " +
                                    shown(field.value()) + " is not a string");
        }
        metadata_.emplace_back(std::string(field.key()), std::string(field.value().get_string()));
      }
      continue;
    }
    const std::string where = file + ": tensor " + quote_name(name) + ": ";
    if (!entry.is_object()) return Status::corruption(where + "header entry " + shown(entry) + " is not an object");
    const json::object& fields = entry.get_object();

    const json::value* dtype_value = fields.if_contains("dtype");
    if (dtype_value == nullptr || !dtype_value->is_string()) {
      return Status::corruption(where + "'dtype' is missing or not a string");
    }
    const std::string_view dtype_text = dtype_value->get_string();
    std::optional<DType> dtype = parse_dtype(dtype_text);
    if (!dtype) {
      if (std::find(std::begin(kOtherFormatDTypes), std::end(kOtherFormatDTypes), dtype_text) !=
          std::end(kOtherFormatDTypes)) {
        return Status::unsupported(where + "dtype " + quote_name(dtype_text) + " is not supported by this build");
      }
      return Status::corruption(where + "unknown dtype " + quote_name(dtype_text));
    }

    const json::value* shape_value = fields.if_contains("shape");
    if (shape_value == nullptr || !shape_value->is_array()) {
      return Status::corruption(where + "'shape' is missing or not a list");
    }
    std::vector<int64_t> shape;
    uint64_t numel = 1;
    bool overflow = false;
    for (const json::value& dim_value : shape_value->get_array()) {
      std::optional<uint64_t> dim = as_uint64(dim_value);
      if (!dim || *dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Status::corruption(where + "shape " + shown(*shape_value) + " must be a list of non-negative integers");
      }
      overflow = overflow || __builtin_mul_overflow(numel, *dim, &numel);
      shape.push_back(static_cast<int64_t>(*dim));
    }
    uint64_t needed_bytes = 0;
    overflow = overflow || __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(*dtype)), &needed_bytes);
    if (overflow) return Status::corruption(where + "shape " + shown(*shape_value) + " overflows 64-bit sizes");

    const json::value* offsets_value = fields.if_contains("data_offsets");
    std::optional<uint64_t> begin, end;
    if (offsets_value != nullptr && offsets_value->is_array() && offsets_value->get_array().size() == 2) {
      begin = as_uint64(offsets_value->get_array()[0]);
      end = as_uint64(offsets_value->get_array()[1]);
    }
    if (!begin || !end) {
      return Status::corruption(where + "'data_offsets' must be [begin, end], two non-negative integers; got " +
                                (offsets_value != nullptr ? shown(*offsets_value) : std::string("nothing")));
    }
    const std::string offsets_text = "data_offsets [" + std::to_string(*begin) + ", " + std::to_string(*end) + "]";
    if (*begin > *end) return Status::corruption(where + offsets_text + " end before they begin");
    if (*end > data_size) {
      return Status::corruption(where + offsets_text + " run past the end of the data (" + std::to_string(data_size) +
                                " bytes after the header); truncated?");
    }
    if (*end - *begin != needed_bytes) {
      return Status::corruption(where + offsets_text + " hold " + std::to_string(*end - *begin) + " bytes, but " +
                                std::string(dtype_text) + " " + shape_string(shape) + " needs " +
                                std::to_string(needed_bytes));
    }
    if (*end > *begin) ranges.push_back({*begin, *end, tensors_.size()});
    tensors_.push_back(
        TensorView{std::string(name), *dtype, std::move(shape), data + *begin, static_cast<size_t>(*end - *begin)});
  }

  std::sort(ranges.begin(), ranges.end(), [](const ByteRange& a, const ByteRange& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    const ByteRange& previous = ranges[i - 1];  // sorted and so far disjoint: the previous range ends last
    const ByteRange& current = ranges[i];
    if (current.begin < previous.end) {
      return Status::corruption(file + ": tensor " + quote_name(tensors_[current.tensor].name) + ": data_offsets [" +
                                std::to_string(current.begin) + ", " + std::to_string(current.end) +
                                "] overlap tensor " + quote_name(tensors_[previous.tensor].name) + " [" +
                                std::to_string(previous.begin) + ", " + std::to_string(previous.end) + "]");
    }
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorView& a, const TensorView& b) { return a.name < b.name; });
  std::sort(metadata_.begin(), metadata_.end());
  return Status();
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorView& tensor, std::string_view key) { return tensor.name < key; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

// ---------------------------------------------------------------------------------------------------------
// Progress

std::string format_progress_bar(std::string_view label, size_t done_bytes, size_t total_bytes, int width) {
  width = std::max(width, 1);
  done_bytes = std::min(done_bytes, total_bytes);
  const double fraction = total_bytes == 0 ? 1.0 : static_cast<double>(done_bytes) / static_cast<double>(total_bytes);
  const int filled = std::min(width, static_cast<int>(fraction * width));
  const int percent = std::min(100, static_cast<int>(fraction * 100.0));
  double unit = 1024.0;
  const char* unit_name = "KiB";
  if (total_bytes >= (size_t{1} << 30)) {
    unit = 1024.0 * 1024.0 * 1024.0;
    unit_name = "GiB";
  } else if (total_bytes >= (size_t{1} << 20)) {
    unit = 1024.0 * 1024.0;
    unit_name = "MiB";
  }
  char numbers[96];
  std::snprintf(numbers, sizeof(numbers), "] %3d%%  %.1f/%.1f %s", percent, static_cast<double>(done_bytes) / unit,
                static_cast<double>(total_bytes) / unit, unit_name);
  std::string line(label);
  line += " [";
  line.append(static_cast<size_t>(filled), '#');
  line.append(static_cast<size_t>(width - filled), '-');
  line += numbers;
  return line;
}

LoadProgress terminal_progress_bar(std::string label) {
  struct State {
    int last_permille = -1;
    bool finished = false;
  };
  const bool is_terminal = ::isatty(STDERR_FILENO) == 1;
  auto state = std::make_shared<State>();
  return [label = std::move(label), is_terminal, state](size_t done_bytes, size_t total_bytes) {
    if (!is_terminal || state->finished) return;
    const bool done = done_bytes >= total_bytes;
    const int permille =
        done ? 1000 : static_cast<int>(1000.0 * static_cast<double>(done_bytes) / static_cast<double>(total_bytes));
    if (permille == state->last_permille && !done) return;
    state->last_permille = permille;
    state->finished = done;
    std::string line(1, '\r');
    line += format_progress_bar(label, done_bytes, total_bytes);
    if (done) line += '\n';
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  };
}

// ---------------------------------------------------------------------------------------------------------
// Checkpoint

Result<std::unique_ptr<Checkpoint>> Checkpoint::open(const fs::path& dir) {
  try {
    const std::string where = dir.string();
    std::error_code ec;
    fs::file_status status = fs::status(dir, ec);
    if (!fs::exists(status)) return Status::not_found(where + ": no such file or directory");

    std::vector<IndexEntry> index;
    fs::path index_path;
    std::vector<fs::path> shard_paths;
    std::map<std::string, size_t> shard_of_name;  // shard file name -> position in shard_paths
    if (fs::is_directory(status)) {
      index_path = dir / kIndexName;
      if (fs::exists(index_path, ec)) {
        Status parsed = parse_index(index_path, index);
        if (!parsed.ok()) return parsed;
        for (const IndexEntry& entry : index) shard_of_name.emplace(entry.shard, 0);
        for (auto& [shard, position] : shard_of_name) {
          position = shard_paths.size();
          shard_paths.push_back(dir / shard);
        }
      } else if (fs::exists(dir / kSingleFileName, ec)) {
        shard_paths.push_back(dir / kSingleFileName);
      } else {
        return Status::not_found(where + ": holds neither " + kIndexName + " nor " + kSingleFileName);
      }
    } else {
      shard_paths.push_back(dir);
    }

    std::unique_ptr<Checkpoint> checkpoint(new Checkpoint());
    checkpoint->source_ = dir;
    for (const fs::path& shard_path : shard_paths) {
      Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::open(shard_path);
      if (!file.ok()) {
        if (index_path.empty()) return file.status();
        Status inner = file.status();
        std::string message = inner.message() + " (a shard named by " + index_path.string() + ")";
        switch (inner.code()) {
          case StatusCode::kNotFound:
            return Status::not_found(message);
          case StatusCode::kIoError:
            return Status::io_error(message);
          case StatusCode::kUnsupported:
            return Status::unsupported(message);
          default:
            return Status::corruption(message);
        }
      }
      checkpoint->files_.push_back(std::move(file).value());
    }
    for (const IndexEntry& entry : index) {
      const SafetensorsFile& shard = *checkpoint->files_[shard_of_name.at(entry.shard)];
      if (shard.find(entry.tensor) == nullptr) {
        return Status::corruption(index_path.string() + ": tensor " + quote_name(entry.tensor) + " is mapped to " +
                                  shard.path().string() + ", which does not hold it");
      }
    }

    for (const auto& file : checkpoint->files_) {
      for (const TensorView& tensor : file->tensors()) checkpoint->entries_.push_back({&tensor, file.get()});
    }
    std::sort(checkpoint->entries_.begin(), checkpoint->entries_.end(),
              [](const Entry& a, const Entry& b) { return a.tensor->name < b.tensor->name; });
    for (size_t i = 1; i < checkpoint->entries_.size(); ++i) {
      const Entry& a = checkpoint->entries_[i - 1];
      const Entry& b = checkpoint->entries_[i];
      if (a.tensor->name == b.tensor->name) {
        return Status::corruption(where + ": tensor " + quote_name(a.tensor->name) + " is in both " +
                                  a.file->path().string() + " and " + b.file->path().string());
      }
    }
    return checkpoint;
  } catch (const std::exception& e) {  // allocation failure
    return Status::internal(dir.string() + ": opening the checkpoint: " + e.what());
  }
}

const Checkpoint::Entry* Checkpoint::find_entry(std::string_view name) const {
  auto it = std::lower_bound(entries_.begin(), entries_.end(), name,
                             [](const Entry& entry, std::string_view key) { return entry.tensor->name < key; });
  return it != entries_.end() && it->tensor->name == name ? &*it : nullptr;
}

std::string Checkpoint::where(const Entry& entry) {
  return entry.file->path().string() + ": tensor " + quote_name(entry.tensor->name) + ": ";
}

const TensorView* Checkpoint::find(std::string_view name) const {
  const Entry* entry = find_entry(name);
  return entry != nullptr ? entry->tensor : nullptr;
}

const SafetensorsFile* Checkpoint::file_of(std::string_view name) const {
  const Entry* entry = find_entry(name);
  return entry != nullptr ? entry->file : nullptr;
}

Result<std::vector<float>> Checkpoint::load_f32(std::string_view name, std::span<const int64_t> expected_shape,
                                                int64_t block_rows, int64_t block_cols) const {
  const Entry* entry = find_entry(name);
  if (entry == nullptr) return Status::not_found(source_.string() + ": no tensor " + quote_name(name));
  const TensorView& tensor = *entry->tensor;
  if (!shape_equals(tensor.shape, expected_shape)) {
    return Status::invalid_argument(where(*entry) + std::string(dtype_name(tensor.dtype)) + " shape " +
                                    shape_string(tensor.shape) + " does not match the expected " +
                                    shape_string(expected_shape));
  }
  if (!detail::is_float_convertible(tensor.dtype)) {
    return Status::unsupported(where(*entry) + "dtype " + std::string(dtype_name(tensor.dtype)) +
                               " does not convert to float32 (F32, BF16, F16, F8_E4M3 and F8_E8M0 do)");
  }
  try {
    std::vector<float> values(static_cast<size_t>(tensor.numel()));
    if (tensor.dtype != DType::kF8E4M3) {
      detail::convert_to_f32(tensor.dtype, tensor.data, values.size(), values.data());
      return values;
    }

    if (block_rows <= 0 || block_cols <= 0) {
      return Status::invalid_argument(where(*entry) + "block size " + std::to_string(block_rows) + "x" +
                                      std::to_string(block_cols) + " must be positive");
    }
    if (tensor.shape.size() != 2) {
      return Status::unsupported(where(*entry) + "F8_E4M3 shape " + shape_string(tensor.shape) +
                                 " is not 2-D; block scales apply to [out, in] matrices");
    }
    const std::string scale_name = std::string(name) + "_scale_inv";
    const Entry* scale_entry = find_entry(scale_name);
    if (scale_entry == nullptr) {
      return Status::not_found(where(*entry) + "F8_E4M3 needs its block scales in tensor " + quote_name(scale_name) +
                               ", which the checkpoint lacks");
    }
    const TensorView& scale = *scale_entry->tensor;
    const int64_t rows = tensor.shape[0];
    const int64_t cols = tensor.shape[1];
    const int64_t scale_shape[2] = {(rows + block_rows - 1) / block_rows, (cols + block_cols - 1) / block_cols};
    if (scale.dtype != DType::kF32 && scale.dtype != DType::kBF16 && scale.dtype != DType::kF16 &&
        scale.dtype != DType::kF8E8M0) {
      return Status::unsupported(where(*scale_entry) + "dtype " + std::string(dtype_name(scale.dtype)) +
                                 " for block scales; expected F32, BF16, F16 or F8_E8M0");
    }
    if (!shape_equals(scale.shape, scale_shape)) {
      return Status::corruption(where(*scale_entry) + "shape " + shape_string(scale.shape) + " does not match " +
                                shape_string(scale_shape) + ", the " + std::to_string(block_rows) + "x" +
                                std::to_string(block_cols) + " blocks of F8_E4M3 weight " + quote_name(name) + " " +
                                shape_string(tensor.shape));
    }
    std::vector<float> scales(static_cast<size_t>(scale_shape[0] * scale_shape[1]));
    detail::convert_to_f32(scale.dtype, scale.data, scales.size(), scales.data());
    detail::dequantize_f8_block_scaled(tensor.data, rows, cols, scales.data(), block_rows, block_cols, values.data());
    return values;
  } catch (const std::bad_alloc&) {
    return Status::internal(where(*entry) + "out of memory converting " + shape_string(tensor.shape) + " to float32");
  }
}

Result<std::vector<int64_t>> Checkpoint::load_i64(std::string_view name,
                                                  std::span<const int64_t> expected_shape) const {
  const Entry* entry = find_entry(name);
  if (entry == nullptr) return Status::not_found(source_.string() + ": no tensor " + quote_name(name));
  const TensorView& tensor = *entry->tensor;
  if (!shape_equals(tensor.shape, expected_shape)) {
    return Status::invalid_argument(where(*entry) + std::string(dtype_name(tensor.dtype)) + " shape " +
                                    shape_string(tensor.shape) + " does not match the expected " +
                                    shape_string(expected_shape));
  }
  std::vector<int64_t> values(static_cast<size_t>(tensor.numel()));
  const std::byte* src = tensor.data;
  auto convert = [&]<class T>(T) {
    for (size_t i = 0; i < values.size(); ++i) {
      T value;
      std::memcpy(&value, src + i * sizeof(T), sizeof(T));
      values[i] = static_cast<int64_t>(value);
    }
  };
  switch (tensor.dtype) {
    case DType::kI64:
      convert(int64_t{});
      break;
    case DType::kI32:
      convert(int32_t{});
      break;
    case DType::kI16:
      convert(int16_t{});
      break;
    case DType::kI8:
      convert(int8_t{});
      break;
    case DType::kU8:
      convert(uint8_t{});
      break;
    case DType::kBool:
      for (size_t i = 0; i < values.size(); ++i) values[i] = src[i] != std::byte{0} ? 1 : 0;
      break;
    default:
      return Status::unsupported(where(*entry) + "dtype " + std::string(dtype_name(tensor.dtype)) +
                                 " is not an integer type (use load_f32)");
  }
  return values;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const Entry& entry : entries_) out.push_back(entry.tensor->name);
  return out;
}

size_t Checkpoint::total_bytes() const {
  size_t total = 0;
  for (const Entry& entry : entries_) total += entry.tensor->size_bytes;
  return total;
}

}  // namespace deepinfer::model
