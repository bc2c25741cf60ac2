// IP addresses written as text: IPv4 ("10.0.0.1"), IPv6 ("fd00::2"), and
// IPv6 with a zone ("fe80::1%eth0", or "fe80::1%4" by the interface's
// index). A link-local IPv6 address (fe80::/10) exists on every interface,
// so it names a place to bind or connect to only together with its zone.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>

namespace mooncake::te::net {

// True for an IPv6 literal, with or without a zone (the zone is not looked
// up here: parseIpLiteral does that).
bool isIpv6Literal(const std::string& text);
// True for an IPv4 literal or what isIpv6Literal accepts.
bool isIpLiteral(const std::string& text);

// `text` with `port` as a socket address: kOk with `out` and `length` set;
// kInvalidArgument with `why` saying which rule `text` breaks (for the
// caller's message, after the text itself): not an IP address, a zone on an
// IPv4 address, or a zone (empty included) that is neither the name nor the
// index of an interface of this host.
int parseIpLiteral(const std::string& text, uint16_t port, sockaddr_storage& out, socklen_t& length, std::string& why);

}  // namespace mooncake::te::net
