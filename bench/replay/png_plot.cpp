// The plot raster and the PNG encoder. Rows use PNG filter "Up" (type 2), so the white background and the
// straight lines become long runs of equal bytes, which the deflate stage codes as matches at distance 1.
#include "png_plot.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

namespace deepinfer::bench {
namespace {

// ---- PNG / zlib / deflate ---------------------------------------------------------------------------------

uint32_t crc32_of(const uint8_t* data, size_t size, uint32_t crc = 0) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t adler32_of(const std::vector<uint8_t>& data) {
  uint32_t a = 1, b = 0;
  for (uint8_t byte : data) {
    a = (a + byte) % 65521;
    b = (b + a) % 65521;
  }
  return (b << 16) | a;
}

// Deflate's bit order: values LSB first; Huffman codes most significant bit first.
class BitWriter {
 public:
  void put_bits(uint32_t value, int count) {
    for (int i = 0; i < count; ++i) put_bit((value >> i) & 1u);
  }
  void put_code(uint32_t code, int length) {
    for (int i = length - 1; i >= 0; --i) put_bit((code >> i) & 1u);
  }
  std::vector<uint8_t> finish() {
    if (bit_count_ > 0) bytes_.push_back(current_);
    current_ = 0;
    bit_count_ = 0;
    return std::move(bytes_);
  }

 private:
  void put_bit(uint32_t bit) {
    current_ = static_cast<uint8_t>(current_ | (bit << bit_count_));
    if (++bit_count_ == 8) {
      bytes_.push_back(current_);
      current_ = 0;
      bit_count_ = 0;
    }
  }
  std::vector<uint8_t> bytes_;
  uint8_t current_ = 0;
  int bit_count_ = 0;
};

// RFC 1951 §3.2.6: the fixed literal/length code.
void put_literal_or_length(BitWriter& out, int symbol) {
  if (symbol <= 143) {
    out.put_code(static_cast<uint32_t>(0x30 + symbol), 8);
  } else if (symbol <= 255) {
    out.put_code(static_cast<uint32_t>(0x190 + symbol - 144), 9);
  } else if (symbol <= 279) {
    out.put_code(static_cast<uint32_t>(symbol - 256), 7);
  } else {
    out.put_code(static_cast<uint32_t>(0xC0 + symbol - 280), 8);
  }
}

// RFC 1951 §3.2.5: length codes 257..285.
void put_match_distance_1(BitWriter& out, int length) {
  static constexpr int kBase[29] = {3,  4,  5,  6,  7,  8,  9,  10, 11,  13,  15,  17,  19,  23, 27,
                                    31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258};
  static constexpr int kExtra[29] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2,
                                     2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0};
  int code = 28;
  while (kBase[code] > length) --code;
  put_literal_or_length(out, 257 + code);
  out.put_bits(static_cast<uint32_t>(length - kBase[code]), kExtra[code]);
  out.put_code(0, 5);  // distance code 0: distance 1, no extra bits
}

std::vector<uint8_t> deflate_fixed(const std::vector<uint8_t>& data) {
  BitWriter out;
  out.put_bits(1, 1);  // BFINAL
  out.put_bits(1, 2);  // BTYPE = 01, fixed Huffman codes
  size_t i = 0;
  while (i < data.size()) {
    size_t run = 0;
    if (i > 0) {
      while (i + run < data.size() && run < 258 && data[i + run] == data[i - 1]) ++run;
    }
    if (run >= 3) {
      put_match_distance_1(out, static_cast<int>(run));
      i += run;
    } else {
      put_literal_or_length(out, data[i]);
      ++i;
    }
  }
  put_literal_or_length(out, 256);  // end of block
  return out.finish();
}

void put_u32_be(std::vector<uint8_t>& out, uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(value >> shift));
}

void put_chunk(std::vector<uint8_t>& png, const char type[4], const std::vector<uint8_t>& data) {
  put_u32_be(png, static_cast<uint32_t>(data.size()));
  const size_t type_at = png.size();
  png.insert(png.end(), type, type + 4);
  png.insert(png.end(), data.begin(), data.end());
  put_u32_be(png, crc32_of(png.data() + type_at, 4 + data.size()));
}

// ---- raster and font ----------------------------------------------------------------------------------------

using Rgb = std::array<uint8_t, 3>;

// 5x7 glyphs, one string of 7 rows x 5 columns ('#' = ink).
const std::map<char, const char*>& font() {
  static const std::map<char, const char*> glyphs = {
      {'0', ".###.#...##..###.#.###..##...#.###."}, {'1', "..#...##....#....#....#....#...###."},
      {'2', ".###.#...#....#...#...#...#...#####"}, {'3', "#####...#...#.....#.....##...#.###."},
      {'4', "...#...##..#.#.#..#.#####...#....#."}, {'5', "######....####.....#....##...#.###."},
      {'6', "..##..#...#....####.#...##...#.###."}, {'7', "#####....#...#...#...#....#....#..."},
      {'8', ".###.#...##...#.###.#...##...#.###."}, {'9', ".###.#...##...#.####....#...#..##.."},
      {'A', ".###.#...##...#######...##...##...#"}, {'B', "####.#...##...#####.#...##...#####."},
      {'C', ".###.#...##....#....#....#...#.###."}, {'D', "###..#..#.#...##...##...##..#.###.."},
      {'E', "######....#....####.#....#....#####"}, {'F', "######....#....####.#....#....#...."},
      {'G', ".###.#...##....#.####...##...#.####"}, {'H', "#...##...##...#######...##...##...#"},
      {'I', ".###...#....#....#....#....#...###."}, {'J', "..###...#....#....#....#.#..#..##.."},
      {'K', "#...##..#.#.#..##...#.#..#..#.#...#"}, {'L', "#....#....#....#....#....#....#####"},
      {'M', "#...###.###.#.##.#.##...##...##...#"}, {'N', "#...##...###..##.#.##..###...##...#"},
      {'O', ".###.#...##...##...##...##...#.###."}, {'P', "####.#...##...#####.#....#....#...."},
      {'Q', ".###.#...##...##...##.#.##..#..##.#"}, {'R', "####.#...##...#####.#.#..#..#.#...#"},
      {'S', ".#####....#.....###.....#....#####."}, {'T', "#####..#....#....#....#....#....#.."},
      {'U', "#...##...##...##...##...##...#.###."}, {'V', "#...##...##...##...##...#.#.#...#.."},
      {'W', "#...##...##...##.#.##.#.##.#.#.#.#."}, {'X', "#...##...#.#.#...#...#.#.#...##...#"},
      {'Y', "#...##...#.#.#...#....#....#....#.."}, {'Z', "#####....#...#...#...#...#....#####"},
      {'.', "..........................##...##.."}, {',', ".....................##....#...#..."},
      {':', "......##...##........##...##......."}, {'(', "...#...#...#....#....#.....#.....#."},
      {')', ".#.....#.....#....#....#...#...#..."}, {'-', "...............#####..............."},
      {'_', "..............................#####"}, {'/', ".........#...#...#...#...#........."},
      {'%', "##...##..#...#...#...#...#..##...##"}, {'=', "..........#####.....#####.........."},
      {'+', ".......#....#..#####..#....#......."}, {' ', "..................................."},
  };
  return glyphs;
}

class Canvas {
 public:
  Canvas(int width, int height) : width_(width), height_(height), rgb_(static_cast<size_t>(width * height * 3), 255) {}

  void pixel(int x, int y, Rgb color) {
    if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
    uint8_t* p = &rgb_[static_cast<size_t>((y * width_ + x) * 3)];
    p[0] = color[0];
    p[1] = color[1];
    p[2] = color[2];
  }
  void fill(int x0, int y0, int x1, int y1, Rgb color) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) pixel(x, y, color);
  }
  // A line `thickness` pixels wide; `dash` > 0 draws dash-pixel strokes with equal gaps.
  void line(double x0, double y0, double x1, double y1, Rgb color, int thickness, int dash = 0) {
    const double length = std::hypot(x1 - x0, y1 - y0);
    const int steps = std::max(1, static_cast<int>(std::ceil(length)));
    for (int s = 0; s <= steps; ++s) {
      if (dash > 0 && (s / dash) % 2 == 1) continue;
      const double t = static_cast<double>(s) / steps;
      const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0)));
      const int y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
      fill(x - thickness / 2, y - thickness / 2, x + (thickness - 1) / 2, y + (thickness - 1) / 2, color);
    }
  }
  // Text at (x, y) = top-left, glyphs scaled by `scale`. Returns the width drawn.
  int text(int x, int y, const std::string& s, Rgb color, int scale = 2) {
    int cursor = x;
    for (char raw : s) {
      const char c = static_cast<char>(std::toupper(static_cast<unsigned char>(raw)));
      auto it = font().find(c);
      const char* glyph = it == font().end() ? nullptr : it->second;
      for (int row = 0; row < 7; ++row) {
        for (int col = 0; col < 5; ++col) {
          const bool ink =
              glyph == nullptr ? (row == 0 || row == 6 || col == 0 || col == 4) : glyph[row * 5 + col] == '#';
          if (ink)
            fill(cursor + col * scale, y + row * scale, cursor + col * scale + scale - 1, y + row * scale + scale - 1,
                 color);
        }
      }
      cursor += 6 * scale;
    }
    return cursor - x;
  }
  static int text_width(const std::string& s, int scale = 2) { return static_cast<int>(s.size()) * 6 * scale; }

  const std::vector<uint8_t>& rgb() const { return rgb_; }

 private:
  int width_;
  int height_;
  std::vector<uint8_t> rgb_;
};

std::string format_tick(double value, int decimals) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
}

}  // namespace

std::vector<uint8_t> encode_png_rgb(const std::vector<uint8_t>& rgb, int width, int height) {
  const size_t row_bytes = static_cast<size_t>(width) * 3;
  std::vector<uint8_t> filtered;
  filtered.reserve((row_bytes + 1) * static_cast<size_t>(height));
  for (int y = 0; y < height; ++y) {
    const uint8_t* row = rgb.data() + static_cast<size_t>(y) * row_bytes;
    if (y == 0) {
      filtered.push_back(0);  // None
      filtered.insert(filtered.end(), row, row + row_bytes);
    } else {
      filtered.push_back(2);  // Up: difference with the row above
      for (size_t i = 0; i < row_bytes; ++i) filtered.push_back(static_cast<uint8_t>(row[i] - row[i - row_bytes]));
    }
  }
  std::vector<uint8_t> zlib = {0x78, 0x01};  // deflate, 32 KiB window; (0x78 * 256 + 0x01) % 31 == 0
  std::vector<uint8_t> deflated = deflate_fixed(filtered);
  zlib.insert(zlib.end(), deflated.begin(), deflated.end());
  put_u32_be(zlib, adler32_of(filtered));

  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  std::vector<uint8_t> header;
  put_u32_be(header, static_cast<uint32_t>(width));
  put_u32_be(header, static_cast<uint32_t>(height));
  header.insert(header.end(), {8, 2, 0, 0, 0});  // 8-bit depth, RGB, deflate, adaptive filters, no interlace
  put_chunk(png, "IHDR", header);
  put_chunk(png, "IDAT", zlib);
  put_chunk(png, "IEND", {});
  return png;
}

Status write_plot_png(const std::string& path, const PlotSpec& spec) {
  double x_min = INFINITY, x_max = -INFINITY;
  for (const PlotSeries& series : spec.series) {
    for (auto [x, y] : series.points) {
      if (spec.log_x && !(x > 0)) {
        return Status::invalid_argument("plot: x value " + std::to_string(x) + " of series '" + series.label +
                                        "' is not positive on a logarithmic axis");
      }
      x_min = std::min(x_min, x);
      x_max = std::max(x_max, x);
    }
  }
  if (!(x_min < x_max)) {
    if (!(x_min <= x_max)) return Status::invalid_argument("plot: no data points");
    x_min = spec.log_x ? x_min / 2 : x_min - 1;
    x_max = spec.log_x ? x_max * 2 : x_max + 1;
  }
  // Pad the x range by 5% on each side so end markers are not cut.
  auto to_axis = [&](double x) { return spec.log_x ? std::log10(x) : x; };
  const double axis_span = to_axis(x_max) - to_axis(x_min);
  const double axis_min = to_axis(x_min) - 0.05 * axis_span, axis_max = to_axis(x_max) + 0.05 * axis_span;

  Canvas canvas(spec.width, spec.height);
  const int left = 90, right = spec.width - 30, top = 70, bottom = spec.height - 80;
  auto px = [&](double x) { return left + (to_axis(x) - axis_min) / (axis_max - axis_min) * (right - left); };
  auto py = [&](double y) { return bottom - (y - spec.y_min) / (spec.y_max - spec.y_min) * (bottom - top); };
  const Rgb black{0, 0, 0}, grid{225, 225, 225}, gray{90, 90, 90};

  // Grid and y ticks every 0.1 of the range.
  for (int i = 0; i <= 10; ++i) {
    const double y = spec.y_min + (spec.y_max - spec.y_min) * i / 10.0;
    canvas.line(left, py(y), right, py(y), grid, 1);
    const std::string label = format_tick(y, 1);
    canvas.text(left - 10 - Canvas::text_width(label), static_cast<int>(py(y)) - 7, label, gray);
  }
  int last_label_end = -1000;
  for (double x : spec.x_ticks) {
    canvas.line(px(x), top, px(x), bottom, grid, 1);
    const std::string label = format_tick(x, 0);
    const int width = Canvas::text_width(label);
    const int start = static_cast<int>(px(x)) - width / 2;
    if (start > last_label_end + 8) {
      canvas.text(start, bottom + 10, label, gray);
      last_label_end = start + width;
    }
  }
  canvas.line(left, top, left, bottom, black, 2);
  canvas.line(left, bottom, right, bottom, black, 2);
  canvas.line(left, top, right, top, black, 1);
  canvas.line(right, top, right, bottom, black, 1);

  canvas.text(left, 14, spec.title, black);
  canvas.text((left + right - Canvas::text_width(spec.x_label)) / 2, bottom + 40, spec.x_label, black);
  canvas.text(left - 80, top - 24, spec.y_label, black);

  for (const PlotSeries& series : spec.series) {
    std::vector<std::pair<double, double>> points = series.points;
    std::sort(points.begin(), points.end());
    for (size_t i = 0; i + 1 < points.size(); ++i) {
      canvas.line(px(points[i].first), py(points[i].second), px(points[i + 1].first), py(points[i + 1].second),
                  series.rgb, 3, series.dashed ? 10 : 0);
    }
    if (series.markers) {
      for (auto [x, y] : points) {
        const int cx = static_cast<int>(std::lround(px(x))), cy = static_cast<int>(std::lround(py(y)));
        canvas.fill(cx - 4, cy - 4, cx + 4, cy + 4, series.rgb);
      }
    }
  }

  // Legend, top left inside the axes: hit rates start low on the left and stay below 1.
  int legend_width = 0;
  for (const PlotSeries& series : spec.series) legend_width = std::max(legend_width, Canvas::text_width(series.label));
  const int row_height = 24;
  const int box_left = left + 12, box_right = box_left + legend_width + 70;
  const int box_top = top + 12, box_bottom = box_top + row_height * static_cast<int>(spec.series.size()) + 12;
  canvas.fill(box_left, box_top, box_right, box_bottom, Rgb{255, 255, 255});
  canvas.line(box_left, box_top, box_right, box_top, gray, 1);
  canvas.line(box_left, box_bottom, box_right, box_bottom, gray, 1);
  canvas.line(box_left, box_top, box_left, box_bottom, gray, 1);
  canvas.line(box_right, box_top, box_right, box_bottom, gray, 1);
  for (size_t i = 0; i < spec.series.size(); ++i) {
    const int y = box_top + 12 + static_cast<int>(i) * row_height;
    canvas.line(box_left + 10, y + 7, box_left + 50, y + 7, spec.series[i].rgb, 3, spec.series[i].dashed ? 10 : 0);
    canvas.text(box_left + 60, y, spec.series[i].label, black);
  }

  const std::vector<uint8_t> png = encode_png_rgb(canvas.rgb(), spec.width, spec.height);
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return Status::io_error("plot: cannot open " + path + " for writing");
  file.write(reinterpret_cast<const char*>(png.data()), static_cast<std::streamsize>(png.size()));
  if (!file) return Status::io_error("plot: writing " + path + " failed");
  return Status::ok_status();
}

}  // namespace deepinfer::bench
