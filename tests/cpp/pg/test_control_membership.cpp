// The control plane over real sockets on 127.0.0.1, a Coordinator with
// Agents in threads of this process, forked children for process death and
// stalls, and raw peers where a test needs a precise sequence: bootstrap and
// views, liveness, failure evidence, extension / join / replacement,
// proposals, leaving.
#include "control_fixture.h"

namespace mooncake::pg {
namespace {

// ------------------------------------------------------ bootstrap, views

TEST_F(ControlPlane, FoundersGetTheSameFoundingView) {
  start();
  Members members = found("g", 3, 4);
  ASSERT_EQ(members.size(), 3u);
  for (const auto& member : members) {
    const GroupView& view = member->view;
    EXPECT_EQ(view.epoch, 1u);
    EXPECT_EQ(view.key, "g");
    EXPECT_FALSE(view.uid.empty());
    EXPECT_EQ(view.uid, members[0]->view.uid);
    EXPECT_EQ(view.members, (std::vector<MemberState>{MemberState::kActive, MemberState::kActive, MemberState::kActive,
                                                      MemberState::kNone}));
    EXPECT_EQ(view.global_ranks, (std::vector<int>{0, 1, 2, -1}));
    EXPECT_EQ(view.endpoints, (std::vector<std::string>{"endpoint-of-0", "endpoint-of-1", "endpoint-of-2", ""}));
    EXPECT_EQ(view.hosts[2], "host-2");
    EXPECT_EQ(view.online, (std::vector<bool>{true, true, true, false}));
    EXPECT_EQ(member->agent->view("g").epoch, 1u);
  }
}

TEST_F(ControlPlane, FounderOfflineDuringBootstrapFailsTheOthersAtOnce) {
  ControlOptions options = testOptions();
  options.request_timeout = 5000ms;
  start(options);
  Members members = connectAll({0, 1});
  auto results = registerAsync(members, "boot", {0, 1, 2, 3}, 4);
  std::this_thread::sleep_for(100ms);
  // Global rank 2 registers its founder seat and its process is gone
  // (end of stream right after the registration, in that order).
  auto started = SteadyClock::now();
  {
    RawPeer peer(address());
    peer.hello(2);
    peer.send(control::RegisterGroupRequest{1, registration("boot", 2, {0, 1, 2, 3}, 4)});
  }
  for (auto& result : results) {
    ASSERT_EQ(result.wait_for(2s), std::future_status::ready);
    std::string error = result.get();
    EXPECT_NE(error.find("seat 2 (global rank 2)"), std::string::npos) << error;
    EXPECT_NE(error.find("went offline"), std::string::npos) << error;
  }
  EXPECT_LT(since(started), 1000ms);  // far below request_timeout (5 s)
  // A founder that comes later learns at once that the group cannot form.
  auto late = connect(3);
  std::string error;
  GroupView view;
  started = SteadyClock::now();
  EXPECT_FALSE(late->agent->registerGroup(registration("boot", 3, {0, 1, 2, 3}, 4), nullptr, &view, &error));
  EXPECT_LT(since(started), 500ms);
  EXPECT_NE(error.find("cannot be formed"), std::string::npos) << error;
}

TEST_F(ControlPlane, BootstrapGivesUpAfterRequestTimeoutNamingMissingSeats) {
  ControlOptions options = testOptions();
  options.request_timeout = 300ms;
  start(options);
  Members members = connectAll({5});
  auto started = SteadyClock::now();
  auto results = registerAsync(members, "lonely", {5, 6}, 2);
  ASSERT_EQ(results[0].wait_for(3s), std::future_status::ready);
  std::string error = results[0].get();
  EXPECT_GE(since(started), 250ms);
  EXPECT_NE(error.find("founder seats [1] (global ranks [6]) never registered"), std::string::npos) << error;
}

TEST_F(ControlPlane, FoundersThatDisagreeAreRefused) {
  start();
  Members members = connectAll({0, 1});
  auto first = registerAsync(members, "mismatch", {0, 1}, 2);  // both founders: forms
  for (auto& r : first) ASSERT_EQ(r.get(), "");
  std::string error;
  GroupView view;
  auto other = connect(2);
  // A different max_group_size for a group being formed.
  auto pending = registerAsync(members, "m2", {0, 1, 2}, 4);
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(other->agent->registerGroup(registration("m2", 2, {0, 1, 2}, 5), nullptr, &view, &error));
  EXPECT_NE(error.find("disagree"), std::string::npos) << error;
  EXPECT_TRUE(other->agent->registerGroup(registration("m2", 2, {0, 1, 2}, 4), nullptr, &view, &error)) << error;
  for (auto& r : pending) EXPECT_EQ(r.get(), "");
  // A seat whose global rank is not this process's.
  EXPECT_FALSE(other->agent->registerGroup(registration("m3", 0, {0, 2}, 2), nullptr, &view, &error));
  EXPECT_NE(error.find("this process is global rank 2"), std::string::npos) << error;
}

// --------------------------------------------------------------- liveness

TEST_F(ControlPlane, KilledProcessGoesOfflineAtOnce) {
  ChildProcess child([](const std::string& address, ChildProcess& self) {
    auto agent = childFounder(address, self, "kill", 2, {0, 1, 2}, 3);
    for (;;) ::pause();
  });
  start();
  Members members = connectAll({0, 1});
  child.go(address());
  auto results = registerAsync(members, "kill", {0, 1, 2}, 3);
  ASSERT_EQ(child.nextReport(5s), "registered");
  for (auto& r : results) ASSERT_EQ(r.get(), "");

  auto killed = SteadyClock::now();
  child.signal(SIGKILL);
  for (auto& member : members) {
    auto view = member->log.waitFor([](const GroupView& v) { return v.members[2] == MemberState::kInactive; });
    ASSERT_TRUE(view.has_value());
    EXPECT_FALSE(view->online[2]);
    EXPECT_EQ(view->epoch, 2u);
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 1}));
  }
  // End of stream: no waiting for the heartbeat timeout (1 s).
  EXPECT_LT(since(killed), 500ms);
}

TEST_F(ControlPlane, StalledProcessGoesOfflineAtTheHeartbeatTimeout) {
  ChildProcess child([](const std::string& address, ChildProcess& self) {
    auto agent = childFounder(address, self, "stall", 1, {0, 1}, 2);
    ::raise(SIGSTOP);  // alive, connected, silent
    for (;;) ::pause();
  });
  start();
  Members members = connectAll({0});
  child.go(address());
  auto results = registerAsync(members, "stall", {0, 1}, 2);
  ASSERT_EQ(child.nextReport(5s), "registered");
  ASSERT_EQ(results[0].get(), "");
  ASSERT_TRUE(child.waitStopped(5s));
  auto stopped = SteadyClock::now();
  auto view = members[0]->log.waitFor(seatIs(1, MemberState::kInactive), 3s);
  Ms detected = since(stopped);
  ASSERT_TRUE(view.has_value());
  EXPECT_FALSE(view->online[1]);
  EXPECT_GE(detected, 800ms);   // not before ~heartbeat_timeout (1 s)
  EXPECT_LT(detected, 1500ms);  // nor much after
}

TEST_F(ControlPlane, ReplacementWaitsForItsPredecessorThenFails) {
  ControlOptions options = testOptions();
  options.heartbeat_timeout = 300ms;
  start(options);
  auto old = connect(1);
  // The old process keeps heartbeating: the new one is refused after
  // heartbeat_timeout, with a clear reason.
  std::string error;
  auto started = SteadyClock::now();
  EXPECT_EQ(Agent::connect(address(), 1, options_, &error), nullptr);
  EXPECT_GE(since(started), 250ms);
  EXPECT_LT(since(started), 1500ms);
  EXPECT_NE(error.find("still held by a live process"), std::string::npos) << error;
  // A replacement whose predecessor leaves while it waits is accepted then.
  auto replacement = std::async(std::launch::async, [&] {
    std::string why;
    return Agent::connect(address(), 1, options_, &why);
  });
  std::this_thread::sleep_for(100ms);
  started = SteadyClock::now();
  old.reset();
  ASSERT_EQ(replacement.wait_for(2s), std::future_status::ready);
  EXPECT_NE(replacement.get(), nullptr);
  EXPECT_LT(since(started), 500ms);  // when the old one left, not at the end of the wait
}

// ------------------------------------------------------- failure evidence

TEST_F(ControlPlane, ReportedSeatIsDeactivatedWhenTheWindowCloses) {
  start();
  Members members = found("report", 3, 3);
  auto reported = SteadyClock::now();
  members[0]->agent->reportFailure("report", {2});  // 2 stalls in the data plane but is online
  for (auto& member : members) {
    auto view = member->log.waitFor(seatIs(2, MemberState::kInactive));
    ASSERT_TRUE(view.has_value());
    EXPECT_TRUE(view->online[2]);
    EXPECT_EQ(view->epoch, 2u);
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 1}));
  }
  EXPECT_GE(since(reported), 40ms);  // the window (50 ms) collected evidence first
  EXPECT_LT(since(reported), 1000ms);
}

TEST_F(ControlPlane, MutualReportsDeactivateOnlyTheHigherSeat) {
  ControlOptions options = testOptions();
  options.reconciliation_window = 300ms;  // both reports surely inside it
  start(options);
  Members members = found("mutual", 3, 3);
  members[1]->agent->reportFailure("mutual", {2});
  members[2]->agent->reportFailure("mutual", {1});
  auto view = members[0]->log.waitFor(seatIs(2, MemberState::kInactive));
  ASSERT_TRUE(view.has_value());
  EXPECT_EQ(view->members[1], MemberState::kActive);
  EXPECT_EQ(view->epoch, 2u);  // one decision, one view
}

TEST_F(ControlPlane, WithoutAutoDeactivateReportsChangeNothing) {
  start();
  Members members = found("manual", 3, 3, /*auto_deactivate=*/false);
  members[0]->agent->reportFailure("manual", {2});
  SyncResult result = members[1]->agent->syncAfterFailure("manual", {2});
  EXPECT_EQ(result.response.status, SyncAfterFailureStatus::Reconciled);
  EXPECT_EQ(result.view.epoch, 1u);
  EXPECT_EQ(result.view.activeRanks(), (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(members[0]->log.views().empty());
  // Deactivation is the framework's call.
  auto response = members[0]->agent->propose("manual", /*activate=*/false, {2});
  EXPECT_EQ(response.status, ProposalStatus::Applied);
  EXPECT_EQ(response.new_epoch, 2);
}

TEST_F(ControlPlane, SyncAfterFailureReconcilesOrReportsNothingPending) {
  ControlOptions options = testOptions();
  options.reconciliation_window = 300ms;
  start(options);
  Members members = found("sync", 3, 3);
  auto started = SteadyClock::now();
  SyncResult quiet = members[0]->agent->syncAfterFailure("sync", {});
  EXPECT_EQ(quiet.response.status, SyncAfterFailureStatus::NoPending);
  EXPECT_EQ(quiet.view.epoch, 1u);
  EXPECT_LT(since(started), 200ms);  // no window to wait for

  started = SteadyClock::now();
  SyncResult reconciled = members[0]->agent->syncAfterFailure("sync", {1});
  EXPECT_GE(since(started), 250ms);  // answered when the window closed
  EXPECT_EQ(reconciled.response.status, SyncAfterFailureStatus::Reconciled);
  EXPECT_EQ(reconciled.view.epoch, 2u);
  EXPECT_EQ(reconciled.view.members[1], MemberState::kInactive);
  // The listener had the view before syncAfterFailure returned.
  auto views = members[0]->log.views();
  ASSERT_FALSE(views.empty());
  EXPECT_EQ(views.back().epoch, 2u);
  EXPECT_EQ(members[0]->agent->view("sync").epoch, 2u);

  SyncResult unknown = members[0]->agent->syncAfterFailure("nonexistent", {});
  EXPECT_EQ(unknown.response.status, SyncAfterFailureStatus::Rejected);
  EXPECT_NE(unknown.response.reject_reason.find("unknown group"), std::string::npos);
  auto stranger = connect(7);
  SyncResult not_member = stranger->agent->syncAfterFailure("sync", {});
  EXPECT_EQ(not_member.response.status, SyncAfterFailureStatus::Rejected);
  EXPECT_NE(not_member.response.reject_reason.find("holds no seat"), std::string::npos);
}

// ------------------------------------------ extension, join, replacement

TEST_F(ControlPlane, ExtensionJoinsInactiveAndIsActivatedByAFounder) {
  start();
  Members members = found("grow", 3, 4);
  members.push_back(connect(3));
  Member& joiner = *members[3];
  std::string error;
  auto registered = SteadyClock::now();
  ASSERT_TRUE(joiner.agent->registerGroup(registration("grow", 3, {0, 1, 2, 3}, 4, /*is_extension=*/true),
                                          joiner.log.listener(), &joiner.view, &error))
      << error;
  EXPECT_LT(since(registered), 200ms);  // at once
  EXPECT_EQ(joiner.view.epoch, 2u);
  EXPECT_EQ(joiner.view.active_epoch, 1u);  // an inactive seat joining changes no active configuration
  EXPECT_EQ(joiner.view.members[3], MemberState::kInactive);
  EXPECT_EQ(joiner.view.global_ranks[3], 3);
  EXPECT_EQ(joiner.view.endpoints[3], "endpoint-of-3");
  for (int founder = 0; founder < 3; ++founder) {
    EXPECT_TRUE(members[founder]->log.waitFor(seatIs(3, MemberState::kInactive)).has_value());
  }

  // The activation waits for the joiner to be ready.
  auto activation = std::async(std::launch::async, [&] { return members[0]->agent->propose("grow", true, {3}); });
  std::this_thread::sleep_for(100ms);
  auto joined = std::async(std::launch::async, [&] {
    std::string why;
    return joiner.agent->joinGroup("grow", 3000ms, &why) ? std::string() : why;
  });
  ASSERT_EQ(activation.wait_for(3s), std::future_status::ready);
  ProposeViewUpdateResponse response = activation.get();
  EXPECT_EQ(response.status, ProposalStatus::Applied) << response.reject_reason;
  EXPECT_EQ(response.new_epoch, 4);  // 3: AwaitingActivation, 4: Active
  ASSERT_EQ(joined.wait_for(3s), std::future_status::ready);
  EXPECT_EQ(joined.get(), "");
  for (auto& member : members) {
    auto view = member->log.waitFor(seatIs(3, MemberState::kActive));
    ASSERT_TRUE(view.has_value());
    EXPECT_EQ(view->epoch, 4u);
    EXPECT_EQ(view->active_epoch, 4u);  // the activation is the first change of the active set since founding
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 1, 2, 3}));
    // Epochs only increase, one view per change.
    auto views = member->log.views();
    for (size_t i = 1; i < views.size(); ++i) EXPECT_GT(views[i].epoch, views[i - 1].epoch);
  }
  EXPECT_TRUE(members[3]->log.waitFor(seatIs(3, MemberState::kAwaitingActivation)).has_value());
}

TEST_F(ControlPlane, ExtensionThatArrivesBeforeTheFoundersWaitsForTheGroup) {
  // A joiner started alongside the founders registers first: it waits for
  // the group to be formed, then attaches Inactive; without founders it is
  // refused at request_timeout.
  start();
  auto joiner = connect(2);
  std::string error;
  GroupView joiner_view;
  auto registered = std::async(std::launch::async, [&] {
    return joiner->agent->registerGroup(registration("early", 2, {0, 1, 2}, 3, /*is_extension=*/true), nullptr,
                                        &joiner_view, &error);
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(registered.wait_for(0ms), std::future_status::timeout) << "it must wait for the founders";
  Members founders = found("early", 2, 3);
  ASSERT_EQ(registered.wait_for(3s), std::future_status::ready);
  ASSERT_TRUE(registered.get()) << error;
  EXPECT_EQ(joiner_view.members[2], MemberState::kInactive);
  EXPECT_EQ(joiner_view.activeRanks(), (std::vector<int>{0, 1}));

  auto lonely = connect(5);
  auto started = SteadyClock::now();
  GroupView none;
  EXPECT_FALSE(lonely->agent->registerGroup(registration("never", 1, {4, 5}, 2, true), nullptr, &none, &error));
  EXPECT_GE(since(started), options_.request_timeout - 50ms);
  EXPECT_NE(error.find("no group 'never' was formed"), std::string::npos) << error;
}

TEST_F(ControlPlane, RefoundingAfterEveryoneLeftMakesANewIncarnation) {
  // destroy_process_group then init_process_group in the same processes:
  // the first to come back waits until the old incarnation is deserted,
  // then everyone founds a new one (another uid), instead of attaching to
  // the old one as a replacement would.
  start();
  Members members = found("again", 2, 2);
  const std::string old_uid = members[0]->view.uid;
  members[0]->agent->unregisterGroup("again");
  std::string error0;
  GroupView view0;
  auto first = std::async(std::launch::async, [&] {
    return members[0]->agent->registerGroup(registration("again", 0, {0, 1}, 2), nullptr, &view0, &error0);
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(first.wait_for(0ms), std::future_status::timeout) << "seat 1 still holds the old incarnation";
  members[1]->agent->unregisterGroup("again");
  std::string error1;
  GroupView view1;
  ASSERT_TRUE(members[1]->agent->registerGroup(registration("again", 1, {0, 1}, 2), nullptr, &view1, &error1))
      << error1;
  ASSERT_EQ(first.wait_for(3s), std::future_status::ready);
  ASSERT_TRUE(first.get()) << error0;
  EXPECT_NE(view0.uid, old_uid);
  EXPECT_EQ(view0.uid, view1.uid);
  EXPECT_EQ(view0.activeRanks(), (std::vector<int>{0, 1}));
}

TEST_F(ControlPlane, JoinGroupFailsAtItsDeadlineWithoutActivation) {
  start();
  Members members = found("wait", 2, 3);
  members.push_back(connect(2));
  std::string error;
  ASSERT_TRUE(members[2]->agent->registerGroup(registration("wait", 2, {0, 1, 2}, 3, true), nullptr, &members[2]->view,
                                               &error));
  auto started = SteadyClock::now();
  EXPECT_FALSE(members[2]->agent->joinGroup("wait", 200ms, &error));
  EXPECT_GE(since(started), 190ms);
  EXPECT_LT(since(started), 1000ms);
  EXPECT_NE(error.find("not activated within 200 ms"), std::string::npos) << error;
}

TEST_F(ControlPlane, ReplacementTakesOverTheSeatOfADeadProcess) {
  start();
  Members members = found("replace", 3, 3);
  auto left = SteadyClock::now();
  members[2].reset();  // the destructor disconnects: seen at once
  auto gone = members[0]->log.waitFor(seatIs(2, MemberState::kInactive));
  ASSERT_TRUE(gone.has_value());
  EXPECT_LT(since(left), 500ms);
  EXPECT_FALSE(gone->online[2]);

  members[2] = connect(2);  // the predecessor is offline: accepted at once
  Member& successor = *members[2];
  GroupRegistration takeover = registration("replace", 2, {0, 1, 2}, 3, /*is_extension=*/true);
  takeover.endpoint = "new-endpoint";
  std::string error;
  ASSERT_TRUE(successor.agent->registerGroup(takeover, successor.log.listener(), &successor.view, &error)) << error;
  EXPECT_EQ(successor.view.members[2], MemberState::kInactive);
  EXPECT_TRUE(successor.view.online[2]);
  EXPECT_EQ(successor.view.endpoints[2], "new-endpoint");
  auto seen = members[1]->log.waitFor([](const GroupView& v) { return v.endpoints[2] == "new-endpoint"; });
  ASSERT_TRUE(seen.has_value());
  EXPECT_TRUE(seen->online[2]);

  auto joined = std::async(std::launch::async, [&] {
    std::string why;
    return successor.agent->joinGroup("replace", 3000ms, &why) ? std::string() : why;
  });
  // Activation may race the join: it waits for the seat to be ready.
  ProposeViewUpdateResponse response = members[0]->agent->propose("replace", true, {2});
  EXPECT_EQ(response.status, ProposalStatus::Applied) << response.reject_reason;
  ASSERT_EQ(joined.wait_for(3s), std::future_status::ready);
  EXPECT_EQ(joined.get(), "");
  EXPECT_TRUE(members[1]->log.waitFor(seatIs(2, MemberState::kActive)).has_value());
}

// -------------------------------------------------------------- proposals

TEST_F(ControlPlane, ProcessThatNeverAcknowledgesIsDropped) {
  start();
  std::mutex mutex;
  std::condition_variable release;
  bool released = false;
  Members members = connectAll({0, 1, 2});
  std::vector<std::future<std::string>> results;
  for (int seat = 0; seat < 3; ++seat) {
    Member* member = members[seat].get();
    Agent::ViewListener listener = member->log.listener();
    if (seat == 2) {
      // Seat 2's listener hangs on the next view: its acknowledgement never comes in time.
      listener = [&, inner = listener](const GroupView& view) {
        inner(view);
        std::unique_lock<std::mutex> lock(mutex);
        release.wait_for(lock, 5s, [&] { return released; });
      };
    }
    GroupRegistration r = registration("ack", seat, {0, 1, 2}, 3);
    results.push_back(std::async(std::launch::async, [member, r, listener] {
      std::string error;
      return member->agent->registerGroup(r, listener, &member->view, &error) ? std::string() : error;
    }));
  }
  for (auto& r : results) ASSERT_EQ(r.get(), "");

  auto proposed = SteadyClock::now();
  ProposeViewUpdateResponse response = members[0]->agent->propose("ack", /*activate=*/false, {1});
  Ms took = since(proposed);
  EXPECT_EQ(response.status, ProposalStatus::AppliedWithDroppedRanks) << response.reject_reason;
  EXPECT_EQ(response.dropped_ranks, std::vector<int>{2});
  EXPECT_EQ(response.new_epoch, 3);  // 2: seat 1 Inactive; 3: the dropped seat 2 Inactive and offline
  EXPECT_GE(took, 450ms);            // ack_timeout (500 ms)
  EXPECT_LT(took, 1500ms);
  GroupView view = members[0]->agent->view("ack");  // current when propose returned
  EXPECT_EQ(view.epoch, 3u);
  EXPECT_EQ(view.activeRanks(), std::vector<int>{0});
  EXPECT_FALSE(view.online[2]);
  {
    std::lock_guard<std::mutex> lock(mutex);
    released = true;
  }
  release.notify_all();
}

TEST_F(ControlPlane, InvalidProposalsAreRejectedWithReasons) {
  ControlOptions options = testOptions();
  options.request_timeout = 300ms;
  start(options);
  Members members = found("bad", 2, 4);
  Agent& agent = *members[0]->agent;

  auto outside = agent.propose("bad", true, {7, -1});
  EXPECT_EQ(outside.status, ProposalStatus::Rejected);
  EXPECT_NE(outside.reject_reason.find("[7, -1] outside [0, 4)"), std::string::npos) << outside.reject_reason;
  auto unregistered = agent.propose("bad", false, {1, 3});
  EXPECT_EQ(unregistered.status, ProposalStatus::Rejected);
  EXPECT_NE(unregistered.reject_reason.find("[3] never registered"), std::string::npos) << unregistered.reject_reason;
  auto unknown = agent.propose("nonexistent", true, {0});
  EXPECT_EQ(unknown.status, ProposalStatus::Rejected);
  EXPECT_NE(unknown.reject_reason.find("unknown group"), std::string::npos);

  // Nothing to change: Applied at the current epoch.
  auto nothing = agent.propose("bad", true, {0, 1});
  EXPECT_EQ(nothing.status, ProposalStatus::Applied);
  EXPECT_EQ(nothing.new_epoch, 1);
  EXPECT_EQ(agent.propose("bad", false, {}).status, ProposalStatus::Applied);

  // A registered seat that never joins: not admitted within request_timeout.
  members.push_back(connect(2));
  std::string error;
  ASSERT_TRUE(
      members[2]->agent->registerGroup(registration("bad", 2, {0, 1, 2}, 4, true), nullptr, &members[2]->view, &error));
  auto started = SteadyClock::now();
  auto waited = agent.propose("bad", true, {2});
  EXPECT_GE(since(started), 250ms);
  EXPECT_EQ(waited.status, ProposalStatus::Rejected);
  EXPECT_NE(waited.reject_reason.find("seats [2] are not AwaitingActivation, online and with an endpoint (2 is Inactive)"),
            std::string::npos)
      << waited.reject_reason;
}

// ---------------------------------------------------- leaving, coordinator

TEST_F(ControlPlane, UnregisteringAnActiveSeatTellsTheOthers) {
  start();
  Members members = found("leave", 3, 3);
  members[1]->agent->unregisterGroup("leave");
  for (int other : {0, 2}) {
    auto view = members[other]->log.waitFor(seatIs(1, MemberState::kLeft));
    ASSERT_TRUE(view.has_value());
    EXPECT_EQ(view->activeRanks(), (std::vector<int>{0, 2}));
    EXPECT_EQ(view->endpoints[1], "");
  }
  EXPECT_TRUE(members[1]->log.views().empty());  // the leaver hears nothing more
  EXPECT_EQ(members[1]->agent->view("leave").epoch, 0u);
}

TEST_F(ControlPlane, LostCoordinatorFailsPendingCallsPromptly) {
  ControlOptions options = testOptions();
  options.request_timeout = 10000ms;
  start(options);
  Members members = connectAll({0, 1});
  auto results = registerAsync(members, "orphan", {0, 1, 2}, 3);  // waits for founder 2
  std::this_thread::sleep_for(100ms);
  auto lost = SteadyClock::now();
  coordinator_.reset();
  for (auto& r : results) {
    ASSERT_EQ(r.wait_for(2s), std::future_status::ready);
    std::string error = r.get();
    EXPECT_NE(error.find("lost the connection to the coordinator"), std::string::npos) << error;
  }
  EXPECT_LT(since(lost), 500ms);
  // Later calls fail at once.
  auto response = members[0]->agent->propose("orphan", true, {0});
  EXPECT_EQ(response.status, ProposalStatus::Rejected);
  EXPECT_NE(response.reject_reason.find("lost the connection"), std::string::npos);
}

TEST_F(ControlPlane, CoordinatorDropsPeersThatSendGarbageAndCarriesOn) {
  start();
  RawPeer garbage(address());
  garbage.sendBytes({'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P'});
  EXPECT_TRUE(garbage.closedByPeer(1s));
  RawPeer rude(address());
  rude.send(control::ViewAck{"x", 1});  // before Hello
  EXPECT_TRUE(rude.closedByPeer(1s));
  Members members = found("after", 2, 2);
  EXPECT_EQ(members[0]->view.epoch, 1u);
}

}  // namespace
}  // namespace mooncake::pg

namespace mooncake::pg {
namespace {

}  // namespace
}  // namespace mooncake::pg
