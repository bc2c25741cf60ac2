#include "control/protocol.h"

#include <type_traits>

namespace mooncake::pg::control {
namespace {

// The fields of each structure, in wire order, written once for both
// directions: `a` is a Writer or a Reader (the Writer never modifies them).
template <class A>
void fields(A& a, GroupView& v) {
  a(v.key), a(v.uid), a(v.epoch), a(v.active_epoch), a(v.members), a(v.global_ranks), a(v.endpoints), a(v.hosts), a(v.online);
  size_t seats = v.members.size();
  a.require(v.global_ranks.size() == seats && v.endpoints.size() == seats && v.hosts.size() == seats &&
            v.online.size() == seats);
}
template <class A>
void fields(A& a, GroupRegistration& r) {
  a(r.key), a(r.rank), a(r.max_group_size), a(r.rank_order), a(r.is_extension), a(r.auto_deactivate), a(r.endpoint),
      a(r.host), a(r.reports_links);
}
template <class A>
void fields(A& a, SyncAfterFailureResponse& r) {
  a(r.status), a(r.reject_reason);
}
template <class A>
void fields(A& a, ProposeViewUpdateResponse& r) {
  a(r.status), a(r.new_epoch), a(r.dropped_ranks), a(r.reject_reason);
}
template <class A>
void fields(A& a, Hello& m) {
  a(m.global_rank), a(m.pid), a(m.standby), a(m.resume), a(m.rejoins);
}
template <class A>
void fields(A& a, Reply& m) {
  a(m.request_id), a(m.error), a(m.view);
}
template <class A>
void fields(A&, Heartbeat&) {}
template <class A>
void fields(A&, Goodbye&) {}
template <class A>
void fields(A& a, RegisterGroupRequest& m) {
  a(m.request_id), a(m.registration);
}
template <class A>
void fields(A& a, UnregisterGroupRequest& m) {
  a(m.request_id), a(m.key);
}
template <class A>
void fields(A& a, FailureReport& m) {
  a(m.key), a(m.ranks);
}
template <class A>
void fields(A& a, SyncRequest& m) {
  a(m.request_id), a(m.key), a(m.ranks);
}
template <class A>
void fields(A& a, SyncReply& m) {
  a(m.request_id), a(m.response), a(m.view);
}
template <class A>
void fields(A& a, JoinRequest& m) {
  a(m.request_id), a(m.key);
}
template <class A>
void fields(A& a, ProposeRequest& m) {
  a(m.request_id), a(m.key), a(m.activate), a(m.ranks);
}
template <class A>
void fields(A& a, ProposeReply& m) {
  a(m.request_id), a(m.response);
}
template <class A>
void fields(A& a, ViewPush& m) {
  a(m.view);
}
template <class A>
void fields(A& a, ViewAck& m) {
  a(m.key), a(m.epoch);
}
template <class A>
void fields(A& a, LinkReport& m) {
  a(m.key), a(m.reached), a(m.unreached);
}
template <class A>
void fields(A& a, Rejoin& m) {
  a(m.registration), a(m.view);
}
template <class A>
void fields(A& a, Standbys& m) {
  a(m.coordinator_rank), a(m.ranks), a(m.addresses);
  a.require(m.ranks.size() == m.addresses.size());
}

// The largest valid value of each enum on the wire (all travel as one byte).
constexpr unsigned enumLimit(MemberState) { return static_cast<unsigned>(MemberState::kLeft); }
constexpr unsigned enumLimit(SyncAfterFailureStatus) { return static_cast<unsigned>(SyncAfterFailureStatus::Rejected); }
constexpr unsigned enumLimit(ProposalStatus) { return static_cast<unsigned>(ProposalStatus::AppliedWithDroppedRanks); }

// The fewest bytes one element of a sequence takes on the wire: bounds the
// count a reader accepts before it allocates anything.
template <class T>
constexpr size_t minWireBytes() {
  if constexpr (std::is_same_v<T, std::string>) {
    return 4;  // its length
  } else if constexpr (std::is_enum_v<T> || std::is_same_v<T, bool>) {
    return 1;
  } else {
    return sizeof(T);
  }
}

class Writer {
 public:
  explicit Writer(std::vector<uint8_t>& out) : out_(out) {}

  void operator()(bool v) { out_.push_back(v ? 1 : 0); }
  void operator()(int32_t v) { fixed(static_cast<uint32_t>(v)); }
  void operator()(uint32_t v) { fixed(v); }
  void operator()(int64_t v) { fixed(static_cast<uint64_t>(v)); }
  void operator()(uint64_t v) { fixed(v); }
  void operator()(const std::string& s) {
    fixed(static_cast<uint32_t>(s.size()));
    out_.insert(out_.end(), s.begin(), s.end());
  }
  template <class E, std::enable_if_t<std::is_enum_v<E>, int> = 0>
  void operator()(E v) {
    out_.push_back(static_cast<uint8_t>(v));
  }
  template <class T>
  void operator()(const std::vector<T>& items) {
    fixed(static_cast<uint32_t>(items.size()));
    for (const auto& item : items) (*this)(static_cast<const T&>(item));  // also turns vector<bool> proxies to bool
  }
  template <class T>
  void operator()(const std::optional<T>& item) {
    (*this)(item.has_value());
    if (item) (*this)(*item);
  }
  template <class T, std::enable_if_t<std::is_class_v<T>, int> = 0>
  auto operator()(const T& structure) -> decltype(fields(std::declval<Writer&>(), std::declval<T&>())) {
    fields(*this, const_cast<T&>(structure));
  }
  void require(bool) {}

 private:
  template <class T>
  void fixed(T v) {
    for (size_t i = 0; i < sizeof(T); ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t>& out_;
};

// Every read checks what is left; the first failure sticks and turns every
// later read into a no-op, so callers check ok() once at the end.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), left_(size) {}
  bool ok() const { return ok_; }
  bool done() const { return left_ == 0; }

  void operator()(bool& v) {
    uint8_t byte = 0;
    fixed(byte);
    require(byte <= 1);
    v = byte == 1;
  }
  void operator()(int32_t& v) {
    uint32_t u = 0;
    fixed(u);
    v = static_cast<int32_t>(u);
  }
  void operator()(uint32_t& v) { fixed(v); }
  void operator()(int64_t& v) {
    uint64_t u = 0;
    fixed(u);
    v = static_cast<int64_t>(u);
  }
  void operator()(uint64_t& v) { fixed(v); }
  void operator()(std::string& s) {
    uint32_t n = 0;
    fixed(n);
    require(n <= left_);
    if (!ok_) return;
    s.assign(reinterpret_cast<const char*>(data_), n);
    skip(n);
  }
  template <class E, std::enable_if_t<std::is_enum_v<E>, int> = 0>
  void operator()(E& v) {
    uint8_t byte = 0;
    fixed(byte);
    require(byte <= enumLimit(E{}));
    v = static_cast<E>(byte);
  }
  template <class T>
  void operator()(std::vector<T>& items) {
    uint32_t n = 0;
    fixed(n);
    require(static_cast<uint64_t>(n) * minWireBytes<T>() <= left_);
    if (!ok_) return;
    items.assign(n, T{});
    for (uint32_t i = 0; i < n && ok_; ++i) {
      T item{};
      (*this)(item);
      items[i] = std::move(item);
    }
  }
  template <class T>
  void operator()(std::optional<T>& item) {
    bool present = false;
    (*this)(present);
    item.reset();
    if (!present || !ok_) return;
    item.emplace();
    (*this)(*item);
  }
  template <class T, std::enable_if_t<std::is_class_v<T>, int> = 0>
  auto operator()(T& structure) -> decltype(fields(std::declval<Reader&>(), structure)) {
    fields(*this, structure);
  }
  void require(bool condition) { ok_ = ok_ && condition; }

 private:
  template <class T>
  void fixed(T& v) {
    require(left_ >= sizeof(T));
    if (!ok_) return;
    T out = 0;
    for (size_t i = 0; i < sizeof(T); ++i) out = static_cast<T>(out | static_cast<T>(data_[i]) << (8 * i));
    v = out;
    skip(sizeof(T));
  }
  void skip(size_t n) {
    data_ += n;
    left_ -= n;
  }
  const uint8_t* data_;
  size_t left_;
  bool ok_ = true;
};

// Decodes the alternative of Message whose index is `tag`.
template <size_t I = 0>
bool decodeAlternative(size_t tag, Reader& reader, Message* message) {
  if constexpr (I < std::variant_size_v<Message>) {
    if (tag != I) return decodeAlternative<I + 1>(tag, reader, message);
    std::variant_alternative_t<I, Message> decoded;
    reader(decoded);
    if (!reader.ok()) return false;
    *message = std::move(decoded);
    return true;
  } else {
    return false;
  }
}

uint32_t loadU32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}
uint16_t loadU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }

}  // namespace

const char* messageName(const Message& message) {
  static const char* const kNames[] = {
      "Hello",         "Reply",       "Heartbeat", "RegisterGroupRequest", "UnregisterGroupRequest",
      "FailureReport", "SyncRequest", "SyncReply", "JoinRequest",          "ProposeRequest",
      "ProposeReply",  "ViewPush",    "ViewAck",   "LinkReport",           "Rejoin",
      "Standbys",      "Goodbye"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == std::variant_size_v<Message>, "a name per message");
  return kNames[message.index()];
}

std::vector<uint8_t> encodeFrame(const Message& message) {
  std::vector<uint8_t> frame(kFrameHeaderBytes);
  Writer writer(frame);
  std::visit([&](const auto& m) { writer(m); }, message);
  size_t payload = frame.size() - kFrameHeaderBytes;
  std::vector<uint8_t> header;
  Writer header_writer(header);
  header_writer(kFrameMagic);
  header_writer(static_cast<uint32_t>(kProtocolVersion | static_cast<uint32_t>(message.index()) << 16));
  header_writer(static_cast<uint32_t>(payload));
  std::copy(header.begin(), header.end(), frame.begin());
  return frame;
}

DecodeResult decodeFrame(const uint8_t* data, size_t size, Message* message, size_t* frame_bytes, std::string* error) {
  // Check what is there of the header early, so that garbage fails at once
  // instead of waiting for bytes that will never make a frame.
  if (size >= 4 && loadU32(data) != kFrameMagic) {
    *error = "bad frame magic (not a control-plane peer?)";
    return DecodeResult::kError;
  }
  if (size < kFrameHeaderBytes) return DecodeResult::kNeedMore;
  uint16_t version = loadU16(data + 4);
  uint16_t tag = loadU16(data + 6);
  uint32_t payload = loadU32(data + 8);
  if (version != kProtocolVersion) {
    *error = "unsupported control-plane protocol version " + std::to_string(version) + " (this side speaks " +
             std::to_string(kProtocolVersion) + ")";
    return DecodeResult::kError;
  }
  if (tag >= std::variant_size_v<Message>) {
    *error = "unknown message tag " + std::to_string(tag);
    return DecodeResult::kError;
  }
  if (payload > kMaxPayloadBytes) {
    *error = "frame of " + std::to_string(payload) + " bytes exceeds the limit of " + std::to_string(kMaxPayloadBytes);
    return DecodeResult::kError;
  }
  if (size - kFrameHeaderBytes < payload) return DecodeResult::kNeedMore;
  Reader reader(data + kFrameHeaderBytes, payload);
  if (!decodeAlternative(tag, reader, message)) {
    *error = "malformed frame (message tag " + std::to_string(tag) + ", " + std::to_string(payload) + " bytes)";
    return DecodeResult::kError;
  }
  if (!reader.done()) {
    *error = std::string("trailing bytes after a ") + messageName(*message) + " message";
    return DecodeResult::kError;
  }
  *frame_bytes = kFrameHeaderBytes + payload;
  return DecodeResult::kFrame;
}

void FrameDecoder::append(const uint8_t* data, size_t size) {
  // Drop what was decoded before growing, so the buffer holds at most one
  // partial frame plus the new bytes.
  if (consumed_ > 0) {
    buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(consumed_));
    consumed_ = 0;
  }
  buffer_.insert(buffer_.end(), data, data + size);
}

DecodeResult FrameDecoder::next(Message* message, std::string* error) {
  if (!error_.empty()) {
    *error = error_;
    return DecodeResult::kError;
  }
  size_t frame_bytes = 0;
  DecodeResult result =
      decodeFrame(buffer_.data() + consumed_, buffer_.size() - consumed_, message, &frame_bytes, &error_);
  if (result == DecodeResult::kFrame) consumed_ += frame_bytes;
  if (result == DecodeResult::kError) *error = error_;
  return result;
}

}  // namespace mooncake::pg::control
