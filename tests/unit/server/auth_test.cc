// The API-key check both front ends share: the bearer scheme in any case,
// the exact key, nothing else.
#include "server/service/auth.h"

#include <memory>

#include "gtest/gtest.h"
#include "server/frontend/status_map.h"
#include "server/service/tenants.h"

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

// Every front end's one rule: the operator's key is the admin, a tenant's
// key names its tenant and is refused on operator-only calls, anything else
// is UNAUTHENTICATED (401 / gRPC UNAUTHENTICATED), no key configured is open.
TEST(AuthenticatorTest, OperatorTenantsAndRefusals) {
  EXPECT_TRUE(Authenticator("").open());
  absl::StatusOr<CallerAuth> open = Authenticator("").Check("", true);
  ASSERT_TRUE(open.ok());
  EXPECT_TRUE(open->admin);

  auto keys = std::make_shared<const TenantKeys>(TenantKeys::Parse("k-acme acme\nk-beta beta\n").value());
  const Authenticator auth("op-key", keys);
  EXPECT_FALSE(auth.open());
  absl::StatusOr<CallerAuth> op = auth.Check("Bearer op-key", true);
  ASSERT_TRUE(op.ok());
  EXPECT_TRUE(op->admin);
  EXPECT_EQ(op->tenant, "");
  absl::StatusOr<CallerAuth> acme = auth.Check("bearer k-acme", false);
  ASSERT_TRUE(acme.ok());
  EXPECT_FALSE(acme->admin);
  EXPECT_EQ(acme->tenant, "acme");
  EXPECT_EQ(auth.Check("Bearer k-beta", true).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(auth.Check("Bearer nope", false).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth.Check("", false).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth.Check("k-acme", false).status().code(), absl::StatusCode::kUnauthenticated);
  // Only tenant keys, no operator key: a tenant passes, nobody is admin.
  const Authenticator tenants_only("", keys);
  EXPECT_FALSE(tenants_only.open());
  EXPECT_TRUE(tenants_only.Check("Bearer k-acme", false).ok());
  EXPECT_EQ(tenants_only.Check("", false).status().code(), absl::StatusCode::kUnauthenticated);
}

// One mapping to the wire: gRPC keeps the canonical code, HTTP the status
// the OpenAI clients expect.
TEST(StatusMapTest, GrpcAndHttpAgreeOnEveryRefusal) {
  EXPECT_TRUE(ToGrpc(absl::OkStatus()).ok());
  const grpc::Status g = ToGrpc(absl::UnauthenticatedError("who"));
  EXPECT_EQ(g.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(g.error_message(), "who");
  EXPECT_EQ(ToGrpc(absl::Status(static_cast<absl::StatusCode>(99), "x")).error_code(),
            grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnauthenticated), 401);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kPermissionDenied), 403);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kDeadlineExceeded), 504);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kInternal), 500);
}

}  // namespace
}  // namespace kvserve
