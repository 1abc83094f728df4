// embedcar-loadgen: the load generator's open-loop sender in C++ on gRPC's C core (the library the
// sidecar's own server runs on), so that the client's cost in a load test is a compiled client's,
// as a search node's would be, not Python grpc.aio's (0.7-1 ms of CPU per call on the same cores).
//
// loadtest/native.py builds it, writes the requests (already-serialized protobuf messages, each
// with its send time), runs it and reads the records back; it never parses protobuf itself.
//
//   embedcar-loadgen --target HOST:PORT --method /embedcar.v1.Embedder/Embed --mode unary|stream
//                    --requests FILE --out FILE [--deadline-ms 1000] [--concurrency 256] [--spin-us 50]
//
// The API key, if any, comes from EMBEDCAR_LOADGEN_API_KEY (never on the command line: ps shows it).
// requests FILE: per request  u64 offset_ns (from the schedule's start)  u32 length  payload bytes.
//   mode stream: each payload is a StreamRequest whose id is its index + 1 (the reply echoes it).
// out FILE:      per request, in index order  i64 send_lag_ns  i64 latency_ns  i32 code  u32 length  body
//   latency from the scheduled send; code: a gRPC status number (0 OK); body: the reply message
//   (OK; for stream every reply, errors included, is a StreamReply), else the status message.
// stdout: "start <CLOCK_MONOTONIC ns>" once connected, just before the first send is due, then at
//   the end one JSON line {"cpu_s": ..., "wall_s": ..., "sent": ...}.
// Exit 0 after a completed schedule (whatever the calls' outcomes), 2 on bad arguments or files,
// 3 when the channel does not connect within 10 s.

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/prctl.h>
#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC on Linux: Python's time.monotonic_ns()
constexpr int kDeadlineExceeded = 4;
constexpr int kUnavailable = 14;
constexpr int kStreamEnded = -2;  // placeholder until the stream's final status is known

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

Clock::time_point at_ns(int64_t ns) { return Clock::time_point(std::chrono::nanoseconds(ns)); }

// gRPC takes deadlines on the system clock: the same instant, moved over.
std::chrono::system_clock::time_point wall_at(int64_t mono_ns) {
  return std::chrono::system_clock::now() + std::chrono::nanoseconds(mono_ns - now_ns());
}

struct Request {
  int64_t offset_ns = 0;
  std::string payload;
};

struct Record {
  int64_t send_lag_ns = 0;
  int64_t latency_ns = -1;  // -1: no outcome yet
  int32_t code = kDeadlineExceeded;
  std::string body;
};

struct Options {
  std::string target, method, mode = "unary", requests_path, out_path;
  int64_t deadline_ns = 1'000'000'000;
  int concurrency = 256;
  int64_t spin_ns = 50'000;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "embedcar-loadgen: " << why << "\n";
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (i + 1 >= argc) usage("missing value for " + k);
    std::string v = argv[++i];
    if (k == "--target") o.target = v;
    else if (k == "--method") o.method = v;
    else if (k == "--mode") o.mode = v;
    else if (k == "--requests") o.requests_path = v;
    else if (k == "--out") o.out_path = v;
    else if (k == "--deadline-ms") o.deadline_ns = static_cast<int64_t>(std::stod(v) * 1e6);
    else if (k == "--concurrency") o.concurrency = std::stoi(v);
    else if (k == "--spin-us") o.spin_ns = static_cast<int64_t>(std::stod(v) * 1e3);
    else usage("unknown argument " + k);
  }
  if (o.target.empty() || o.method.empty() || o.requests_path.empty() || o.out_path.empty())
    usage("--target, --method, --requests and --out are required");
  if (o.mode != "unary" && o.mode != "stream") usage("--mode is unary or stream");
  if (o.deadline_ns <= 0 || o.concurrency < 1 || o.spin_ns < 0) usage("bad deadline, concurrency or spin");
  return o;
}

std::vector<Request> read_requests(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) usage("cannot read " + path);
  std::vector<Request> out;
  while (true) {
    Request r;
    uint32_t len = 0;
    if (!in.read(reinterpret_cast<char*>(&r.offset_ns), 8)) break;
    if (!in.read(reinterpret_cast<char*>(&len), 4)) usage("truncated request file");
    r.payload.resize(len);
    if (len && !in.read(r.payload.data(), len)) usage("truncated request file");
    out.push_back(std::move(r));
  }
  return out;
}

grpc::ByteBuffer to_buffer(const std::string& s) {
  grpc::Slice slice(s.data(), s.size());
  return grpc::ByteBuffer(&slice, 1);
}

std::string from_buffer(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!b.Dump(&slices).ok()) return out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// A StreamReply starts with its id (field 1, varint) when the id is not 0: that is all we read.
uint64_t reply_id(const std::string& m) {
  if (m.empty() || static_cast<uint8_t>(m[0]) != 0x08) return 0;
  uint64_t v = 0;
  for (size_t i = 1, shift = 0; i < m.size() && shift < 64; ++i, shift += 7) {
    auto b = static_cast<uint8_t>(m[i]);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
  return 0;
}

// The concurrency cap: a request waits for a free slot; that wait counts in its send lag.
class Slots {
 public:
  explicit Slots(int n) : free_(n) {}
  void acquire() {
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return free_ > 0 || open_; });
    --free_;
  }
  void open() {  // no more waiting: the run is over
    { std::lock_guard<std::mutex> l(m_); open_ = true; }
    cv_.notify_all();
  }
  void release() {
    { std::lock_guard<std::mutex> l(m_); ++free_; }
    cv_.notify_one();
  }
 private:
  std::mutex m_;
  std::condition_variable cv_;
  int free_;
  bool open_ = false;
};

// Sleep to just before `due`, then spin to it: a timer alone wakes tens of microseconds late.
void wait_until(int64_t due, int64_t spin_ns) {
  int64_t wake = due - spin_ns;
  if (now_ns() < wake) std::this_thread::sleep_until(at_ns(wake));
  while (now_ns() < due) {}
}

// A sender thread paces and sends; the completion-queue thread blocks in Next and records each
// outcome the moment it arrives. (One thread doing both, polling with AsyncNext until the next
// send, cost the same CPU but doubled the round trip here: docs/benchmarks.md, levers.)
class Run {
 public:
  Run(Options o, std::vector<Request> reqs)
      : o_(std::move(o)), reqs_(std::move(reqs)), records_(reqs_.size()), slots_(o_.concurrency) {
    const char* key = std::getenv("EMBEDCAR_LOADGEN_API_KEY");
    if (key && *key) api_key_ = key;
    channel_ = grpc::CreateChannel(o_.target, grpc::InsecureChannelCredentials());
    stub_ = std::make_unique<grpc::GenericStub>(channel_);
  }

  bool connect() { return channel_->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10)); }

  void go() {
    start_ns_ = now_ns() + 10'000'000;  // the first send is due 10 ms from now
    std::printf("start %lld\n", static_cast<long long>(start_ns_));
    std::fflush(stdout);
    std::thread poller([this] { poll(); });
    if (o_.mode == "stream") open_stream();
    send_all();
    finish();
    poller.join();
  }

  void write(const std::string& path) const {
    std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      for (const auto& r : records_) {
        auto len = static_cast<uint32_t>(r.body.size());
        out.write(reinterpret_cast<const char*>(&r.send_lag_ns), 8);
        out.write(reinterpret_cast<const char*>(&r.latency_ns), 8);
        out.write(reinterpret_cast<const char*>(&r.code), 4);
        out.write(reinterpret_cast<const char*>(&len), 4);
        out.write(r.body.data(), len);
      }
      if (!out) usage("cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) usage("cannot rename " + tmp);
  }

  size_t sent() const { return sent_; }

 private:
  // --- completion-queue tags -------------------------------------------------------------
  struct Tag {
    enum Kind { kUnary, kStart, kWrite, kRead, kWritesDone, kFinish } kind;
  };
  struct UnaryCall : Tag {
    size_t index = 0;
    int64_t due = 0;
    grpc::ClientContext ctx;
    grpc::ByteBuffer reply;
    grpc::Status status;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> rpc;
  };

  void add_key(grpc::ClientContext& ctx) const {
    if (!api_key_.empty()) ctx.AddMetadata("x-api-key", api_key_);
  }

  void send_all() {
    for (size_t i = 0; i < reqs_.size(); ++i) {
      int64_t due = start_ns_ + reqs_[i].offset_ns;
      wait_until(due, o_.spin_ns);
      slots_.acquire();
      int64_t sent = now_ns();
      Record& r = records_[i];
      r.send_lag_ns = sent - due;
      if (sent - due >= o_.deadline_ns || stream_failed_) {
        // Waited out its deadline behind the cap, or the stream is gone (finish() gives these its
        // status, as the Python client's call raises the stream's error): not sent.
        r.latency_ns = sent - due;
        r.code = stream_failed_ ? kStreamEnded : kDeadlineExceeded;
        r.body = "waited out its deadline behind the concurrency cap";
        slots_.release();
        continue;
      }
      due_[i] = due;
      ++sent_;
      if (o_.mode == "unary") send_unary(i, due);
      else send_stream(i);
    }
  }

  void send_unary(size_t i, int64_t due) {
    auto* c = new UnaryCall();
    c->kind = Tag::kUnary;
    c->index = i;
    c->due = due;
    c->ctx.set_deadline(wall_at(due + o_.deadline_ns));
    add_key(c->ctx);
    in_flight_.fetch_add(1);  // before the call can complete: the count never dips below zero
    c->rpc = stub_->PrepareUnaryCall(&c->ctx, o_.method, to_buffer(reqs_[i].payload), &cq_);
    c->rpc->StartCall();
    c->rpc->Finish(&c->reply, &c->status, c);
  }

  void on_unary(UnaryCall* c) {
    Record& r = records_[c->index];
    r.latency_ns = now_ns() - c->due;
    r.code = c->status.error_code();
    r.body = c->status.ok() ? from_buffer(c->reply) : c->status.error_message();
    delete c;
    done_one();
  }

  // --- the stream: one write at a time (gRPC's rule for a call), one read always pending ---
  void open_stream() {
    add_key(sctx_);
    stream_ = stub_->PrepareCall(&sctx_, o_.method, &cq_);
    stream_->StartCall(&start_tag_);
    std::unique_lock<std::mutex> l(m_);
    cv_.wait(l, [&] { return stream_started_; });
  }

  void send_stream(size_t i) {
    in_flight_.fetch_add(1);
    std::lock_guard<std::mutex> l(m_);
    if (stream_failed_) {  // ended since send_all looked: not sent
      records_[i].latency_ns = now_ns() - due_[i];
      records_[i].code = kStreamEnded;
      done_one_locked();
      return;
    }
    if (writing_) {
      write_queue_.push_back(i);
      return;
    }
    writing_ = true;
    write_buf_ = to_buffer(reqs_[i].payload);
    stream_->Write(write_buf_, &write_tag_);
  }

  void on_write(bool ok) {
    std::lock_guard<std::mutex> l(m_);
    if (!ok) fail_unwritten_locked();
    if (!ok || write_queue_.empty()) {
      writing_ = false;
      if (finish_pending_) finish_locked();
      cv_.notify_all();
      return;
    }
    size_t i = write_queue_.front();
    write_queue_.pop_front();
    write_buf_ = to_buffer(reqs_[i].payload);
    stream_->Write(write_buf_, &write_tag_);
  }

  void fail_unwritten_locked() {
    stream_failed_ = true;
    slots_.open();
    for (size_t i : write_queue_) {
      records_[i].latency_ns = now_ns() - due_[i];
      records_[i].code = kStreamEnded;
      done_one_locked();
    }
    write_queue_.clear();
  }

  // The stream is over (a read or the start failed): read its status once no write is outstanding.
  void finish_locked() {
    finish_pending_ = false;
    stream_->Finish(&stream_status_, &finish_tag_);
  }

  void stream_over_locked() {
    stream_ended_ = true;
    fail_unwritten_locked();
    if (writing_) finish_pending_ = true;
    else finish_locked();
  }

  void on_read(bool ok) {
    if (!ok) {  // the stream ended: nothing more is sent, every request still waiting fails
      std::lock_guard<std::mutex> l(m_);
      stream_over_locked();
      cv_.notify_all();
      return;
    }
    std::string body = from_buffer(read_buf_);
    uint64_t id = reply_id(body);
    if (id >= 1 && id <= records_.size() && records_[id - 1].latency_ns < 0 && due_[id - 1] != 0) {
      Record& r = records_[id - 1];
      r.latency_ns = now_ns() - due_[id - 1];
      r.code = 0;
      r.body = std::move(body);
      done_one();
    }
    stream_->Read(&read_buf_, &read_tag_);
  }

  // One outcome in. The count changes under m_: finish() checks it and starts waiting under m_, so a
  // change between its check and its wait (and the wake-up with it) cannot be lost.
  void done_one() {
    std::lock_guard<std::mutex> l(m_);
    done_one_locked();
  }

  void done_one_locked() {
    slots_.release();
    in_flight_.fetch_sub(1);
    cv_.notify_all();
  }

  void poll() {
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
      auto* t = static_cast<Tag*>(tag);
      switch (t->kind) {
        case Tag::kUnary: on_unary(static_cast<UnaryCall*>(t)); break;
        case Tag::kStart: {
          std::lock_guard<std::mutex> l(m_);
          stream_started_ = true;
          if (ok) stream_->Read(&read_buf_, &read_tag_);
          else stream_over_locked();
          cv_.notify_all();
          break;
        }
        case Tag::kWrite: on_write(ok); break;
        case Tag::kRead: on_read(ok); break;
        case Tag::kWritesDone: break;
        case Tag::kFinish: {
          std::lock_guard<std::mutex> l(m_);
          finished_ = true;
          cv_.notify_all();
          break;
        }
      }
    }
  }

  // After the last send: wait for every outcome and stop the queue. Unary calls carry their own
  // deadline. On the stream, a reply that never comes fails at its deadline plus a second, as the
  // Python runner's guard does; then the stream is closed (cancelled if the server keeps it open).
  void finish() {
    if (o_.mode == "unary") {
      std::unique_lock<std::mutex> l(m_);
      cv_.wait(l, [&] { return in_flight_.load() == 0; });
      l.unlock();
      cq_.Shutdown();
      return;
    }
    int64_t last_due = start_ns_ + (reqs_.empty() ? 0 : reqs_.back().offset_ns);
    std::unique_lock<std::mutex> l(m_);
    cv_.wait_until(l, at_ns(last_due + o_.deadline_ns + 1'000'000'000),
                   [&] { return in_flight_.load() == 0 || stream_ended_; });
    if (!stream_ended_) {
      if (in_flight_.load() > 0) sctx_.TryCancel();  // replies still owed are abandoned
      cv_.wait(l, [&] { return !writing_; });
      if (!stream_ended_) stream_->WritesDone(&writes_done_tag_);
    }
    if (!cv_.wait_for(l, std::chrono::seconds(5), [&] { return finished_; })) {
      sctx_.TryCancel();
      cv_.wait(l, [&] { return finished_; });
    }
    // What the server ended the stream with (e.g. UNAUTHENTICATED) is each unanswered request's.
    bool ended_badly = stream_ended_ && !stream_status_.ok();
    int32_t end_code = ended_badly ? stream_status_.error_code() : kUnavailable;
    std::string end_message = ended_badly ? stream_status_.error_message() : "the stream ended";
    for (size_t i = 0; i < records_.size(); ++i) {
      Record& r = records_[i];
      if (r.latency_ns < 0 && due_[i] != 0) {
        r.latency_ns = now_ns() - due_[i];
        r.code = stream_ended_ ? end_code : kDeadlineExceeded;
        r.body = stream_ended_ ? end_message : "no reply within the deadline (client-side guard)";
      } else if (r.code == kStreamEnded) {
        r.code = end_code;
        r.body = end_message;
      }
    }
    l.unlock();
    cq_.Shutdown();
  }

  Options o_;
  std::vector<Request> reqs_;
  std::vector<Record> records_;
  std::vector<int64_t> due_ = std::vector<int64_t>(reqs_.size(), 0);
  Slots slots_;
  std::string api_key_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> stub_;
  grpc::CompletionQueue cq_;
  int64_t start_ns_ = 0;
  size_t sent_ = 0;
  std::atomic<int> in_flight_{0};
  std::mutex m_;
  std::condition_variable cv_;
  // the stream
  grpc::ClientContext sctx_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
  grpc::ByteBuffer write_buf_, read_buf_;
  grpc::Status stream_status_;
  std::deque<size_t> write_queue_;
  bool writing_ = false, stream_started_ = false, finished_ = false, finish_pending_ = false;
  std::atomic<bool> stream_failed_{false}, stream_ended_{false};
  Tag start_tag_{Tag::kStart}, write_tag_{Tag::kWrite}, read_tag_{Tag::kRead},
      writes_done_tag_{Tag::kWritesDone}, finish_tag_{Tag::kFinish};
};

double cpu_s() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  prctl(PR_SET_TIMERSLACK, 1UL);  // timers wake when asked, not up to 50 us later
  Run run(o, read_requests(o.requests_path));
  if (!run.connect()) {
    std::cerr << "embedcar-loadgen: cannot connect to " << o.target << " within 10 s\n";
    return 3;
  }
  double cpu0 = cpu_s();
  int64_t t0 = now_ns();
  run.go();
  double wall = (now_ns() - t0) / 1e9, cpu = cpu_s() - cpu0;
  run.write(o.out_path);
  std::printf("{\"cpu_s\": %.6f, \"wall_s\": %.6f, \"sent\": %zu}\n", cpu, wall, run.sent());
  return 0;
}
