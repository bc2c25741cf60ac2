#include <gtest/gtest.h>

#include "mooncake/te/memory_region.h"
#include "mooncake/te/status.h"

namespace mooncake::te {
namespace {

MemoryRegion region(uint64_t addr, uint64_t length) { return MemoryRegion{addr, length, "cpu:0"}; }

TEST(RegionTable, RejectsEveryKindOfOverlap) {
  RegionTable t;
  ASSERT_EQ(t.add(region(1000, 100)), kOk);  // [1000, 1100)
  EXPECT_EQ(t.add(region(1000, 100)), kAddressOverlapped);  // identical
  EXPECT_EQ(t.add(region(950, 51)), kAddressOverlapped);    // tail into the start
  EXPECT_EQ(t.add(region(1099, 10)), kAddressOverlapped);   // head over the end
  EXPECT_EQ(t.add(region(900, 400)), kAddressOverlapped);   // contains it
  EXPECT_EQ(t.add(region(1010, 10)), kAddressOverlapped);   // inside it
  EXPECT_EQ(t.add(region(900, 100)), kOk);                  // adjacent below: [900, 1000)
  EXPECT_EQ(t.add(region(1100, 1)), kOk);                   // adjacent above
  EXPECT_EQ(t.size(), 3u);
}

TEST(RegionTable, RejectsZeroLengthNullAndWrappingRanges) {
  RegionTable t;
  EXPECT_EQ(t.add(region(1000, 0)), kInvalidArgument);
  EXPECT_EQ(t.add(region(0, 10)), kInvalidArgument);
  EXPECT_EQ(t.add(region(~0ull - 5, 10)), kInvalidArgument);
  EXPECT_EQ(t.size(), 0u);
}

TEST(RegionTable, AddAllIsAllOrNothing) {
  RegionTable t;
  ASSERT_EQ(t.add(region(5000, 100)), kOk);
  EXPECT_EQ(t.addAll({region(1000, 10), region(5050, 10)}), kAddressOverlapped);
  EXPECT_EQ(t.size(), 1u);
  EXPECT_FALSE(t.find(1000, 1).has_value());
  // Overlap inside the batch itself is refused too.
  EXPECT_EQ(t.addAll({region(1000, 10), region(1005, 10)}), kAddressOverlapped);
  EXPECT_EQ(t.size(), 1u);
  EXPECT_EQ(t.addAll({region(1000, 10), region(1010, 10)}), kOk);
  EXPECT_EQ(t.size(), 3u);
}

TEST(RegionTable, FindRequiresTheWholeRangeInsideOneRegion) {
  RegionTable t;
  ASSERT_EQ(t.addAll({region(1000, 100), region(1100, 100)}), kOk);
  EXPECT_TRUE(t.find(1000, 100).has_value());
  EXPECT_TRUE(t.find(1099, 1).has_value());
  EXPECT_EQ(t.find(1150, 50)->addr, 1100u);
  EXPECT_FALSE(t.find(1050, 100).has_value());  // spans two adjacent regions
  EXPECT_FALSE(t.find(999, 2).has_value());
  EXPECT_FALSE(t.find(1199, 2).has_value());
  EXPECT_FALSE(t.find(1000, ~0ull).has_value());  // length overflow
}

TEST(RegionTable, RemoveNeedsTheExactBase) {
  RegionTable t;
  ASSERT_EQ(t.add(region(1000, 100)), kOk);
  EXPECT_EQ(t.remove(1001), kAddressNotRegistered);
  MemoryRegion removed;
  EXPECT_EQ(t.remove(1000, &removed), kOk);
  EXPECT_EQ(removed.length, 100u);
  EXPECT_EQ(t.remove(1000), kAddressNotRegistered);
  EXPECT_EQ(t.add(region(1000, 100)), kOk);  // free again
}

}  // namespace
}  // namespace mooncake::te
