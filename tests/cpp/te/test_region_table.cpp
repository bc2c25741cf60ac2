#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <thread>

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

// A transfer into one region (withRegion's fn, here blocked on a promise)
// holds up only that region's unregistration: registering, looking up and
// unregistering other regions go on meanwhile.
TEST(RegionTable, AnInterruptingRemoveCutsShortTheAccessesThatCanBeCutAndWaitsForThem) {
  // Two accesses in flight on one region: one that can be cut short (its
  // callback ends its wait, as the TCP server's shutdown ends a recv) and
  // one that cannot. The interrupting remove calls the first's callback,
  // not after it finished, and returns once both are out.
  using namespace std::chrono_literals;
  RegionTable t;
  ASSERT_EQ(t.add(region(1000, 100)), kOk);
  std::promise<void> cut_promise, release_plain;
  std::shared_future<void> cut = cut_promise.get_future().share(), released = release_plain.get_future().share();
  std::promise<void> entered_cuttable, entered_plain;
  std::atomic<int> interrupts{0};
  const std::function<void()> interrupt = [&] {
    interrupts++;
    cut_promise.set_value();
  };
  std::thread cuttable([&] {
    EXPECT_TRUE(t.withRegion(
        1000, 10,
        [&](const MemoryRegion&) {
          entered_cuttable.set_value();
          EXPECT_EQ(cut.wait_for(10s), std::future_status::ready);
        },
        &interrupt));
  });
  std::thread plain([&] {
    EXPECT_TRUE(t.withRegion(1050, 10, [&](const MemoryRegion&) {
      entered_plain.set_value();
      released.wait();
    }));
  });
  entered_cuttable.get_future().wait();
  entered_plain.get_future().wait();
  auto removing = std::async(std::launch::async, [&] { return t.remove(1000, nullptr, /*interrupt=*/true); });
  EXPECT_EQ(removing.wait_for(50ms), std::future_status::timeout);  // the plain access still holds it
  cuttable.join();                                                  // cut short by the remove
  EXPECT_EQ(interrupts, 1);
  release_plain.set_value();
  EXPECT_EQ(removing.get(), kOk);
  plain.join();
  // A callback is only called while its access runs: an access that ended
  // before the remove is not interrupted.
  ASSERT_EQ(t.add(region(2000, 100)), kOk);
  std::atomic<int> late{0};
  const std::function<void()> count_late = [&] { late++; };
  EXPECT_TRUE(t.withRegion(
      2000, 1, [](const MemoryRegion&) {}, &count_late));
  EXPECT_EQ(t.remove(2000, nullptr, /*interrupt=*/true), kOk);
  EXPECT_EQ(late, 0);
}

TEST(RegionTable, AnAccessInFlightHoldsUpOnlyItsOwnRegion) {
  using namespace std::chrono_literals;
  RegionTable t;
  ASSERT_EQ(t.addAll({region(1000, 100), region(2000, 100)}), kOk);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> entered;
  std::atomic<bool> fn_done{false};
  std::thread transfer([&] {
    EXPECT_TRUE(t.withRegion(1010, 10, [&](const MemoryRegion& r) {
      EXPECT_EQ(r.addr, 1000u);
      entered.set_value();
      released.wait();
      fn_done = true;
    }));
  });
  entered.get_future().wait();
  // Each of these returned at once before; with a table-wide lock held by
  // the transfer they would wait for it (the test would hang: ctest's
  // timeout fails it).
  EXPECT_EQ(t.add(region(3000, 100)), kOk);
  EXPECT_EQ(t.remove(2000), kOk);
  EXPECT_TRUE(t.find(1000, 100).has_value());
  EXPECT_EQ(t.size(), 2u);
  auto removing = std::async(std::launch::async, [&] { return t.remove(1000); });
  // It is unlinked at once (nothing new starts on it) ...
  for (auto until = std::chrono::steady_clock::now() + 10s;
       t.find(1000, 1).has_value() && std::chrono::steady_clock::now() < until;) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_FALSE(t.find(1000, 1).has_value());
  // ... and returns only once the transfer is out.
  EXPECT_EQ(removing.wait_for(50ms), std::future_status::timeout);
  EXPECT_FALSE(fn_done);
  EXPECT_FALSE(t.withRegion(1000, 1, [](const MemoryRegion&) { ADD_FAILURE() << "ran on a removed region"; }));
  release.set_value();
  EXPECT_EQ(removing.get(), kOk);
  EXPECT_TRUE(fn_done);  // remove returned only after fn had finished
  transfer.join();
}

TEST(RegionTable, RegionsPeersMayNotReachAreNotServed) {
  RegionTable t;
  MemoryRegion own = region(1000, 100);
  own.remote_accessible = false;
  ASSERT_EQ(t.add(own), kOk);
  EXPECT_TRUE(t.find(1000, 10).has_value());  // a local source
  EXPECT_FALSE(t.withRegion(1000, 10, [](const MemoryRegion&) { ADD_FAILURE() << "served a private region"; }));
  EXPECT_EQ(t.remove(1000), kOk);
}

}  // namespace
}  // namespace mooncake::te
