#include "settings.h"

namespace mooncake::pg {

PgSettings& settings() {
  static PgSettings s;
  return s;
}

}  // namespace mooncake::pg
