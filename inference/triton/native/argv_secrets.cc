// Preloaded into tritonserver (LD_PRELOAD) so that its API keys never sit on its command line:
// /proc/PID/cmdline is readable by every local user (`ps`), /proc/PID/environ only by the owner.
// tritonserver 2.51 reads its restricted-API keys from its arguments only, so the launcher passes
// placeholders there and the keys in the environment. This library wraps main(): each argument's
// @@EMBEDCAR_SECRET_<n>@@ becomes the value of that environment variable in the argv main sees (a
// copy: the kernel's record of the command line keeps the placeholders), then those variables and
// LD_PRELOAD are removed, so the backend processes tritonserver starts inherit neither.
#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace {

using Main = int (*)(int, char**, char**);
using StartMain = int (*)(Main, int, char**, void (*)(), void (*)(), void (*)(), void*);

constexpr char kOpen[] = "@@EMBEDCAR_SECRET_";
constexpr char kClose[] = "@@";
Main real_main = nullptr;

[[noreturn]] void fail(const std::string& why) {
  std::fprintf(stderr, "embedcar argv_secrets: %s\n", why.c_str());
  std::_Exit(2);
}

std::string substitute(std::string arg) {
  for (size_t at = arg.find(kOpen); at != std::string::npos; at = arg.find(kOpen, at)) {
    size_t end = arg.find(kClose, at + 2);
    if (end == std::string::npos) fail("an unterminated placeholder in an argument");
    std::string name = arg.substr(at + 2, end - at - 2);
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) fail("no value for " + name + " in the environment");
    arg.replace(at, end + 2 - at, value);
    at += std::strlen(value);
  }
  return arg;
}

int wrapped_main(int argc, char** argv, char** /*envp*/) {
  static std::vector<std::string> args;  // lives as long as main: argv points into it
  static std::vector<char*> pointers;
  for (int i = 0; i < argc; ++i) args.push_back(substitute(argv[i]));
  for (auto& a : args) pointers.push_back(a.data());
  pointers.push_back(nullptr);
  std::vector<std::string> names;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, kOpen + 2, sizeof(kOpen) - 3) == 0) {
      names.emplace_back(*e, std::strcspn(*e, "="));
    }
  }
  for (const auto& n : names) unsetenv(n.c_str());
  unsetenv("LD_PRELOAD");
  return real_main(argc, pointers.data(), environ);
}

}  // namespace

extern "C" int __libc_start_main(Main main, int argc, char** argv, void (*init)(), void (*fini)(),
                                 void (*rtld_fini)(), void* stack_end) {
  auto next = reinterpret_cast<StartMain>(dlsym(RTLD_NEXT, "__libc_start_main"));
  if (next == nullptr) fail("no __libc_start_main to wrap");
  real_main = main;
  return next(wrapped_main, argc, argv, init, fini, rtld_fini, stack_end);
}
