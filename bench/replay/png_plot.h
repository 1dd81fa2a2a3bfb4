// A line plot written as a PNG with no image library: a small RGB raster, a built-in 5x7 pixel font, and a
// PNG encoder (zlib stream of one fixed-Huffman deflate block with run-length matches; PNG spec, RFC 1950,
// RFC 1951). Enough for the benchmark's hit-rate-vs-capacity figure.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "deepinfer/core/status.h"

namespace deepinfer::bench {

struct PlotSeries {
  std::string label;
  std::array<uint8_t, 3> rgb{0, 0, 0};
  bool dashed = false;
  bool markers = true;
  std::vector<std::pair<double, double>> points;  // (x, y); x > 0 when the x axis is logarithmic
};

struct PlotSpec {
  std::string title;
  std::string x_label;
  std::string y_label;
  bool log_x = true;
  double y_min = 0.0;
  double y_max = 1.0;
  std::vector<double> x_ticks;  // labelled x positions (labels that would overlap are skipped)
  std::vector<PlotSeries> series;
  int width = 960;
  int height = 600;
};

// Renders and writes the plot (text is drawn upper-case). Errors: InvalidArgument for an empty x range or a
// non-positive x on a log axis; IoError when the file cannot be written.
Status write_plot_png(const std::string& path, const PlotSpec& spec);

// The PNG encoding of an 8-bit RGB image, `rgb` row-major [height][width][3]. REQUIRES: sizes agree.
std::vector<uint8_t> encode_png_rgb(const std::vector<uint8_t>& rgb, int width, int height);

}  // namespace deepinfer::bench
