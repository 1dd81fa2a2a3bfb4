// The Gloo communicator and its TCP rendezvous store, with real processes: the test serves the store, forks the
// ranks, and each rank checks every collective's result against what the other ranks' inputs make it.
#include "deepinfer/backend/communicator.h"

#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <thread>

namespace deepinfer::backend {
namespace {

using namespace std::chrono_literals;

// Runs body(rank) in `size` forked processes; each exits 0 when its checks passed. Returns the exit codes.
std::vector<int> run_ranks(int size, const std::function<int(int rank, int port)>& body) {
  Result<std::unique_ptr<TcpStore>> store = serve_tcp_store("127.0.0.1", 0);
  EXPECT_TRUE(store.ok()) << store.status().message();
  const int port = (*store)->port();
  std::vector<pid_t> children;
  for (int rank = 0; rank < size; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      alarm(60);  // a hung collective fails the test instead of hanging CTest
      std::_Exit(body(rank, port));
    }
    children.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

std::unique_ptr<Communicator> join(int rank, int size, int port, const char* prefix, std::chrono::milliseconds timeout) {
  Result<std::unique_ptr<TcpStore>> store = connect_tcp_store("127.0.0.1", port, 10s);
  if (!store.ok()) return nullptr;
  Result<std::unique_ptr<Communicator>> comm =
      make_gloo_communicator(**store, prefix, rank, size, "127.0.0.1", timeout);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().message().c_str());
    return nullptr;
  }
  return std::move(comm).value();
}

Tensor view(std::vector<float>& v, int64_t rows, int64_t cols) { return Tensor{v.data(), DType::kF32, rows, cols, cols}; }

#define RANK_CHECK(cond)                                                            \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "rank %d: %s failed (line %d)\n", rank, #cond, __LINE__); \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

TEST(Communicator, EveryCollectiveOverThreeProcesses) {
  const int size = 3;
  std::vector<int> codes = run_ranks(size, [&](int rank, int port) {
    std::unique_ptr<Communicator> comm = join(rank, size, port, "world", 20s);
    RANK_CHECK(comm != nullptr);
    RANK_CHECK(comm->rank() == rank && comm->size() == size);
    // all_reduce_sum: x[i] = rank * 10 + i -> sum = 30 + 3i (ranks 0, 1, 2).
    std::vector<float> x(6);
    for (int i = 0; i < 6; ++i) x[i] = static_cast<float>(rank * 10 + i);
    comm->all_reduce_sum(view(x, 2, 3));
    for (int i = 0; i < 6; ++i) RANK_CHECK(x[i] == static_cast<float>(30 + 3 * i));
    // all_gather_rows: each rank one row [rank, rank + 0.5].
    std::vector<float> mine = {static_cast<float>(rank), rank + 0.5f}, all(6);
    comm->all_gather_rows(view(mine, 1, 2), view(all, 3, 2));
    for (int r = 0; r < size; ++r) RANK_CHECK(all[2 * r] == r && all[2 * r + 1] == r + 0.5f);
    // reduce_scatter_rows: in [3, 2] = 1 everywhere on every rank -> my row = 3.
    std::vector<float> ones(6, 1.0f), row(2);
    comm->reduce_scatter_rows(view(ones, 3, 2), view(row, 1, 2));
    RANK_CHECK(row[0] == 3.0f && row[1] == 3.0f);
    // all_to_all_rows: rank r sends q + 1 rows of value 100 r + q to rank q.
    std::vector<int64_t> send_rows(size), recv_rows(size);
    for (int q = 0; q < size; ++q) send_rows[q] = q + 1;
    comm->all_to_all_counts(send_rows, recv_rows);
    for (int q = 0; q < size; ++q) RANK_CHECK(recv_rows[q] == rank + 1);
    std::vector<float> send, recv(static_cast<size_t>(size * (rank + 1)));
    for (int q = 0; q < size; ++q) send.insert(send.end(), static_cast<size_t>(q + 1), 100.0f * rank + q);
    comm->all_to_all_rows(view(send, static_cast<int64_t>(send.size()), 1), send_rows,
                          view(recv, static_cast<int64_t>(recv.size()), 1), recv_rows);
    for (int q = 0; q < size; ++q) {
      for (int i = 0; i < rank + 1; ++i) RANK_CHECK(recv[q * (rank + 1) + i] == 100.0f * q + rank);
    }
    // broadcast from rank 2.
    std::vector<std::byte> bytes(5, std::byte{static_cast<unsigned char>(rank)});
    comm->broadcast_host(bytes, 2);
    for (std::byte b : bytes) RANK_CHECK(b == std::byte{2});
    comm->barrier();
    RANK_CHECK(comm->status().ok());
    return 0;
  });
  for (int r = 0; r < size; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

// A rank that dies leaves the others with an error from their next collective, not a hang.
TEST(Communicator, APeerThatDiesFailsTheCollectiveWithinTheTimeout) {
  std::vector<int> codes = run_ranks(2, [&](int rank, int port) {
    std::unique_ptr<Communicator> comm = join(rank, 2, port, "world", 3s);
    RANK_CHECK(comm != nullptr);
    comm->barrier();
    if (rank == 1) std::_Exit(7);
    const auto start = std::chrono::steady_clock::now();
    std::vector<float> x(4, 1.0f);
    comm->all_reduce_sum(view(x, 1, 4));
    RANK_CHECK(!comm->status().ok());
    RANK_CHECK(std::chrono::steady_clock::now() - start < 10s);
    std::vector<float> y(4, 1.0f);
    comm->all_reduce_sum(view(y, 1, 4));  // does nothing after a failure
    RANK_CHECK(y[0] == 1.0f);
    return 0;
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 7);
}

TEST(TcpStore, GetWaitsForTheKeyThenTimesOut) {
  Result<std::unique_ptr<TcpStore>> server = serve_tcp_store("127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status().message();
  Result<std::unique_ptr<TcpStore>> client = connect_tcp_store("127.0.0.1", (*server)->port(), 5s);
  ASSERT_TRUE(client.ok()) << client.status().message();
  std::vector<std::byte> value = {std::byte{1}, std::byte{2}};
  ASSERT_TRUE((*server)->set("k", value).ok());
  Result<std::vector<std::byte>> got = (*client)->get("k", 1s);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, value);
  const auto start = std::chrono::steady_clock::now();
  Result<std::vector<std::byte>> missing = (*client)->get("absent", 200ms);
  EXPECT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("absent"), std::string::npos);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 150ms);
}

// Probes and scanners that connect and leave cost nothing lasting (regression: one thread per connection ever made,
// until the server could make no more and aborted), and an oversized value closes its connection.
TEST(TcpStore, ManyShortConnectionsAndAnOversizedValueLeaveItServing) {
  Result<std::unique_ptr<TcpStore>> server = serve_tcp_store("127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status().message();
  for (int i = 0; i < 500; ++i) {
    Result<std::unique_ptr<TcpStore>> probe = connect_tcp_store("127.0.0.1", (*server)->port(), 5s);
    ASSERT_TRUE(probe.ok()) << i;
  }
  Result<std::unique_ptr<TcpStore>> client = connect_tcp_store("127.0.0.1", (*server)->port(), 5s);
  ASSERT_TRUE(client.ok());
  std::vector<std::byte> big(size_t{2} << 20);
  EXPECT_FALSE((*client)->set("big", big).ok());  // over the 1 MiB cap: the server closes the connection
  Result<std::unique_ptr<TcpStore>> again = connect_tcp_store("127.0.0.1", (*server)->port(), 5s);
  ASSERT_TRUE(again.ok());
  std::vector<std::byte> value = {std::byte{9}};
  ASSERT_TRUE((*again)->set("k", value).ok());
  Result<std::vector<std::byte>> got = (*again)->get("k", 1s);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, value);
  // This process's threads: the test's, the server's accept thread and the few live connections, not 500.
  int threads = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) ++threads;
  EXPECT_LT(threads, 64);
}

// Two `serve` processes with the same --node-rank claim it with add(): exactly one may win, however they race
// (regression: both joined the group). Sixteen clients on threads of their own add 1 to one fresh key at once.
TEST(TcpStore, AddIsAtomicAcrossClientsSoExactlyOneClaimWins) {
  Result<std::unique_ptr<TcpStore>> server = serve_tcp_store("127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status().message();
  constexpr int kClients = 16;
  std::vector<std::unique_ptr<TcpStore>> clients;
  for (int i = 0; i < kClients; ++i) {
    Result<std::unique_ptr<TcpStore>> client = connect_tcp_store("127.0.0.1", (*server)->port(), 5s);
    ASSERT_TRUE(client.ok()) << client.status().message();
    clients.push_back(std::move(client).value());
  }
  std::vector<int64_t> sums(kClients, -1);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      Result<int64_t> sum = clients[i]->add("claim", 1);
      if (sum.ok()) sums[i] = *sum;
    });
  }
  for (std::thread& t : threads) t.join();
  std::sort(sums.begin(), sums.end());
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(sums[i], i + 1) << "client " << i;  // 1 .. 16, each once
  Result<int64_t> back = (*server)->add("claim", -16);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, 0);
  // A counter reads as 8 little-endian bytes; a key set() filled with other bytes is no counter.
  Result<std::vector<std::byte>> got = clients[0]->get("claim", 1s);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->size(), sizeof(int64_t));
  ASSERT_TRUE((*server)->set("text", std::vector<std::byte>{std::byte{'x'}}).ok());
  Result<int64_t> bad = clients[1]->add("text", 1);
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("text"), std::string::npos);
  Result<int64_t> after = clients[1]->add("claim", 5);  // the connection still serves
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(*after, 5);
}

// A store whose process hangs (SIGSTOP: its socket accepts, nobody answers): every call fails within its timeout plus
// the client's grace, and the connection is given up (regression: a data-parallel rank whose group failed asked a hung
// rank 0's store who had left, and blocked forever, so it never exited).
TEST(TcpStore, AStoreThatNeverAnswersFailsTheCallInsteadOfBlocking) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);  // connections complete in the backlog; none is ever accepted or answered
  socklen_t length = sizeof(address);
  ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length), 0);
  Result<std::unique_ptr<TcpStore>> client = connect_tcp_store("127.0.0.1", ntohs(address.sin_port), 2s);
  ASSERT_TRUE(client.ok()) << client.status().message();
  const auto start = std::chrono::steady_clock::now();
  Result<std::vector<std::byte>> got = (*client)->get("dp/left/0", 200ms);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("did not answer"), std::string::npos) << got.status().message();
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, 6s);
  const auto again = std::chrono::steady_clock::now();
  EXPECT_FALSE((*client)->add("dp/alive", 0).ok());  // the connection is given up: at once
  EXPECT_LT(std::chrono::steady_clock::now() - again, 1s);
  ::close(listener);
}

TEST(TcpStore, ConnectGivesUpWhenNoServerAnswers) {
  Result<std::unique_ptr<TcpStore>> client = connect_tcp_store("127.0.0.1", 1, 300ms);
  EXPECT_FALSE(client.ok());
}

}  // namespace
}  // namespace deepinfer::backend
