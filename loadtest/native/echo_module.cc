// embedcar_echo: a Python extension module serving gRPC from C++ inside the Python process (Debian's
// libgrpc++, callback API), for `embedcar bench transport`'s `unary-native-inproc` row. Every unary
// call's request bytes go to a Python callable, run with the GIL on the gRPC thread that took the
// call (no event loop, no thread hand-off); what it returns (bytes) is the reply.
//
//   import embedcar_echo; port = embedcar_echo.serve(0, handler)   # handler(bytes) -> bytes
//
// One server per process; it runs until the process ends.

#define PY_SSIZE_T_CLEAN  // "y#" takes a Py_ssize_t length
#include <Python.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

namespace {

PyObject* g_handler = nullptr;

class Call : public grpc::ServerGenericBidiReactor {
 public:
  Call() { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
      return;
    }
    std::vector<grpc::Slice> slices;
    (void)request_.Dump(&slices);
    std::string body;
    for (const auto& s : slices) body.append(reinterpret_cast<const char*>(s.begin()), s.size());
    std::string out;
    bool failed = false;
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* result = PyObject_CallFunction(g_handler, "y#", body.data(), static_cast<Py_ssize_t>(body.size()));
    if (result != nullptr && PyBytes_Check(result)) {
      out.assign(PyBytes_AS_STRING(result), static_cast<size_t>(PyBytes_GET_SIZE(result)));
    } else {
      failed = true;
      if (PyErr_Occurred()) PyErr_Print();  // the bench's process shows why on its stderr
    }
    Py_XDECREF(result);
    PyGILState_Release(gil);
    if (failed) {
      Finish(grpc::Status(grpc::StatusCode::INTERNAL, "the handler did not return bytes"));
      return;
    }
    grpc::Slice slice(out);
    reply_ = grpc::ByteBuffer(&slice, 1);
    StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
  }

  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer request_, reply_;
};

class Service : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override { return new Call(); }
};

Service g_service;
std::unique_ptr<grpc::Server> g_server;

PyObject* serve(PyObject*, PyObject* args) {
  int wanted = 0;
  PyObject* handler = nullptr;
  if (!PyArg_ParseTuple(args, "iO", &wanted, &handler)) return nullptr;
  if (g_server) {
    PyErr_SetString(PyExc_RuntimeError, "already serving");
    return nullptr;
  }
  if (!PyCallable_Check(handler)) {
    PyErr_SetString(PyExc_TypeError, "handler must be callable");
    return nullptr;
  }
  Py_INCREF(handler);
  g_handler = handler;
  int port = 0;
  Py_BEGIN_ALLOW_THREADS
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(wanted), grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&g_service);
  g_server = builder.BuildAndStart();
  Py_END_ALLOW_THREADS
  if (!g_server || port == 0) {
    PyErr_SetString(PyExc_OSError, "cannot listen");
    return nullptr;
  }
  return PyLong_FromLong(port);
}

PyMethodDef kMethods[] = {
    {"serve", serve, METH_VARARGS, "serve(port, handler) -> bound port: answer every unary call with handler(bytes)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "embedcar_echo", nullptr, -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit_embedcar_echo() { return PyModule_Create(&kModule); }
