// embedcar-echo-server: `embedcar bench transport`'s compiled gRPC servers, on gRPC's C++ callback
// API (Debian's libgrpc++, as the load generator). Any unary method is answered with the reply
// bytes either by the server itself or by a Python process it forwards the request to:
//
//   embedcar-echo-server echo PORT REPLY_BYTES       answers every call itself
//   embedcar-echo-server forward PORT SOCKET_PATH     forwards each request's bytes over a Unix socket
//                                                     and answers with what comes back
//
// forward's frames, both ways: u64 id, u32 length, bytes (the reply echoes the request's id).
// stdout: the bound port, once listening. It serves until killed; with forward, also until the
// socket closes.

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

std::string g_reply;
int g_sock = -1;
std::mutex g_write_mu, g_pending_mu;
std::atomic<uint64_t> g_next_id{1};

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

class Call;
std::unordered_map<uint64_t, Call*> g_pending;

// One unary call: read the request, answer it (or forward it and answer when the reply comes).
class Call : public grpc::ServerGenericBidiReactor {
 public:
  explicit Call(bool forward) : forward_(forward) { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
      return;
    }
    if (!forward_) {
      Answer(g_reply);
      return;
    }
    std::vector<grpc::Slice> slices;
    (void)request_.Dump(&slices);
    std::string body;
    for (const auto& s : slices) body.append(reinterpret_cast<const char*>(s.begin()), s.size());
    uint64_t id = g_next_id++;
    {
      std::lock_guard<std::mutex> lock(g_pending_mu);
      g_pending[id] = this;
    }
    char head[12];
    uint32_t n = static_cast<uint32_t>(body.size());
    std::memcpy(head, &id, 8);
    std::memcpy(head + 8, &n, 4);
    std::lock_guard<std::mutex> lock(g_write_mu);
    if (!write_all(g_sock, head, sizeof head) || !write_all(g_sock, body.data(), body.size())) _exit(0);
  }

  void Answer(const std::string& bytes) {
    grpc::Slice slice(bytes);
    reply_ = grpc::ByteBuffer(&slice, 1);
    StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void OnDone() override { delete this; }

 private:
  bool forward_;
  grpc::ByteBuffer request_, reply_;
};

class Service : public grpc::CallbackGenericService {
 public:
  explicit Service(bool forward) : forward_(forward) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new Call(forward_);
  }

 private:
  bool forward_;
};

// Replies from the Python process, each handed to the call it answers.
void read_replies() {
  for (;;) {
    char head[12];
    if (!read_all(g_sock, head, sizeof head)) _exit(0);
    uint64_t id;
    uint32_t n;
    std::memcpy(&id, head, 8);
    std::memcpy(&n, head + 8, 4);
    std::string body(n, '\0');
    if (!read_all(g_sock, body.data(), n)) _exit(0);
    Call* call = nullptr;
    {
      std::lock_guard<std::mutex> lock(g_pending_mu);
      auto it = g_pending.find(id);
      if (it != g_pending.end()) {
        call = it->second;
        g_pending.erase(it);
      }
    }
    if (call != nullptr) call->Answer(body);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 || (std::strcmp(argv[1], "echo") != 0 && std::strcmp(argv[1], "forward") != 0)) {
    std::fprintf(stderr, "usage: %s echo PORT REPLY_BYTES | forward PORT SOCKET_PATH\n", argv[0]);
    return 2;
  }
  bool forward = std::strcmp(argv[1], "forward") == 0;
  if (forward) {
    g_sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, argv[3], sizeof(addr.sun_path) - 1);
    if (::connect(g_sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      std::perror("connect");
      return 2;
    }
    std::thread(read_replies).detach();
  } else {
    g_reply.assign(static_cast<size_t>(std::atol(argv[3])), 'x');
  }
  Service service(forward);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(std::string("127.0.0.1:") + argv[2], grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "cannot listen on port %s\n", argv[2]);
    return 2;
  }
  std::cout << port << std::endl;
  server->Wait();
  return 0;
}
