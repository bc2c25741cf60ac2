// Coordinator failover: the successor's view of the processes that rejoin
// it, and over sockets, a real kill of the process of global rank 0 (its
// Coordinator and Agent) with the others failing over.
#include "control_fixture.h"

namespace mooncake::pg {
namespace {

// ------------------------------------------------- failover: the successor

// The view every process of a 4-seat group "t" (global ranks 0..3) had when
// the coordinator in global rank 0's process was lost.
GroupView lastView(uint64_t epoch) {
  GroupView view;
  view.key = "t";
  view.uid = "old-7";
  view.epoch = epoch;
  view.active_epoch = 3;
  view.members.assign(4, MemberState::kActive);
  view.global_ranks = {0, 1, 2, 3};
  for (int g = 0; g < 4; ++g) {
    view.endpoints.push_back("endpoint-of-" + std::to_string(g));
    view.hosts.push_back("host-" + std::to_string(g));
  }
  view.online.assign(4, true);
  return view;
}

// Global rank g (session g + 1) rejoins the successor with its seat g of "t".
control::Effects rejoin(StateMachine& machine, int g, uint64_t epoch, bool auto_deactivate = true) {
  machine.state().onConnected(machine.now(), g + 1);
  control::Effects effects = machine.send(g + 1, control::Hello{g, 0, "standby-" + std::to_string(g), true, 1});
  control::Effects more = machine.send(
      g + 1, control::Rejoin{registration("t", g, {0, 1, 2, 3}, 4, false, auto_deactivate), lastView(epoch)});
  effects.sends.insert(effects.sends.end(), more.sends.begin(), more.sends.end());
  effects.disconnects.insert(effects.disconnects.end(), more.disconnects.begin(), more.disconnects.end());
  return effects;
}

std::vector<std::string> replyErrors(const control::Effects& effects) {
  std::vector<std::string> errors;
  for (const auto& [to, reply] : StateMachine::sent<control::Reply>(effects)) errors.push_back(reply.error);
  return errors;
}

TEST(ControlTakeOver, SuccessorRebuildsTheGroupsAndFailsTheLostCoordinatorsSeats) {
  StateMachine machine;
  machine.state().setHostRank(1);
  machine.state().beginTakeOver(machine.now(), {1, 2, 3}, 0);
  // Nothing is answered until every expected process has rejoined.
  EXPECT_TRUE(replyErrors(rejoin(machine, 1, 5)).empty());
  EXPECT_TRUE(replyErrors(rejoin(machine, 2, 4)).empty());  // its push of epoch 5 was in flight
  auto done = rejoin(machine, 3, 5);
  EXPECT_EQ(replyErrors(done), (std::vector<std::string>{"", "", ""}));
  auto pushes = StateMachine::sent<control::ViewPush>(done);
  ASSERT_EQ(pushes.size(), 3u);
  for (const auto& [to, push] : pushes) {
    const GroupView& view = push.view;
    EXPECT_EQ(view.epoch, 6u);  // above the highest reported
    EXPECT_EQ(view.uid, "old-7");  // the same incarnation: data-plane names go on
    EXPECT_EQ(view.members[0], MemberState::kInactive);
    EXPECT_FALSE(view.online[0]);
    EXPECT_EQ(view.activeRanks(), (std::vector<int>{1, 2, 3}));
    EXPECT_EQ(view.active_epoch, 6u);
    EXPECT_EQ(view.endpoints[2], "endpoint-of-2");
  }
  // The candidates now: everyone online but the new coordinator's process.
  auto standbys = StateMachine::sent<control::Standbys>(done);
  ASSERT_FALSE(standbys.empty());
  EXPECT_EQ(standbys.back().second.coordinator_rank, 1);
  EXPECT_EQ(standbys.back().second.ranks, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(standbys.back().second.addresses, (std::vector<std::string>{"standby-2", "standby-3"}));
  EXPECT_EQ(machine.rankState(2), RankState::kHealthy);  // active and connected to the successor

  // It serves: a sync, a proposal, and a replacement of global rank 0.
  machine.send(3, control::SyncRequest{9, "t", {0}});
  auto synced = machine.advance(100ms);
  auto syncs = StateMachine::sent<control::SyncReply>(synced);
  ASSERT_EQ(syncs.size(), 1u);
  EXPECT_NE(syncs[0].second.response.status, SyncAfterFailureStatus::Rejected);
  machine.state().onConnected(machine.now(), 10);
  EXPECT_EQ(replyErrors(machine.send(10, helloFrom(0, 0))), std::vector<std::string>{""});
  auto attached = machine.send(10, control::RegisterGroupRequest{1, registration("t", 0, {0, 1, 2, 3}, 4, true)});
  auto replies = StateMachine::sent<control::Reply>(attached);
  ASSERT_EQ(replies.size(), 1u);
  EXPECT_EQ(replies[0].second.error, "");
  ASSERT_TRUE(replies[0].second.view.has_value());
  EXPECT_EQ(replies[0].second.view->members[0], MemberState::kInactive);
  EXPECT_TRUE(replies[0].second.view->online[0]);
  EXPECT_EQ(replies[0].second.view->epoch, 7u);
}

TEST(ControlTakeOver, WithoutAutoDeactivateTheLostSeatsStayActiveButOffline) {
  StateMachine machine;
  machine.state().setHostRank(1);
  // Only 1 and 2 were told as candidates (the list is capped), but the
  // views show global rank 3 online too: it is waited for, until the deadline.
  machine.state().beginTakeOver(machine.now(), {1, 2}, 0);
  rejoin(machine, 1, 5, /*auto_deactivate=*/false);
  EXPECT_TRUE(replyErrors(rejoin(machine, 2, 5, /*auto_deactivate=*/false)).empty());
  auto done = machine.advance(1100ms);
  EXPECT_EQ(replyErrors(done), (std::vector<std::string>{"", ""}));  // 2 of 3: a majority
  auto pushes = StateMachine::sent<control::ViewPush>(done);
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].second.view.activeRanks(), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(pushes[0].second.view.online, (std::vector<bool>{false, true, true, false}));
}

TEST(ControlTakeOver, ProcessesThatDoNotRejoinInTimeAreFailedAndRefusedLater) {
  StateMachine machine;
  machine.state().setHostRank(1);
  machine.state().beginTakeOver(machine.now(), {1, 2, 3}, 0);
  rejoin(machine, 1, 5);
  EXPECT_TRUE(replyErrors(rejoin(machine, 2, 5)).empty());
  EXPECT_TRUE(replyErrors(machine.advance(500ms)).empty());
  auto done = machine.advance(600ms);  // failover_timeout (1 s) passed: 2 of 3 is a majority
  EXPECT_EQ(replyErrors(done), (std::vector<std::string>{"", ""}));
  auto pushes = StateMachine::sent<control::ViewPush>(done);
  ASSERT_EQ(pushes.size(), 2u);
  EXPECT_EQ(pushes[0].second.view.activeRanks(), (std::vector<int>{1, 2}));
  // The late one is refused: its seat went through the failure path.
  auto late = rejoin(machine, 3, 5);
  ASSERT_EQ(replyErrors(late).size(), 1u);
  EXPECT_NE(replyErrors(late)[0].find("completed without this process"), std::string::npos);
}

TEST(ControlTakeOver, WithoutAMajorityEveryoneIsRefusedNowAndLater) {
  // A process cut off alone finds itself first in line: it must not found a
  // membership of its own.
  StateMachine machine;
  machine.state().setHostRank(1);
  machine.state().beginTakeOver(machine.now(), {1, 2, 3}, 0);
  rejoin(machine, 1, 5);
  auto done = machine.advance(1100ms);
  auto errors = replyErrors(done);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("no majority"), std::string::npos) << errors[0];
  EXPECT_EQ(done.disconnects, std::vector<control::SessionId>{2});
  EXPECT_TRUE(StateMachine::sent<control::ViewPush>(done).empty());
  machine.state().onConnected(machine.now(), 20);
  errors = replyErrors(machine.send(20, helloFrom(2, 0)));
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("could not take over"), std::string::npos) << errors[0];
}

TEST(ControlTakeOver, CandidatesAreTheLowestEightAndToldAgainOnlyWhenTheyChange) {
  StateMachine machine;
  machine.state().setHostRank(0);
  control::Effects last;
  for (int g = 0; g < 11; ++g) {
    machine.state().onConnected(machine.now(), g + 1);
    last = machine.send(g + 1, control::Hello{g, 0, "standby-" + std::to_string(g)});
  }
  // The eleventh changes nothing: only it is told.
  auto told = StateMachine::sent<control::Standbys>(last);
  ASSERT_EQ(told.size(), 1u);
  EXPECT_EQ(told[0].first, 11u);
  EXPECT_EQ(told[0].second.coordinator_rank, 0);
  EXPECT_EQ(told[0].second.ranks, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  // A candidate goes: everyone is told the new list.
  control::Effects gone;
  machine.state().onDisconnected(machine.now(), 3, "test", &gone);
  told = StateMachine::sent<control::Standbys>(gone);
  ASSERT_EQ(told.size(), 10u);
  EXPECT_EQ(told[0].second.ranks, (std::vector<int32_t>{1, 3, 4, 5, 6, 7, 8, 9}));
  // A process that is no candidate goes: nobody is told.
  gone = {};
  machine.state().onDisconnected(machine.now(), 11, "test", &gone);
  EXPECT_TRUE(StateMachine::sent<control::Standbys>(gone).empty());
}

TEST(ControlTakeOver, NewProcessesAreRefusedWhileTheSuccessorWaitsForTheOthers) {
  StateMachine machine;
  machine.state().setHostRank(1);
  machine.state().beginTakeOver(machine.now(), {1, 2}, 0);
  machine.state().onConnected(machine.now(), 30);
  auto errors = replyErrors(machine.send(30, helloFrom(7, 0)));
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("taking over"), std::string::npos) << errors[0];
}

// ------------------------------------- failover: over sockets, a real kill

// Global rank 0 (coordinator and agent) runs in a child, which gets `sig`
// (SIGKILL: its sockets close; SIGSTOP: it falls silent) once the group
// formed; the survivors must be served by the successor within `limit`.
void failOverAfter(int sig, Ms limit) {
  ChildProcess child([](const std::string&, ChildProcess& self) {
    std::string error;
    auto coordinator = Coordinator::standby("127.0.0.1", testOptions(), 0, &error);
    if (!coordinator) ::_exit(1);
    coordinator->activate();
    self.report(coordinator->address());
    auto agent = Agent::connect(coordinator->address(), 0, testOptions(), &error, coordinator.get());
    GroupView view;
    if (!agent || !agent->registerGroup(registration("f", 0, {0, 1, 2, 3}, 5), nullptr, &view, &error)) {
      self.report("error: " + error);
      ::_exit(1);
    }
    self.report("registered");
    for (;;) ::pause();
  });
  child.go("start");
  const std::string address = child.nextReport(5s);
  ASSERT_FALSE(address.empty());
  std::vector<std::unique_ptr<Coordinator>> standbys(4);
  Members members(4);
  std::vector<std::future<std::string>> results;
  for (int g = 1; g < 4; ++g) {
    std::string error;
    standbys[g] = Coordinator::standby("127.0.0.1", testOptions(), g, &error);
    ASSERT_NE(standbys[g], nullptr) << error;
    members[g] = std::make_unique<Member>();
    members[g]->agent = Agent::connect(address, g, testOptions(), &error, standbys[g].get());
    ASSERT_NE(members[g]->agent, nullptr) << error;
    Member* member = members[g].get();
    results.push_back(std::async(std::launch::async, [member, g] {
      std::string error;
      bool ok = member->agent->registerGroup(registration("f", g, {0, 1, 2, 3}, 5), member->log.listener(),
                                             &member->view, &error);
      return ok ? std::string() : error;
    }));
  }
  ASSERT_EQ(child.nextReport(5s), "registered");
  for (auto& r : results) ASSERT_EQ(r.get(), "");
  const std::string uid = members[1]->view.uid;
  std::this_thread::sleep_for(100ms);  // the candidates reach every agent

  auto killed = SteadyClock::now();
  child.signal(sig);
  for (int g = 1; g < 4; ++g) {
    auto view = members[g]->log.waitFor(seatIs(0, MemberState::kInactive), 5000ms);
    ASSERT_TRUE(view.has_value()) << "global rank " << g;
    EXPECT_EQ(view->epoch, 2u);
    EXPECT_EQ(view->uid, uid);
    EXPECT_FALSE(view->online[0]);
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{1, 2, 3}));
  }
  EXPECT_LT(since(killed), limit);
  EXPECT_TRUE(standbys[1]->serving());
  EXPECT_FALSE(standbys[2]->serving());

  // The successor serves: a sync, a deactivation, then a replacement of
  // global rank 0 that connects to it and is activated again.
  auto sync = members[2]->agent->syncAfterFailure("f", {0});
  EXPECT_NE(sync.response.status, SyncAfterFailureStatus::Rejected) << sync.response.reject_reason;
  auto member0 = std::make_unique<Member>();
  std::string error;
  member0->agent = Agent::connect(standbys[1]->address(), 0, testOptions(), &error);
  ASSERT_NE(member0->agent, nullptr) << error;
  GroupRegistration again = registration("f", 0, {0, 1, 2, 3}, 5, /*is_extension=*/true);
  ASSERT_TRUE(member0->agent->registerGroup(again, member0->log.listener(), &member0->view, &error)) << error;
  EXPECT_EQ(member0->view.members[0], MemberState::kInactive);
  auto joined = std::async(std::launch::async, [&] {
    std::string why;
    return member0->agent->joinGroup("f", 5000ms, &why) ? std::string() : why;
  });
  ProposeViewUpdateResponse activated;
  for (int attempt = 0; attempt < 20; ++attempt) {
    activated = members[3]->agent->propose("f", true, {0});
    if (activated.status != ProposalStatus::Rejected) break;
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(activated.status, ProposalStatus::Applied) << activated.reject_reason;
  EXPECT_EQ(joined.get(), "");
  auto back = members[1]->log.waitFor([](const GroupView& v) { return v.isActive(0); });
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->activeRanks(), (std::vector<int>{0, 1, 2, 3}));
  members.clear();
}

TEST(ControlFailover, SurvivorsFailOverWhenTheCoordinatorsProcessIsKilled) {
  failOverAfter(SIGKILL, 900ms);  // closed connections: no waiting for the heartbeat timeout (1 s)
}

TEST(ControlFailover, SurvivorsFailOverWhenTheCoordinatorsProcessFallsSilent) {
  failOverAfter(SIGSTOP, 2500ms);  // the heartbeat timeout (1 s), then the take-over
}

TEST(ControlFailover, AProcessCutOffAloneLearnsItAndNeverTakesOver) {
  // Global rank 1, first in line to succeed, is cut off: it must learn it is
  // cut off, its standby must not serve, and the others' view drops it.
  ChildProcess child([](const std::string& address, ChildProcess& self) {
    std::string error;
    auto standby = Coordinator::standby("127.0.0.1", testOptions(), 1, &error);
    auto agent = Agent::connect(address, 1, testOptions(), &error, standby.get());
    GroupView view;
    if (!agent || !agent->registerGroup(registration("cut", 1, {0, 1, 2}, 3), nullptr, &view, &error)) {
      self.report("error: " + error);
      ::_exit(1);
    }
    std::promise<std::string> told;
    agent->onConnectionLost("cut", [&](const std::string& why) { told.set_value(why); });
    self.report("registered");
    std::this_thread::sleep_for(200ms);  // the candidates reach it
    test_faults::cutTraffic();
    auto future = told.get_future();
    if (future.wait_for(5s) != std::future_status::ready) {
      self.report("not told");
      ::_exit(1);
    }
    self.report(future.get());
    self.report(standby->serving() ? "serving" : "not serving");
    ::_exit(0);
  });
  std::string error;
  auto coordinator = Coordinator::standby("127.0.0.1", testOptions(), 0, &error);
  ASSERT_NE(coordinator, nullptr) << error;
  coordinator->activate();
  std::vector<std::unique_ptr<Coordinator>> standbys;
  Members members;
  std::vector<std::future<std::string>> results;
  for (int g : {0, 2}) {
    members.push_back(std::make_unique<Member>());
    Coordinator* standby = coordinator.get();
    if (g == 2) {
      standbys.push_back(Coordinator::standby("127.0.0.1", testOptions(), 2, &error));
      standby = standbys.back().get();
    }
    members.back()->agent = Agent::connect(coordinator->address(), g, testOptions(), &error, standby);
    ASSERT_NE(members.back()->agent, nullptr) << error;
    Member* member = members.back().get();
    results.push_back(std::async(std::launch::async, [member, g] {
      std::string error;
      bool ok = member->agent->registerGroup(registration("cut", g, {0, 1, 2}, 3), member->log.listener(),
                                             &member->view, &error);
      return ok ? std::string() : error;
    }));
  }
  child.go(coordinator->address());
  ASSERT_EQ(child.nextReport(5s), "registered");
  for (auto& r : results) ASSERT_EQ(r.get(), "");
  const std::string why = child.nextReport(6s);
  EXPECT_NE(why.find("cut off"), std::string::npos) << why;
  EXPECT_EQ(child.nextReport(2s), "not serving");
  for (auto& member : members) {
    auto view = member->log.waitFor(seatIs(1, MemberState::kInactive), 3000ms);
    ASSERT_TRUE(view.has_value());
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 2}));
  }
  EXPECT_FALSE(standbys[0]->serving());
  members.clear();
}

}  // namespace
}  // namespace mooncake::pg
