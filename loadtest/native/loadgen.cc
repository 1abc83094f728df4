// embedcar-loadgen: the load generator's open-loop sender in C++ on gRPC's C core (the library the
// sidecar's own server runs on), so that the client's cost in a load test is a compiled client's,
// as a search node's would be, not Python grpc.aio's (~0.5 ms of CPU per call on the same cores).
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

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;  // CLOCK_MONOTONIC on Linux: Python's time.monotonic_ns()
constexpr int kDeadlineExceeded = 4;
constexpr int kUnavailable = 14;
constexpr int kStreamEnded = -2;  // placeholder until the stream's final status is known

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}


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

// One thread sends and polls the completion queue (AsyncNext until the next send is due), so a
// call costs no wake-up between threads: on a small VM those cost as much as the call itself.
class Run {
 public:
  Run(Options o, std::vector<Request> reqs)
      : o_(std::move(o)), reqs_(std::move(reqs)), records_(reqs_.size()), due_(reqs_.size(), 0) {
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
    if (stream_mode()) open_stream();
    int64_t last_due = start_ns_ + (reqs_.empty() ? 0 : reqs_.back().offset_ns);
    give_up_ns_ = last_due + o_.deadline_ns + 1'000'000'000;
    size_t next = 0;
    while (next < reqs_.size()) {
      int64_t due = start_ns_ + reqs_[next].offset_ns;
      if (now_ns() >= due && (in_flight_ < o_.concurrency || stream_failed_)) {
        send(next++, due);
        continue;
      }
      if (in_flight_ >= o_.concurrency && !stream_failed_) {  // at the cap: only a reply frees a slot
        poll_until(INT64_MAX);
        continue;
      }
      int64_t wake = due - o_.spin_ns;
      if (now_ns() < wake) poll_until(wake);
      else poll_until(now_ns());  // spinning: take what completed, then look at the clock again
    }
    finish();
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
  struct Tag {
    enum Kind { kUnary, kStart, kWrite, kRead, kWritesDone, kFinish } kind;
  };
  struct UnaryCall : Tag {
    size_t index = 0;
    grpc::ClientContext ctx;
    grpc::ByteBuffer reply;
    grpc::Status status;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> rpc;
  };

  bool stream_mode() const { return o_.mode == "stream"; }

  void add_key(grpc::ClientContext& ctx) const {
    if (!api_key_.empty()) ctx.AddMetadata("x-api-key", api_key_);
  }

  // Handle completions until `until_ns` (INT64_MAX: until one arrives); now_ns() or earlier: only
  // what has already completed.
  void poll_until(int64_t until_ns) {
    void* tag = nullptr;
    bool ok = false;
    auto deadline = until_ns == INT64_MAX ? std::chrono::system_clock::now() + std::chrono::hours(24)
                                          : wall_at(until_ns);
    while (true) {
      auto got = cq_.AsyncNext(&tag, &ok, deadline);
      if (got != grpc::CompletionQueue::GOT_EVENT) return;
      handle(static_cast<Tag*>(tag), ok);
      if (until_ns == INT64_MAX) return;
      deadline = std::chrono::system_clock::now();  // take what else is ready, without waiting
    }
  }

  void handle(Tag* t, bool ok) {
    switch (t->kind) {
      case Tag::kUnary: on_unary(static_cast<UnaryCall*>(t)); break;
      case Tag::kStart:
        stream_started_ = true;
        if (ok) stream_->Read(&read_buf_, &read_tag_);
        else stream_over();
        break;
      case Tag::kWrite: on_write(ok); break;
      case Tag::kRead: on_read(ok); break;
      case Tag::kWritesDone: break;
      case Tag::kFinish: finished_ = true; break;
    }
  }

  void send(size_t i, int64_t due) {
    int64_t sent = now_ns();
    Record& r = records_[i];
    r.send_lag_ns = sent - due;
    if (sent - due >= o_.deadline_ns || stream_failed_) {
      // Waited out its deadline behind the cap, or the stream is gone (finish() gives these its
      // status, as the Python client's call raises the stream's error): not sent.
      r.latency_ns = sent - due;
      r.code = stream_failed_ ? kStreamEnded : kDeadlineExceeded;
      r.body = "waited out its deadline behind the concurrency cap";
      return;
    }
    due_[i] = due;
    ++sent_;
    ++in_flight_;
    if (!stream_mode()) {
      auto* c = new UnaryCall();
      c->kind = Tag::kUnary;
      c->index = i;
      c->ctx.set_deadline(wall_at(due + o_.deadline_ns));
      add_key(c->ctx);
      c->rpc = stub_->PrepareUnaryCall(&c->ctx, o_.method, to_buffer(reqs_[i].payload), &cq_);
      c->rpc->StartCall();
      c->rpc->Finish(&c->reply, &c->status, c);
      return;
    }
    if (writing_) {  // one write at a time on a call (gRPC's rule): the rest wait their turn
      write_queue_.push_back(i);
      return;
    }
    start_write(i);
  }

  void on_unary(UnaryCall* c) {
    Record& r = records_[c->index];
    r.latency_ns = now_ns() - due_[c->index];
    r.code = c->status.error_code();
    r.body = c->status.ok() ? from_buffer(c->reply) : c->status.error_message();
    delete c;
    --in_flight_;
  }

  // --- the stream: one write at a time, one read always pending ----------------------------
  void open_stream() {
    add_key(sctx_);
    stream_ = stub_->PrepareCall(&sctx_, o_.method, &cq_);
    stream_->StartCall(&start_tag_);
    while (!stream_started_) poll_until(INT64_MAX);
  }

  void start_write(size_t i) {
    writing_ = true;
    write_buf_ = to_buffer(reqs_[i].payload);
    stream_->Write(write_buf_, &write_tag_);
  }

  void on_write(bool ok) {
    writing_ = false;
    if (!ok) {
      fail_unwritten();
    } else if (!write_queue_.empty()) {
      size_t i = write_queue_.front();
      write_queue_.pop_front();
      start_write(i);
      return;
    }
    if (finish_pending_) read_status();
  }

  void fail_unwritten() {
    stream_failed_ = true;
    for (size_t i : write_queue_) {
      records_[i].latency_ns = now_ns() - due_[i];
      records_[i].code = kStreamEnded;
      --in_flight_;
    }
    write_queue_.clear();
  }

  // The stream is over (a read or the start failed): read its status once no write is outstanding.
  void stream_over() {
    stream_ended_ = true;
    fail_unwritten();
    if (writing_) finish_pending_ = true;
    else read_status();
  }

  void read_status() {
    finish_pending_ = false;
    stream_->Finish(&stream_status_, &finish_tag_);
  }

  void on_read(bool ok) {
    if (!ok) {  // the stream ended: nothing more is sent, every request still waiting fails
      stream_over();
      return;
    }
    std::string body = from_buffer(read_buf_);
    uint64_t id = reply_id(body);
    if (id >= 1 && id <= records_.size() && records_[id - 1].latency_ns < 0 && due_[id - 1] != 0) {
      Record& r = records_[id - 1];
      r.latency_ns = now_ns() - due_[id - 1];
      r.code = 0;
      r.body = std::move(body);
      --in_flight_;
    }
    stream_->Read(&read_buf_, &read_tag_);
  }

  // After the last send: wait for every outcome. Unary calls carry their own deadline. On the
  // stream, a reply that never comes fails at its deadline plus a second, as the Python runner's
  // guard does; then the stream is closed (cancelled if the server keeps it open).
  void finish() {
    if (!stream_mode()) {
      while (in_flight_ > 0) poll_until(INT64_MAX);
      drain();
      return;
    }
    while (in_flight_ > 0 && !stream_ended_ && now_ns() < give_up_ns_) poll_until(give_up_ns_);
    if (!stream_ended_) {
      if (in_flight_ > 0) sctx_.TryCancel();  // replies still owed are abandoned
      while (writing_) poll_until(INT64_MAX);
      if (!stream_ended_) stream_->WritesDone(&writes_done_tag_);
    }
    int64_t close_by = now_ns() + 5'000'000'000;
    while (!finished_ && now_ns() < close_by) poll_until(close_by);
    if (!finished_) {
      sctx_.TryCancel();
      while (!finished_) poll_until(INT64_MAX);
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
    drain();
  }

  void drain() {
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
      auto* t = static_cast<Tag*>(tag);
      if (t->kind == Tag::kUnary) delete static_cast<UnaryCall*>(t);
    }
  }

  Options o_;
  std::vector<Request> reqs_;
  std::vector<Record> records_;
  std::vector<int64_t> due_;  // 0: not sent
  std::string api_key_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> stub_;
  grpc::CompletionQueue cq_;
  int64_t start_ns_ = 0, give_up_ns_ = 0;
  size_t sent_ = 0;
  int in_flight_ = 0;
  // the stream
  grpc::ClientContext sctx_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> stream_;
  grpc::ByteBuffer write_buf_, read_buf_;
  grpc::Status stream_status_;
  std::deque<size_t> write_queue_;
  bool writing_ = false, stream_started_ = false, finished_ = false, finish_pending_ = false;
  bool stream_failed_ = false, stream_ended_ = false;
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
