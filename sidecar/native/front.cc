// embedcar_front: the sidecar's compiled gRPC front, a Python extension module on gRPC's C++ library
// (Debian's libgrpc++, callback API). It serves the Embedder's unary methods on a port of its own and
// hands each call to Python on the gRPC thread that took it, with the GIL: the request bytes, the
// x-api-key metadata, the time left before the caller's deadline, and a Call object whose reply()
// or fail() ends the call, from any thread, once. The handler either answers at once on this thread
// (sidecar/native_front.py: nothing queued, the model idle) or passes the Call to the event loop.
// Why: a grpc.aio call wakes gRPC's poller thread and then the event loop; this wakes one thread
// (docs/benchmarks.md, "A compiled gRPC front").
//
//   front = embedcar_front.Front(host, port, max_message_bytes, handler)  # handler(method, request,
//   front.port; front.stop(grace_s)                                       #   api_key, timeout_s, call)
//   call.reply(body: bytes); call.fail(code: int, message: str, retry_after: str | None = None)
//
// Methods other than those the handler serves are answered by the handler (it fails them).

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr char kApiKey[] = "x-api-key";
constexpr char kRetryAfter[] = "x-retry-after-s";  // sidecar/errors.py RETRY_AFTER_KEY

class Reactor;

// The Python side of one call: ends it once (reply or fail); a Call dropped unanswered fails it.
struct CallObject {
  PyObject_HEAD Reactor* reactor;  // null once answered
};

class Reactor : public grpc::ServerGenericBidiReactor {
 public:
  Reactor(grpc::GenericCallbackServerContext* ctx, PyObject* handler) : ctx_(ctx), handler_(handler) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override;

  // Called without the GIL.
  void Reply(std::string body) {
    grpc::Slice slice(body);
    reply_ = grpc::ByteBuffer(&slice, 1);
    StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void Fail(int code, std::string message, const std::string& retry_after) {
    if (!retry_after.empty()) ctx_->AddTrailingMetadata(kRetryAfter, retry_after);
    Finish(grpc::Status(static_cast<grpc::StatusCode>(code), std::move(message)));
  }

  void OnDone() override { delete this; }

 private:
  grpc::GenericCallbackServerContext* ctx_;
  PyObject* handler_;
  grpc::ByteBuffer request_, reply_;
};

// The call's reactor, taken once: null (and a RuntimeError set) if it was already answered.
Reactor* take(CallObject* self) {
  Reactor* reactor = self->reactor;
  self->reactor = nullptr;
  if (reactor == nullptr) PyErr_SetString(PyExc_RuntimeError, "this call was already answered");
  return reactor;
}

// Ends a call Python left unanswered (a bug on the Python side): never leave the caller hanging.
void fail_unanswered(CallObject* self, const char* message) {
  Reactor* reactor = self->reactor;
  self->reactor = nullptr;
  if (reactor != nullptr) reactor->Fail(static_cast<int>(grpc::StatusCode::INTERNAL), message, "");
}

PyObject* call_reply(PyObject* obj, PyObject* args) {
  const char* data = nullptr;
  Py_ssize_t size = 0;
  if (!PyArg_ParseTuple(args, "y#", &data, &size)) return nullptr;
  Reactor* reactor = take(reinterpret_cast<CallObject*>(obj));
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
  Reactor* reactor = take(reinterpret_cast<CallObject*>(obj));
  if (reactor == nullptr) return nullptr;
  std::string msg(message), retry(retry_after ? retry_after : "");
  Py_BEGIN_ALLOW_THREADS reactor->Fail(code, std::move(msg), retry);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

void call_dealloc(PyObject* obj) {
  fail_unanswered(reinterpret_cast<CallObject*>(obj), "the sidecar dropped this call unanswered");
  Py_TYPE(obj)->tp_free(obj);
}

PyMethodDef kCallMethods[] = {
    {"reply", call_reply, METH_VARARGS, "reply(body: bytes): end the call with OK and this message"},
    {"fail", call_fail, METH_VARARGS, "fail(code, message, retry_after=None): end the call with this status"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject kCallType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "embedcar_front.Call";
  t.tp_basicsize = sizeof(CallObject);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = "One gRPC call taken by the front: answer it once with reply() or fail().";
  t.tp_methods = kCallMethods;
  t.tp_dealloc = call_dealloc;
  return t;
}();

void Reactor::OnReadDone(bool ok) {
  if (!ok) {
    Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the call carried no request message"));
    return;
  }
  std::vector<grpc::Slice> slices;
  (void)request_.Dump(&slices);
  std::string body;
  for (const auto& s : slices) body.append(reinterpret_cast<const char*>(s.begin()), s.size());
  std::string key;
  bool has_key = false;
  for (const auto& [k, v] : ctx_->client_metadata()) {
    if (k == kApiKey) {
      key.assign(v.data(), v.size());
      has_key = true;
      break;
    }
  }
  double timeout_s = std::numeric_limits<double>::infinity();
  auto deadline = ctx_->deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) {
    timeout_s = std::chrono::duration<double>(deadline - std::chrono::system_clock::now()).count();
  }
  const std::string& method = ctx_->method();

  PyGILState_STATE gil = PyGILState_Ensure();
  auto* call = PyObject_New(CallObject, &kCallType);
  if (call == nullptr) {
    PyErr_Clear();
    PyGILState_Release(gil);
    Fail(static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED), "out of memory", "");
    return;
  }
  call->reactor = this;
  PyObject* py_key = has_key ? PyUnicode_DecodeUTF8(key.data(), static_cast<Py_ssize_t>(key.size()), "replace")
                             : (Py_INCREF(Py_None), Py_None);
  PyObject* result = PyObject_CallFunction(handler_, "s#y#OdO", method.data(), static_cast<Py_ssize_t>(method.size()),
                                           body.data(), static_cast<Py_ssize_t>(body.size()), py_key, timeout_s,
                                           reinterpret_cast<PyObject*>(call));
  Py_XDECREF(py_key);
  if (result == nullptr) {  // the handler raised: a bug, reported (no traceback kept), the call failed
    PyErr_WriteUnraisable(handler_);
    fail_unanswered(call, "the sidecar failed to take this call");
  }
  Py_XDECREF(result);
  Py_DECREF(reinterpret_cast<PyObject*>(call));  // unanswered and unreferenced: dealloc fails it
  PyGILState_Release(gil);
}

class Service : public grpc::CallbackGenericService {
 public:
  explicit Service(PyObject* handler) : handler_(handler) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    return new Reactor(ctx, handler_);
  }

 private:
  PyObject* handler_;
};

struct FrontObject {
  PyObject_HEAD PyObject* handler;
  Service* service;
  grpc::Server* server;
  int port;
};

int front_init(PyObject* obj, PyObject* args, PyObject*) {
  auto* self = reinterpret_cast<FrontObject*>(obj);
  const char* host = nullptr;
  int wanted = 0, max_message = 0;
  PyObject* handler = nullptr;
  if (!PyArg_ParseTuple(args, "siiO", &host, &wanted, &max_message, &handler)) return -1;
  if (!PyCallable_Check(handler)) {
    PyErr_SetString(PyExc_TypeError, "handler must be callable");
    return -1;
  }
  if (self->server != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "already serving");
    return -1;
  }
  Py_INCREF(handler);
  self->handler = handler;
  self->service = new Service(handler);
  std::string h(host);
  std::string address = (h.find(':') != std::string::npos ? "[" + h + "]" : h) + ":" + std::to_string(wanted);
  int port = 0;
  std::unique_ptr<grpc::Server> server;
  Py_BEGIN_ALLOW_THREADS grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(max_message);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterCallbackGenericService(self->service);
  server = builder.BuildAndStart();
  Py_END_ALLOW_THREADS if (!server || port == 0) {
    PyErr_Format(PyExc_OSError, "the compiled gRPC front cannot listen on %s", address.c_str());
    return -1;
  }
  self->server = server.release();
  self->port = port;
  return 0;
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
  }
  Py_XDECREF(self->handler);
  Py_TYPE(obj)->tp_free(obj);
}

PyMethodDef kFrontMethods[] = {
    {"stop", front_stop, METH_VARARGS, "stop(grace_s=0): refuse new calls, let running ones finish, stop"},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef kFrontGetSet[] = {{"port", front_port, nullptr, "the bound port", nullptr},
                              {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject kFrontType = [] {
  PyTypeObject t{PyVarObject_HEAD_INIT(nullptr, 0)};
  t.tp_name = "embedcar_front.Front";
  t.tp_basicsize = sizeof(FrontObject);
  t.tp_flags = Py_TPFLAGS_DEFAULT;
  t.tp_doc = "Front(host, port, max_message_bytes, handler): serve gRPC, each call to handler";
  t.tp_methods = kFrontMethods;
  t.tp_getset = kFrontGetSet;
  t.tp_init = front_init;
  t.tp_new = PyType_GenericNew;
  t.tp_dealloc = front_dealloc;
  return t;
}();

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "embedcar_front", "The sidecar's compiled gRPC front.", -1,
                       nullptr, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_embedcar_front() {
  if (PyType_Ready(&kCallType) < 0 || PyType_Ready(&kFrontType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  Py_INCREF(&kFrontType);
  Py_INCREF(&kCallType);
  if (PyModule_AddObject(m, "Front", reinterpret_cast<PyObject*>(&kFrontType)) < 0 ||
      PyModule_AddObject(m, "Call", reinterpret_cast<PyObject*>(&kCallType)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
