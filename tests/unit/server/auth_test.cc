// The API-key check both front ends share: the bearer scheme in any case,
// the exact key, nothing else.
#include "server/auth.h"

#include "gtest/gtest.h"

namespace kvserve {
namespace {

TEST(AuthTest, ConstantTimeEqualsComparesBytes) {
  EXPECT_TRUE(ConstantTimeEquals("s3cret", "s3cret"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret", "s3creT"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret", "s3cre"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals(std::string_view("a\0b", 3), std::string_view("a\0c", 3)));
}

TEST(AuthTest, BearerTokenMatchesOnlyTheKey) {
  EXPECT_TRUE(BearerTokenMatches("Bearer s3cret", "s3cret"));
  EXPECT_TRUE(BearerTokenMatches("bearer s3cret", "s3cret"));  // the scheme is case-insensitive
  EXPECT_FALSE(BearerTokenMatches("Bearer s3cret ", "s3cret"));
  EXPECT_FALSE(BearerTokenMatches("Bearer nope", "s3cret"));
  EXPECT_FALSE(BearerTokenMatches("Basic s3cret", "s3cret"));
  EXPECT_FALSE(BearerTokenMatches("s3cret", "s3cret"));
  EXPECT_FALSE(BearerTokenMatches("", "s3cret"));
  EXPECT_TRUE(BearerTokenMatches("", ""));  // no key configured: everyone
}

}  // namespace
}  // namespace kvserve
