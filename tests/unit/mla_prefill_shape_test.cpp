// choose_mla_prefill_shape (include/deepinfer/kernels/cuda/mla_prefill_shape.h): the expanded MLA attention's rows
// per CTA and key splits for the shapes measured on an H100 (132 SMs; bench/gpu/NOTES.md, 2026-12-06), including
// the case that broke (causal prefills at 128 heads split 4 ways: 2.00 -> 2.71 ms).
#include "deepinfer/kernels/cuda/mla_prefill_shape.h"

#include <gtest/gtest.h>

namespace deepinfer::kernels::cuda {
namespace {

// One sequence of `rows` query rows whose CTAs see up to `keys` keys, H heads, on 132 SMs.
MlaPrefillShape shape(int64_t rows, int64_t keys, int64_t heads, int64_t max_splits, bool overlap = true) {
  MlaPrefillGrid g;
  g.tiles_64 = (rows + 63) / 64;
  g.tiles_128 = (rows + 127) / 128;
  g.heads = heads;
  g.sms = 132;
  g.max_keys = keys;
  g.overlap = overlap;
  g.max_splits = max_splits;
  return choose_mla_prefill_shape(g);
}

void expect_shape(const MlaPrefillShape& got, int rows_per_cta, int key_splits) {
  EXPECT_EQ(got.rows_per_cta, rows_per_cta);
  EXPECT_EQ(got.key_splits, key_splits);
}

TEST(MlaPrefillShapeTest, SixteenHeadsSplitTheKeysWhereTheWavesRunEmpty) {
  // 512 rows after 3,584: 64 CTAs of 128 rows fill half the SMs; 2 splits measured 74.7 us against 104.9 (64 rows)
  // and 94.8 (3 splits).
  expect_shape(shape(512, 4096, 16, 4), 128, 2);
  // The seed's 3,080 rows after 73,920: 400 CTAs (3.03 waves); 4 splits 6.86 ms, 3 7.02, 64 rows 7.40.
  expect_shape(shape(3080, 77000, 16, 4), 128, 4);
  expect_shape(shape(3080, 57408, 16, 3), 128, 3);  // the backend's 96 MiB workspace holds 3
  // 1,024 rows after 3,072: 128 CTAs of 128 rows unsplit measured best (129.8 us; 64 rows 143.6, 2 splits 135.3).
  expect_shape(shape(1024, 4096, 16, 4), 128, 1);
}

TEST(MlaPrefillShapeTest, WithoutAWorkspaceTheSameRowsAsBeforeTheSplits) {
  expect_shape(shape(512, 4096, 16, 1), 64, 1);     // 128 lone 64-row CTAs: 85 us against 110 (64 of 128 rows)
  expect_shape(shape(3080, 77000, 16, 1), 64, 1);   // 2.97 double waves at 64 rows against 3.03 waves at 128
  expect_shape(shape(3080, 77000, 128, 1), 128, 1);  // 46.9 ms against 57.4 at 64 rows
  expect_shape(shape(4096, 4096, 128, 1), 128, 1);
}

TEST(MlaPrefillShapeTest, ManyHeadsAndCausalPrefillsAreNotSplit) {
  // The case that broke: 1 x 4,096 from position 0 at 128 heads split 4 ways ran 2.71 ms against 2.00 unsplit.
  expect_shape(shape(4096, 4096, 128, 4), 128, 1);
  expect_shape(shape(32768, 32768, 128, 4), 128, 1);
  expect_shape(shape(3080, 77000, 128, 4), 128, 1);  // 3,200 CTAs: no emptiness worth a combine pass
  expect_shape(shape(512, 4096, 128, 4), 128, 1);    // 512 CTAs: 416 us unsplit, 520 split 2 ways
}

TEST(MlaPrefillShapeTest, SplitsNeedLongKeyRanges) {
  expect_shape(shape(512, 1500, 16, 4), 64, 1);  // 1,500 keys: not 1,024 a split even at 2
  expect_shape(shape(512, 2048, 16, 4), 128, 2);
}

TEST(MlaPrefillShapeTest, TheSerialKernelCountsItsSlowerWaves) {
  // 10 waves of 128 rows against 9 double waves of 64: 128 rows win at 1.2x, not at 1.1x.
  MlaPrefillGrid g;
  g.heads = 1;
  g.sms = 132;
  g.tiles_128 = 10 * 132;
  g.tiles_64 = 9 * 264;
  g.max_keys = 4096;
  g.overlap = true;
  expect_shape(choose_mla_prefill_shape(g), 128, 1);
  g.overlap = false;
  expect_shape(choose_mla_prefill_shape(g), 64, 1);
}

}  // namespace
}  // namespace deepinfer::kernels::cuda
