// Proof of a shared secret, for authenticating connections between the
// processes of one job (or of one standalone deployment of engines).
//
// A connection opens with a mutual challenge: each side sends a fresh random
// nonce, and each proves it knows the secret with an HMAC-SHA256 (OpenSSL's)
// over a label naming its role, the connection kind and both nonces. The
// role labels differ, so a proof can never be reflected back to its sender;
// the nonces are fresh, so a recorded proof never verifies again. Nothing
// here encrypts the data that follows.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace mooncake::te::auth {

constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Proof = std::array<uint8_t, kProofBytes>;

enum class Role : uint8_t { kClient = 1, kServer = 2 };

// Whether this build has the crypto library (OpenSSL's libcrypto); without
// it an engine refuses a secret at initialize().
bool available();

// Cryptographically random (OpenSSL's RAND_bytes); aborts never: a failure
// of the generator yields false and leaves `out` unusable.
bool randomNonce(Nonce& out);

// HMAC-SHA256(secret, "mooncake-auth-v1" | role | kind | client nonce | server nonce).
// False when the crypto library could not compute it (a FIPS provider that
// refuses the key, no SHA-256, no memory): the caller must refuse the peer,
// never compare against an unset proof.
bool prove(std::string_view secret, Role role, uint32_t kind, const Nonce& client, const Nonce& server, Proof& out);

// Constant-time comparison.
bool same(const Proof& a, const Proof& b);

// Whether `theirs` is the proof of `role` for this exchange (false also when
// ours cannot be computed).
bool verify(const Proof& theirs, std::string_view secret, Role role, uint32_t kind, const Nonce& client,
            const Nonce& server);

}  // namespace mooncake::te::auth
