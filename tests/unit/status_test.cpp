// Status and Result carry the code and the message a user acts on.
#include <gtest/gtest.h>

#include "deepinfer/core/status.h"

namespace deepinfer {
namespace {

TEST(StatusTest, OkAndErrors) {
  EXPECT_TRUE(Status().ok());
  EXPECT_EQ(Status().to_string(), "OK");
  Status error = Status::invalid_argument("messages[0].role must be a string");
  EXPECT_FALSE(error.ok());
  EXPECT_EQ(error.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(error.to_string(), "InvalidArgument: messages[0].role must be a string");
}

TEST(StatusTest, ResultHoldsValueOrStatus) {
  Result<int> value = 42;
  ASSERT_TRUE(value.ok());
  EXPECT_EQ(*value, 42);
  EXPECT_TRUE(value.status().ok());
  Result<int> error = Status::not_found("tokenizer.json");
  ASSERT_FALSE(error.ok());
  EXPECT_EQ(error.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace deepinfer
