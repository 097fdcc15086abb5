// API-key checks shared by the gRPC and the HTTP front ends: one
// constant-time comparison and one reading of "Authorization: Bearer <key>".
//
// Thread-safety: pure functions.
#pragma once

#include <string_view>

namespace kvserve {

// Compares in time independent of where the strings differ, so the key
// cannot be guessed byte by byte from response times (the length is not
// secret).
bool ConstantTimeEquals(std::string_view a, std::string_view b);

// Whether an Authorization header value (HTTP) or metadata value (gRPC)
// carries `api_key` as a bearer token. The scheme is case-insensitive
// (RFC 7235); an empty `api_key` means no key is required and always matches.
bool BearerTokenMatches(std::string_view authorization, std::string_view api_key);

}  // namespace kvserve
