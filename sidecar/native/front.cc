// embedcar_front: the sidecar's compiled gRPC front, a Python extension module on gRPC's C++ library
// (Debian's libgrpc++, callback API). It serves the Embedder's unary methods on a port of its own and
// hands each call to Python on the gRPC thread that took it, with the GIL: the request bytes, the
// x-api-key metadata, the time left before the caller's deadline, and a Call object whose reply()
// or fail() ends the call, from any thread, once. The handler either answers at once on this thread
// (sidecar/native_front.py: nothing queued, the model idle) or passes the Call to the event loop.
// Why: a grpc.aio call wakes gRPC's poller thread and then the event loop; this wakes one thread
// (docs/benchmarks.md, "A compiled gRPC front").
//
//   front = embedcar_front.Front(address, max_message_bytes, handler, served=(), streamed=(), unix=None,
//                                key_pem=None, cert_pem=None, client_ca_pem=None, options=(), memory_bytes=0,
//                                max_owed=64)
//   handler(method, request, api_key, timeout_s, call); front.port; front.stop(grace_s)
//   front.set_serving(serving, service=None); front.shutdown_health()
//
// Each `streamed` method (a bidirectional stream) goes to the handler once as it opens (request None: it
// may refuse it) and then message by message, each time with the same StreamCall for the stream:
// stream.write(reply) once per message (in any order), stream.fail(code, message) ends it at once,
// stream.on_cancel(fn), stream.state (Python's). It ends OK once the caller has half-closed and every
// message has its reply. A stream stops reading while `max_owed` replies are owed or unsent.
//   call.reply(body: bytes); call.fail(code: int, message: str, retry_after: str | None = None)
//   call.on_cancel(fn)  # fn() when the caller cancels the call (a Python task answering it can stop)
//
// The `served` unary methods come through gRPC's unary callback API (the request read with the call).
// Health (Check, Watch) is gRPC's own default service, its status set from Python; any other method
// is UNIMPLEMENTED. A caller's metadata never goes into another call (only x-api-key reaches Python):
// gRPC's client side asserts on metadata its server side accepted. `options`: gRPC server arguments as
// (name, int | str) pairs (the limits: sidecar/grpc_server.py server_options); `memory_bytes` > 0: a
// resource quota for the server's buffers. `unix`: also listen on this Unix socket (plaintext);
// `key_pem`/`cert_pem`: TCP serves TLS, and with `client_ca_pem` only to clients presenting a
// certificate that CA signed.
//
// It is also a blocking client, for the backend calls the front's thread makes itself (the Triton
// backend's ModelInfer): the call polls its own completion queue on the calling thread, the GIL
// released, so no other thread wakes for it (a grpc.aio client call wakes the poller and the loop).
//
//   channel = embedcar_front.Channel(target, options, root_pem=None, key_pem=None, cert_pem=None)
//   code, details, reply = channel.call(method, request: bytes, timeout_s, metadata)  # reply None unless code 0
//
// `options`: gRPC channel arguments as (name, int | str) pairs; root_pem set = TLS.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>
#include <absl/synchronization/mutex.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr char kApiKey[] = "x-api-key";
constexpr char kRetryAfter[] = "x-retry-after-s";  // sidecar/errors.py RETRY_AFTER_KEY

// A Python type of this module; `init` set = constructible from Python (Call is made here only).
PyTypeObject type_of(const char* name, Py_ssize_t size, const char* doc, PyMethodDef* methods, destructor dealloc,
                     initproc init = nullptr, PyGetSetDef* getset = nullptr) {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = name;
  t.tp_basicsize = size;
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = doc;
  t.tp_methods = methods;
  t.tp_getset = getset;
  t.tp_dealloc = dealloc;
  t.tp_init = init;
  if (init != nullptr) t.tp_new = PyType_GenericNew;
  return t;
}

// Takes the GIL on a gRPC thread, keeping the thread's Python thread state between calls (one Ensure
// never released): without it every call creates and destroys one (its frame stack mapped and unmapped,
// thread-locals lost).
PyGILState_STATE enter_python() {
  PyGILState_STATE gil = PyGILState_Ensure();
  static thread_local bool pinned = false;
  if (!pinned) {
    (void)PyGILState_Ensure();
    pinned = true;
  }
  return gil;
}

void call_now(PyObject* fn) {
  PyObject* result = PyObject_CallNoArgs(fn);
  if (result == nullptr) PyErr_WriteUnraisable(fn);
  Py_XDECREF(result);
  Py_DECREF(fn);
}

// Python's callback for a caller's cancel: set before or after the cancel comes, called once (with
// the GIL, on a gRPC thread or at once).
class CancelHook {
 public:
  // With the GIL: false (a TypeError set) unless `fn` is callable.
  bool Set(PyObject* fn) {
    if (!PyCallable_Check(fn)) {
      PyErr_SetString(PyExc_TypeError, "on_cancel takes a callable");
      return false;
    }
    Py_INCREF(fn);
    if (fired_) {
      call_now(fn);
    } else {
      Py_XSETREF(fn_, fn);
    }
    return true;
  }
  // The caller has cancelled: on a gRPC thread, without the GIL.
  void Fire() {
    PyGILState_STATE gil = enter_python();
    fired_ = true;
    PyObject* fn = fn_;
    fn_ = nullptr;
    if (fn != nullptr) call_now(fn);
    PyGILState_Release(gil);
  }
  // The call is done (set before it was answered, so no other thread touches it now).
  void Clear() {
    if (fn_ == nullptr) return;
    PyGILState_STATE gil = enter_python();
    Py_CLEAR(fn_);
    PyGILState_Release(gil);
  }

 private:
  PyObject* fn_ = nullptr;  // guarded by the GIL
  bool fired_ = false;      // guarded by the GIL
};

class Unary;

std::string joined(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  (void)buffer.Dump(&slices);
  std::string out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// The Python side of one call: ends it once (reply or fail); a Call dropped unanswered fails it.
struct CallObject {
  PyObject_HEAD Unary* reactor;  // null once answered
};

// One unary call (Embed, Search): gRPC's unary callback API hands it over with its request already read,
// and takes the reply in the buffer it owns.
class Unary : public grpc::ServerUnaryReactor {
 public:
  Unary(grpc::CallbackServerContext* ctx, grpc::ByteBuffer* response) : ctx_(ctx), response_(response) {}

  // Called without the GIL.
  void Reply(std::string body) {
    grpc::Slice slice(body);
    *response_ = grpc::ByteBuffer(&slice, 1);
    Finish(grpc::Status::OK);
  }

  void Fail(int code, std::string message, const std::string& retry_after) {
    if (!retry_after.empty()) ctx_->AddTrailingMetadata(kRetryAfter, retry_after);
    Finish(grpc::Status(static_cast<grpc::StatusCode>(code), std::move(message)));
  }

  void OnCancel() override { on_cancel.Fire(); }
  void OnDone() override {
    on_cancel.Clear();
    delete this;
  }
  // OnCancel and OnDone run on the gRPC thread that learns of them instead of being handed to gRPC's
  // executor thread (one thread woken less per call): they take the GIL only for a hook Python set.
  bool InternalInlineable() override { return true; }

  CancelHook on_cancel;

 private:
  grpc::CallbackServerContext* ctx_;
  grpc::ByteBuffer* response_;
};

// The call's reactor, taken once: null (and a RuntimeError set) if it was already answered.
Unary* take(CallObject* self) {
  Unary* reactor = self->reactor;
  self->reactor = nullptr;
  if (reactor == nullptr) PyErr_SetString(PyExc_RuntimeError, "this call was already answered");
  return reactor;
}

// Ends a call Python left unanswered (a bug on the Python side): never leave the caller hanging.
void fail_unanswered(CallObject* self, const char* message) {
  Unary* reactor = self->reactor;
  self->reactor = nullptr;
  if (reactor != nullptr) reactor->Fail(static_cast<int>(grpc::StatusCode::INTERNAL), message, "");
}

PyObject* call_reply(PyObject* obj, PyObject* args) {
  const char* data = nullptr;
  Py_ssize_t size = 0;
  if (!PyArg_ParseTuple(args, "y#", &data, &size)) return nullptr;
  Unary* reactor = take(reinterpret_cast<CallObject*>(obj));
  if (reactor == nullptr) return nullptr;
  std::string body(data, static_cast<size_t>(size));
  Py_BEGIN_ALLOW_THREADS reactor->Reply(std::move(body));
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

PyObject* call_fail(PyObject* obj, PyObject* args) {
  int code = 0;
  const char* message = nullptr;
  const char* retry_after = nullptr;
  if (!PyArg_ParseTuple(args, "is|z", &code, &message, &retry_after)) return nullptr;
  if (code <= 0 || code > 16) {
    PyErr_SetString(PyExc_ValueError, "a failure's code is a gRPC status number 1-16");
    return nullptr;
  }
  Unary* reactor = take(reinterpret_cast<CallObject*>(obj));
  if (reactor == nullptr) return nullptr;
  std::string msg(message), retry(retry_after ? retry_after : "");
  Py_BEGIN_ALLOW_THREADS reactor->Fail(code, std::move(msg), retry);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

PyObject* call_on_cancel(PyObject* obj, PyObject* fn) {
  Unary* reactor = reinterpret_cast<CallObject*>(obj)->reactor;
  if (reactor == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "this call was already answered");
    return nullptr;
  }
  if (!reactor->on_cancel.Set(fn)) return nullptr;
  Py_RETURN_NONE;
}

void call_dealloc(PyObject* obj) {
  fail_unanswered(reinterpret_cast<CallObject*>(obj), "the sidecar dropped this call unanswered");
  Py_TYPE(obj)->tp_free(obj);
}

PyMethodDef kCallMethods[] = {
    {"reply", call_reply, METH_VARARGS, "reply(body: bytes): end the call with OK and this message"},
    {"fail", call_fail, METH_VARARGS, "fail(code, message, retry_after=None): end the call with this status"},
    {"on_cancel", call_on_cancel, METH_O,
     "on_cancel(fn): fn() on a gRPC thread when the caller cancels (at once if it has); before answering"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject kCallType = type_of("embedcar_front.Call", sizeof(CallObject),
                                 "One gRPC call taken by the front: answer it once with reply() or fail().",
                                 kCallMethods, call_dealloc);

// With the GIL: handler(method, body, api_key, timeout_s, call), body None for a stream's opening; false
// if it raised (a bug, reported without a traceback kept).
bool hand_to_python(PyObject* handler, grpc::CallbackServerContext* ctx, const std::string& method,
                    const std::string* body, PyObject* call) {
  PyObject* py_key = nullptr;
  for (const auto& [k, v] : ctx->client_metadata()) {
    if (k == kApiKey) {
      py_key = PyUnicode_DecodeUTF8(v.data(), static_cast<Py_ssize_t>(v.size()), "replace");
      break;
    }
  }
  if (py_key == nullptr) {
    PyErr_Clear();
    py_key = Py_NewRef(Py_None);
  }
  double timeout_s = std::numeric_limits<double>::infinity();
  auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    timeout_s = std::chrono::duration<double>(deadline - std::chrono::system_clock::now()).count();
  }
  PyObject* result =
      body == nullptr
          ? PyObject_CallFunction(handler, "s#OOdO", method.data(), static_cast<Py_ssize_t>(method.size()), Py_None,
                                  py_key, timeout_s, call)
          : PyObject_CallFunction(handler, "s#y#OdO", method.data(), static_cast<Py_ssize_t>(method.size()),
                                  body->data(), static_cast<Py_ssize_t>(body->size()), py_key, timeout_s, call);
  Py_DECREF(py_key);
  if (result == nullptr) {
    PyErr_WriteUnraisable(handler);
    return false;
  }
  Py_DECREF(result);
  return true;
}

// A unary call, handed to Python on the gRPC thread that took it.
grpc::ServerUnaryReactor* take_unary(PyObject* handler, const std::string& method, grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  auto* reactor = new Unary(ctx, response);
  std::string body = joined(*request);
  PyGILState_STATE gil = enter_python();
  auto* call = PyObject_New(CallObject, &kCallType);
  if (call == nullptr) {
    PyErr_Clear();
    PyGILState_Release(gil);
    reactor->Fail(static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED), "out of memory", "");
    return reactor;
  }
  call->reactor = reactor;
  if (!hand_to_python(handler, ctx, method, &body, reinterpret_cast<PyObject*>(call)))
    fail_unanswered(call, "the sidecar failed to take this call");
  Py_DECREF(reinterpret_cast<PyObject*>(call));  // unanswered and unreferenced: dealloc fails it
  PyGILState_Release(gil);
  return reactor;  // answered or not yet: gRPC keeps a Finish made before it has the reactor
}

// A Stream call served by the front: each message goes to the handler (with the same StreamCall object
// every time) as it arrives, the next read at once while fewer than `max_owed` replies are owed or unsent
// (past it the stream stops reading until replies go out: a caller that sends and never reads holds at
// most that many, and HTTP/2 flow control stops it sending); replies are written in the order Python
// gives them, one at a time. The call ends OK once the caller has stopped sending and every message has its reply,
// at once with the status Python gives (`fail`), or when the caller cancels or its deadline passes.
class Streamer;
struct StreamObject {
  PyObject_HEAD Streamer* streamer;  // null once the call is done (guarded by the GIL)
  PyObject* state;                   // Python's, per stream
};

class Streamer : public grpc::ServerGenericBidiReactor {
 public:
  Streamer(grpc::GenericCallbackServerContext* ctx, PyObject* handler, StreamObject* call, size_t max_owed)
      : ctx_(ctx), handler_(handler), call_(call), max_owed_(std::max<size_t>(max_owed, 1)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override {
    bool next = false, resume = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      if (!ok) broken_ = true;
      if (!broken_ && !ended_ && !queue_.empty()) {
        writing_ = next = true;
        reply_ = std::move(queue_.front());
        queue_.pop_front();
      }
      resume = ResumeLocked();
    }
    if (resume) StartRead(&request_);
    if (next) {
      StartWrite(&reply_);
    } else {
      MaybeFinish();
    }
  }
  void OnCancel() override;
  void OnDone() override;

  // With the GIL (never released here: the call stays alive meanwhile). One reply owed less.
  void Write(const char* data, size_t size) {
    grpc::Slice slice(data, size);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (owed_ > 0) --owed_;
      if (broken_ || ended_ || finished_) return;
      if (writing_) {
        queue_.emplace_back(&slice, 1);
        return;
      }
      writing_ = true;
      reply_ = grpc::ByteBuffer(&slice, 1);
    }
    StartWrite(&reply_);  // the backlog is unchanged (one owed became one unsent): no read to resume here
  }
  void End(grpc::Status status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ended_) return;
      ended_ = true;
      status_ = std::move(status);
      queue_.clear();
    }
    MaybeFinish();
  }

  CancelHook on_cancel;

 private:
  void MaybeFinish() {
    grpc::Status status;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ || writing_) return;
      bool drained = reads_done_ && owed_ == 0 && queue_.empty();
      if (!(ended_ || broken_ || caller_gone_ || drained)) return;
      finished_ = true;
      status = ended_ ? status_ : broken_ || caller_gone_ ? grpc::Status::CANCELLED : grpc::Status::OK;
    }
    Finish(status);
  }

  // Replies owed by Python or not yet written.
  size_t BacklogLocked() const { return owed_ + queue_.size() + (writing_ ? 1 : 0); }
  // Whether a paused stream reads again now (the caller then calls StartRead, outside the lock).
  bool ResumeLocked() {
    if (!paused_ || ended_ || broken_ || caller_gone_ || finished_ || BacklogLocked() >= max_owed_) return false;
    paused_ = false;
    return true;
  }

  grpc::GenericCallbackServerContext* ctx_;
  PyObject* handler_;
  StreamObject* call_;  // a reference held until OnDone
  const size_t max_owed_;
  grpc::ByteBuffer request_, reply_;
  std::mutex mu_;
  std::deque<grpc::ByteBuffer> queue_;
  grpc::Status status_;
  size_t owed_ = 0;
  bool writing_ = false, reads_done_ = false, ended_ = false, broken_ = false, caller_gone_ = false,
       finished_ = false, paused_ = false;
};

void Streamer::OnReadDone(bool ok) {
  bool take = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A stream that has ended (refused as it opened, failed by Python, left by its caller) takes no message.
    take = ok && !ended_ && !broken_ && !caller_gone_;
    if (take) {
      ++owed_;
    } else {
      reads_done_ = true;
    }
  }
  if (!take) {
    MaybeFinish();
    return;
  }
  std::string body = joined(request_);
  PyGILState_STATE gil = enter_python();
  if (!hand_to_python(handler_, ctx_, ctx_->method(), &body, reinterpret_cast<PyObject*>(call_)))
    End(grpc::Status(grpc::StatusCode::INTERNAL, "the sidecar failed to take a message of this stream"));
  PyGILState_Release(gil);
  bool more = false, paused = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    more = !ended_ && !broken_ && !caller_gone_;
    if (!more) {
      reads_done_ = true;
    } else if (BacklogLocked() >= max_owed_) {
      paused_ = paused = true;  // read again once replies have gone out (OnWriteDone)
      more = false;
    }
  }
  if (more) {
    StartRead(&request_);
  } else if (!paused) {
    MaybeFinish();
  }
}

void Streamer::OnCancel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    caller_gone_ = true;
  }
  on_cancel.Fire();
  MaybeFinish();
}

void Streamer::OnDone() {
  on_cancel.Clear();
  PyGILState_STATE gil = enter_python();
  call_->streamer = nullptr;  // Python may keep the object: its writes go nowhere now
  Py_DECREF(reinterpret_cast<PyObject*>(call_));
  PyGILState_Release(gil);
  delete this;
}

Streamer* live(PyObject* obj) {
  Streamer* streamer = reinterpret_cast<StreamObject*>(obj)->streamer;
  if (streamer == nullptr) PyErr_SetString(PyExc_RuntimeError, "this stream has ended");
  return streamer;
}

PyObject* stream_write(PyObject* obj, PyObject* args) {
  const char* data = nullptr;
  Py_ssize_t size = 0;
  if (!PyArg_ParseTuple(args, "y#", &data, &size)) return nullptr;
  Streamer* streamer = reinterpret_cast<StreamObject*>(obj)->streamer;
  if (streamer != nullptr) streamer->Write(data, static_cast<size_t>(size));  // else the caller is gone
  Py_RETURN_NONE;
}

PyObject* stream_fail(PyObject* obj, PyObject* args) {
  int code = 0;
  const char* message = nullptr;
  if (!PyArg_ParseTuple(args, "is", &code, &message)) return nullptr;
  if (code <= 0 || code > 16) {
    PyErr_SetString(PyExc_ValueError, "a failure's code is a gRPC status number 1-16");
    return nullptr;
  }
  Streamer* streamer = reinterpret_cast<StreamObject*>(obj)->streamer;
  if (streamer != nullptr) streamer->End(grpc::Status(static_cast<grpc::StatusCode>(code), message));
  Py_RETURN_NONE;
}

PyObject* stream_on_cancel(PyObject* obj, PyObject* fn) {
  Streamer* streamer = live(obj);
  if (streamer == nullptr || !streamer->on_cancel.Set(fn)) return nullptr;
  Py_RETURN_NONE;
}

PyObject* stream_get_state(PyObject* obj, void*) {
  PyObject* state = reinterpret_cast<StreamObject*>(obj)->state;
  return Py_NewRef(state != nullptr ? state : Py_None);
}

int stream_set_state(PyObject* obj, PyObject* value, void*) {
  Py_XINCREF(value);
  Py_XSETREF(reinterpret_cast<StreamObject*>(obj)->state, value);
  return 0;
}

void stream_dealloc(PyObject* obj) {
  Py_CLEAR(reinterpret_cast<StreamObject*>(obj)->state);
  Py_TYPE(obj)->tp_free(obj);
}

PyMethodDef kStreamMethods[] = {
    {"write", stream_write, METH_VARARGS, "write(reply: bytes): one message's reply (after earlier ones)"},
    {"fail", stream_fail, METH_VARARGS, "fail(code, message): end the stream with this status now"},
    {"on_cancel", stream_on_cancel, METH_O, "on_cancel(fn): fn() on a gRPC thread when the caller cancels"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef kStreamGetSet[] = {{"state", stream_get_state, stream_set_state, "Python's, per stream", nullptr},
                               {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject kStreamType = type_of("embedcar_front.StreamCall", sizeof(StreamObject),
                                   "One Stream call taken by the front: write() each message's reply.",
                                   kStreamMethods, stream_dealloc, nullptr, kStreamGetSet);

// Ends a call at once with `status` (a Stream the front cannot take).
class Refused : public grpc::ServerGenericBidiReactor {
 public:
  explicit Refused(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// A Streamer with its Python object (made here, with the GIL).
grpc::ServerGenericBidiReactor* new_streamer(grpc::GenericCallbackServerContext* ctx, PyObject* handler,
                                             size_t max_owed) {
  PyGILState_STATE gil = enter_python();
  auto* call = PyObject_New(StreamObject, &kStreamType);
  if (call == nullptr) {
    PyErr_Clear();
    PyGILState_Release(gil);
    return new Refused(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "out of memory"));
  }
  call->state = nullptr;
  auto* streamer = new Streamer(ctx, handler, call, max_owed);
  call->streamer = streamer;
  // The stream's opening (no message: None) goes to Python first, which may refuse it (a wrong key)
  // before any message is read: gRPC keeps a Finish made before it has the reactor.
  if (!hand_to_python(handler, ctx, ctx->method(), nullptr, reinterpret_cast<PyObject*>(call)))
    streamer->End(grpc::Status(grpc::StatusCode::INTERNAL, "the sidecar failed to take this stream"));
  PyGILState_Release(gil);
  return streamer;
}

// The unary methods the front serves itself, each through gRPC's unary callback API (raw bytes both ways).
class Unaries : public grpc::Service {
 public:
  Unaries(PyObject* handler, const std::vector<std::string>& methods) : names_(methods.begin(), methods.end()) {
    int index = 0;
    for (const std::string& name : names_) {  // a deque: each name stays where the method points to it
      AddMethod(new grpc::internal::RpcServiceMethod(name.c_str(), grpc::internal::RpcMethod::NORMAL_RPC, nullptr));
      MarkMethodRawCallback(index++, new grpc::internal::CallbackUnaryHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                                         [handler, &name](grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
                                           return take_unary(handler, name, ctx, request, response);
                                         }));
    }
  }

 private:
  std::deque<std::string> names_;
};

// Every other method: a `streamed` one, else UNIMPLEMENTED (health is gRPC's own service, registered
// apart). Nothing of a caller's call is passed on to another call: its metadata reaches only Python.
class Service : public grpc::CallbackGenericService {
 public:
  Service(PyObject* handler, std::vector<std::string> streamed, size_t max_owed)
      : handler_(handler), streamed_(std::move(streamed)), max_owed_(max_owed) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    if (std::find(streamed_.begin(), streamed_.end(), ctx->method()) != streamed_.end())
      return new_streamer(ctx, handler_, max_owed_);
    return new Refused(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this method is not served here"));
  }

 private:
  PyObject* handler_;
  std::vector<std::string> streamed_;
  size_t max_owed_;
};

// Reads a str or bytes argument that may be None; false (an error set) for anything else.
bool optional_text(PyObject* value, const char* what, std::string* out, bool* given) {
  *given = value != nullptr && value != Py_None;
  if (!*given) return true;
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_Check(value)) {
    if (PyBytes_AsStringAndSize(value, &data, &size) < 0) return false;
  } else if (PyUnicode_Check(value)) {
    const char* utf8 = PyUnicode_AsUTF8AndSize(value, &size);
    if (utf8 == nullptr) return false;
    data = const_cast<char*>(utf8);
  } else {
    PyErr_Format(PyExc_TypeError, "%s must be bytes, str or None", what);
    return false;
  }
  out->assign(data, static_cast<size_t>(size));
  return true;
}

// Reads a sequence of str into `out`; false (an error set) otherwise.
bool names_of(PyObject* value, const char* what, std::vector<std::string>* out) {
  if (value == nullptr || value == Py_None) return true;
  PyObject* seq = PySequence_Fast(value, what);
  if (seq == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char* name = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
    if (name == nullptr) {
      Py_DECREF(seq);
      return false;
    }
    out->emplace_back(name);
  }
  Py_DECREF(seq);
  return true;
}

// Sets gRPC channel arguments from (name, int | str) pairs; false (an error set) otherwise.
bool channel_arguments(PyObject* options, grpc::ChannelArguments* arguments) {
  if (options == nullptr || options == Py_None) return true;
  PyObject* seq = PySequence_Fast(options, "options must be a sequence of (name, value) pairs");
  if (seq == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char* name = nullptr;
    PyObject* value = nullptr;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "sO", &name, &value)) {
      Py_DECREF(seq);
      return false;
    }
    if (PyLong_Check(value)) {
      long number = PyLong_AsLong(value);
      if (number > std::numeric_limits<int>::max() || number < std::numeric_limits<int>::min()) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "option %s is out of range for an int", name);
        return false;
      }
      arguments->SetInt(name, static_cast<int>(number));
    } else if (PyUnicode_Check(value)) {
      arguments->SetString(name, PyUnicode_AsUTF8(value));
    } else {
      Py_DECREF(seq);
      PyErr_Format(PyExc_TypeError, "option %s must be an int or a str", name);
      return false;
    }
  }
  Py_DECREF(seq);
  return true;
}

// Carries channel arguments into a ServerBuilder (which takes them one by one).
class ArgumentsOption : public grpc::ServerBuilderOption {
 public:
  explicit ArgumentsOption(grpc::ChannelArguments arguments) : arguments_(std::move(arguments)) {}
  void UpdateArguments(grpc::ChannelArguments* args) override {
    grpc_channel_args c = arguments_.c_channel_args();
    for (size_t i = 0; i < c.num_args; ++i) {
      const grpc_arg& arg = c.args[i];
      if (arg.type == GRPC_ARG_INTEGER) args->SetInt(arg.key, arg.value.integer);
      if (arg.type == GRPC_ARG_STRING) args->SetString(arg.key, arg.value.string);
    }
  }
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>*) override {}

 private:
  grpc::ChannelArguments arguments_;
};

struct FrontObject {
  PyObject_HEAD PyObject* handler;
  Unaries* unaries;
  Service* service;
  grpc::Server* server;
  int port;
};

int front_init(PyObject* obj, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<FrontObject*>(obj);
  static const char* kwlist[] = {"address", "max_message_bytes", "handler", "served", "streamed", "unix", "key_pem",
                                 "cert_pem", "client_ca_pem", "options", "memory_bytes", "max_owed", nullptr};
  const char* address = nullptr;
  int max_message = 0;
  long long memory_bytes = 0;
  Py_ssize_t max_owed = 64;
  PyObject *handler = nullptr, *served = nullptr, *streamed = nullptr, *unix = nullptr, *options = nullptr;
  PyObject *key = nullptr, *cert = nullptr, *client_ca = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "siO|OOOOOOOLn", const_cast<char**>(kwlist), &address,
                                   &max_message, &handler, &served, &streamed, &unix, &key, &cert, &client_ca,
                                   &options, &memory_bytes, &max_owed))
    return -1;
  if (!PyCallable_Check(handler)) {
    PyErr_SetString(PyExc_TypeError, "handler must be callable");
    return -1;
  }
  if (self->server != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "already serving");
    return -1;
  }
  if (max_owed < 1 || memory_bytes < 0) {
    PyErr_SetString(PyExc_ValueError, "max_owed must be >= 1 and memory_bytes >= 0");
    return -1;
  }
  std::vector<std::string> methods, stream_methods;
  grpc::ChannelArguments arguments;
  if (!names_of(served, "served must be a sequence of method names", &methods) ||
      !names_of(streamed, "streamed must be a sequence of method names", &stream_methods) ||
      !channel_arguments(options, &arguments))
    return -1;
  std::string unix_path;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  std::string ca;
  bool has_unix = false, has_key = false, has_cert = false, has_ca = false;
  if (!optional_text(unix, "unix", &unix_path, &has_unix) ||
      !optional_text(key, "key_pem", &pair.private_key, &has_key) ||
      !optional_text(cert, "cert_pem", &pair.cert_chain, &has_cert) ||
      !optional_text(client_ca, "client_ca_pem", &ca, &has_ca))
    return -1;
  if (has_key != has_cert || (has_ca && !has_key)) {
    PyErr_SetString(PyExc_ValueError, "TLS needs key_pem and cert_pem together (client_ca_pem only with them)");
    return -1;
  }
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (has_key) {
    grpc::SslServerCredentialsOptions tls(has_ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                 : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    tls.pem_root_certs = ca;
    tls.pem_key_cert_pairs.push_back(pair);
    credentials = grpc::SslServerCredentials(tls);
  }
  Py_INCREF(handler);
  self->handler = handler;
  for (const std::string& m : stream_methods) methods.erase(std::remove(methods.begin(), methods.end(), m), methods.end());
  self->unaries = new Unaries(handler, methods);
  self->service = new Service(handler, std::move(stream_methods), static_cast<size_t>(max_owed));
  std::string where(address);
  int port = 0;
  std::unique_ptr<grpc::Server> server;
  Py_BEGIN_ALLOW_THREADS grpc::ServerBuilder builder;
  builder.AddListeningPort(where, credentials, &port);
  if (has_unix) builder.AddListeningPort("unix:" + unix_path, grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(max_message);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetOption(std::make_unique<ArgumentsOption>(arguments));
  if (memory_bytes > 0) {  // what gRPC may hold in buffers for all connections together
    grpc::ResourceQuota quota("embedcar-front");
    quota.Resize(static_cast<size_t>(memory_bytes));
    builder.SetResourceQuota(quota);
  }
  if (!methods.empty()) builder.RegisterService(self->unaries);
  builder.RegisterCallbackGenericService(self->service);
  // gRPC's own health service (Check and Watch, no key: probes carry none), its status set by the
  // sidecar (set_serving). The switch is process-wide and read at BuildAndStart only.
  bool health_was = grpc::DefaultHealthCheckServiceEnabled();
  grpc::EnableDefaultHealthCheckService(true);
  server = builder.BuildAndStart();
  grpc::EnableDefaultHealthCheckService(health_was);
  if (server) {
    grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
    if (health != nullptr) health->SetServingStatus(false);  // NOT_SERVING until the sidecar says
  }
  Py_END_ALLOW_THREADS if (!server || port == 0) {
    PyErr_Format(PyExc_OSError, "the compiled gRPC front cannot listen on %s%s%s", where.c_str(),
                 has_unix ? " and unix:" : "", has_unix ? unix_path.c_str() : "");
    return -1;
  }
  self->server = server.release();
  self->port = port;
  return 0;
}

// set_serving(serving, service=None): the health status of `service` ("" = the server), or of all.
PyObject* front_set_serving(PyObject* obj, PyObject* args) {
  auto* self = reinterpret_cast<FrontObject*>(obj);
  int serving = 0;
  const char* service = nullptr;
  if (!PyArg_ParseTuple(args, "p|z", &serving, &service)) return nullptr;
  grpc::HealthCheckServiceInterface* health = self->server ? self->server->GetHealthCheckService() : nullptr;
  if (health != nullptr) {
    if (service == nullptr) {
      health->SetServingStatus(serving != 0);
    } else {
      health->SetServingStatus(service, serving != 0);
    }
  }
  Py_RETURN_NONE;
}

// shutdown_health(): every service NOT_SERVING from now on, later set_serving calls ignored (a stop).
PyObject* front_shutdown_health(PyObject* obj, PyObject*) {
  auto* self = reinterpret_cast<FrontObject*>(obj);
  grpc::HealthCheckServiceInterface* health = self->server ? self->server->GetHealthCheckService() : nullptr;
  if (health != nullptr) health->Shutdown();
  Py_RETURN_NONE;
}

PyObject* front_stop(PyObject* obj, PyObject* args) {
  auto* self = reinterpret_cast<FrontObject*>(obj);
  double grace_s = 0;
  if (!PyArg_ParseTuple(args, "|d", &grace_s)) return nullptr;
  grpc::Server* server = self->server;
  if (server != nullptr) {
    // Without the GIL: calls still running need it to answer within the grace period.
    Py_BEGIN_ALLOW_THREADS server->Shutdown(std::chrono::system_clock::now() +
                                            std::chrono::microseconds(static_cast<int64_t>(grace_s * 1e6)));
    server->Wait();
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

PyObject* front_port(PyObject* obj, void*) { return PyLong_FromLong(reinterpret_cast<FrontObject*>(obj)->port); }

void front_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<FrontObject*>(obj);
  if (self->server != nullptr) {
    Py_BEGIN_ALLOW_THREADS self->server->Shutdown(std::chrono::system_clock::now());
    self->server->Wait();
    Py_END_ALLOW_THREADS delete self->server;
    delete self->service;
    delete self->unaries;
  }
  Py_XDECREF(self->handler);
  Py_TYPE(obj)->tp_free(obj);
}

PyMethodDef kFrontMethods[] = {
    {"stop", front_stop, METH_VARARGS, "stop(grace_s=0): refuse new calls, let running ones finish, stop"},
    {"set_serving", front_set_serving, METH_VARARGS,
     "set_serving(serving, service=None): the health status of one service (\"\" = the server) or of all"},
    {"shutdown_health", front_shutdown_health, METH_NOARGS,
     "shutdown_health(): NOT_SERVING for good (later set_serving calls are ignored)"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef kFrontGetSet[] = {{"port", front_port, nullptr, "the bound port", nullptr},
                              {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject kFrontType = type_of("embedcar_front.Front", sizeof(FrontObject),
                                  "Front(address, max_message_bytes, handler, served=(), streamed=(), unix=None, key_pem=None, "
                                  "cert_pem=None, client_ca_pem=None, options=(), memory_bytes=0, max_owed=64): "
                                  "serve gRPC",
                                  kFrontMethods, front_dealloc, front_init, kFrontGetSet);

// --- the blocking client ------------------------------------------------------------------------
struct ChannelObject {
  PyObject_HEAD std::shared_ptr<grpc::Channel>* channel;
  grpc::GenericStub* stub;
};

int channel_init(PyObject* obj, PyObject* args, PyObject*) {
  auto* self = reinterpret_cast<ChannelObject*>(obj);
  const char* target = nullptr;
  PyObject *options = nullptr, *root = nullptr, *key = nullptr, *cert = nullptr;
  if (!PyArg_ParseTuple(args, "sO|OOO", &target, &options, &root, &key, &cert)) return -1;
  if (self->channel != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "already open");
    return -1;
  }
  grpc::ChannelArguments arguments;
  if (!channel_arguments(options, &arguments)) return -1;
  grpc::SslCredentialsOptions tls;
  bool has_root = false, has_key = false, has_cert = false;
  if (!optional_text(root, "root_pem", &tls.pem_root_certs, &has_root) ||
      !optional_text(key, "key_pem", &tls.pem_private_key, &has_key) ||
      !optional_text(cert, "cert_pem", &tls.pem_cert_chain, &has_cert))
    return -1;
  auto credentials = has_root ? grpc::SslCredentials(tls) : grpc::InsecureChannelCredentials();
  self->channel = new std::shared_ptr<grpc::Channel>(grpc::CreateCustomChannel(target, credentials, arguments));
  self->stub = new grpc::GenericStub(*self->channel);
  return 0;
}

PyObject* channel_call(PyObject* obj, PyObject* args) {
  auto* self = reinterpret_cast<ChannelObject*>(obj);
  const char* method = nullptr;
  const char* data = nullptr;
  Py_ssize_t size = 0;
  double timeout_s = 0;
  PyObject* metadata = nullptr;
  if (!PyArg_ParseTuple(args, "sy#dO", &method, &data, &size, &timeout_s, &metadata)) return nullptr;
  if (self->stub == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "the channel is not open");
    return nullptr;
  }
  std::vector<std::pair<std::string, std::string>> headers;
  PyObject* seq = PySequence_Fast(metadata, "metadata must be a sequence of (key, value) pairs");
  if (seq == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char *k = nullptr, *v = nullptr;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ss", &k, &v)) {
      Py_DECREF(seq);
      return nullptr;
    }
    headers.emplace_back(k, v);
  }
  Py_DECREF(seq);
  std::string name(method);
  grpc::Slice slice(data, static_cast<size_t>(size));  // copied: the bytes are Python's
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::Status status;
  Py_BEGIN_ALLOW_THREADS grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::microseconds(static_cast<int64_t>(std::max(timeout_s, 0.0) * 1e6)));
  for (const auto& [k, v] : headers) context.AddMetadata(k, v);
  grpc::CompletionQueue queue;  // this call's own: polled here, by the calling thread
  {
    auto rpc = self->stub->PrepareUnaryCall(&context, name, request, &queue);
    rpc->StartCall();
    rpc->Finish(&response, &status, &queue);
    void* tag = nullptr;
    bool ok = false;
    (void)queue.Next(&tag, &ok);
  }
  queue.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (queue.Next(&tag, &ok)) {
  }
  Py_END_ALLOW_THREADS if (!status.ok()) {
    const std::string& details = status.error_message();
    return Py_BuildValue("is#O", static_cast<int>(status.error_code()), details.data(),
                         static_cast<Py_ssize_t>(details.size()), Py_None);
  }
  std::string body = joined(response);
  return Py_BuildValue("isy#", 0, "", body.data(), static_cast<Py_ssize_t>(body.size()));
}

void channel_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<ChannelObject*>(obj);
  delete self->stub;
  delete self->channel;
  Py_TYPE(obj)->tp_free(obj);
}

PyMethodDef kChannelMethods[] = {
    {"call", channel_call, METH_VARARGS,
     "call(method, request, timeout_s, metadata) -> (code, details, reply): one unary call, waiting for it"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject kChannelType = type_of(
    "embedcar_front.Channel", sizeof(ChannelObject),
    "Channel(target, options, root_pem=None, key_pem=None, cert_pem=None): a blocking gRPC client", kChannelMethods,
    channel_dealloc, channel_init);

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "embedcar_front", "The sidecar's compiled gRPC front.", -1,
                       nullptr, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_embedcar_front() {
  // Debian builds Abseil without NDEBUG, so every absl::Mutex gRPC takes also tracks lock order for
  // deadlock reports (a global graph): a debugging aid release builds leave off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const std::pair<const char*, PyTypeObject*> types[] = {
      {"Front", &kFrontType}, {"Call", &kCallType}, {"StreamCall", &kStreamType}, {"Channel", &kChannelType}};
  for (const auto& [name, type] : types)
    if (PyType_Ready(type) < 0) return nullptr;
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  for (const auto& [name, type] : types) {
    Py_INCREF(type);
    if (PyModule_AddObject(m, name, reinterpret_cast<PyObject*>(type)) < 0) {
      Py_DECREF(type);
      Py_DECREF(m);
      return nullptr;
    }
  }
  return m;
}
