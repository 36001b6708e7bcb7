// A stand-in libhiprtc for CI machines without a GPU: the hiprtc C API implemented on
// amd_comgr, the code-object manager that ROCm's own libhiprtc compiles through.
//
// Why it exists: the only hiprtc on Debian 12 is the one inside HIP 5.2's libamdhip64, and
// that one compiles for "the current device" — with no GPU it reads a garbage ISA name and
// aborts the process. comgr itself needs no device, so this library gives op_tests/
// test_hiprtc.py a real device compile (comgr's LLVM, hiprtc's own pre-included runtime header
// from libhiprtc-builtins, -D__HIPCC_RTC__, no system headers) behind the exact API
// aiter_sage/hiprtc.py loads. It is test infrastructure, never shipped or used by the package.
//
// Build: g++ -std=c++17 -shared -fPIC comgr_hiprtc.cpp -o libhiprtc.so -lamd_comgr -ldl
#include <amd_comgr.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include <string>
#include <vector>

extern "C" {
typedef enum hiprtcResult {
  HIPRTC_SUCCESS = 0,
  HIPRTC_ERROR_OUT_OF_MEMORY = 1,
  HIPRTC_ERROR_PROGRAM_CREATION_FAILURE = 2,
  HIPRTC_ERROR_INVALID_INPUT = 3,
  HIPRTC_ERROR_INVALID_PROGRAM = 4,
  HIPRTC_ERROR_INVALID_OPTION = 5,
  HIPRTC_ERROR_COMPILATION = 6,
  HIPRTC_ERROR_INTERNAL_ERROR = 11,
} hiprtcResult;
}

namespace {
struct Program {
  std::string source, name, log;
  std::vector<std::pair<std::string, std::string>> headers;  // (include name, contents)
  std::vector<char> code;
};

// hiprtc's pre-included runtime header (what ROCm's hiprtc feeds clang as hiprtc_runtime.h).
bool runtime_header(std::string* out) {
  void* lib = dlopen("libhiprtc-builtins.so.5", RTLD_NOW | RTLD_LOCAL);
  if (!lib) lib = dlopen("libhiprtc-builtins.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return false;
  const char* text = static_cast<const char*>(dlsym(lib, "__hipRTC_header"));
  const uint64_t* size = static_cast<const uint64_t*>(dlsym(lib, "__hipRTC_header_size"));
  if (!text || !size) return false;
  out->assign(text, size_t(*size));
  return true;
}

bool add_data(amd_comgr_data_set_t set, amd_comgr_data_kind_t kind, const std::string& name,
              const std::string& bytes) {
  amd_comgr_data_t d;
  if (amd_comgr_create_data(kind, &d)) return false;
  bool ok = !amd_comgr_set_data(d, bytes.size(), bytes.data()) &&
            !amd_comgr_set_data_name(d, name.c_str()) && !amd_comgr_data_set_add(set, d);
  amd_comgr_release_data(d);
  return ok;
}

// Appends every LOG datum of `set` to `log`.
void collect_log(amd_comgr_data_set_t set, std::string* log) {
  size_t n = 0;
  if (amd_comgr_action_data_count(set, AMD_COMGR_DATA_KIND_LOG, &n)) return;
  for (size_t i = 0; i < n; ++i) {
    amd_comgr_data_t d;
    if (amd_comgr_action_data_get_data(set, AMD_COMGR_DATA_KIND_LOG, i, &d)) continue;
    size_t size = 0;
    amd_comgr_get_data(d, &size, nullptr);
    std::string text(size, '\0');
    amd_comgr_get_data(d, &size, &text[0]);
    *log += text;
    amd_comgr_release_data(d);
  }
}

// One comgr action from `in` to a fresh data set; its log is kept even on failure.
bool run_action(amd_comgr_action_kind_t kind, amd_comgr_action_info_t info, amd_comgr_data_set_t in,
                amd_comgr_data_set_t* out, std::string* log) {
  if (amd_comgr_create_data_set(out)) return false;
  amd_comgr_status_t st = amd_comgr_do_action(kind, info, in, *out);
  collect_log(*out, log);
  return st == AMD_COMGR_STATUS_SUCCESS;
}

hiprtcResult compile(Program* p, const std::vector<std::string>& options) {
  std::string isa;
  std::vector<std::string> clang_opts = {"-D__HIPCC_RTC__", "-nogpuinc", "-include",
                                         "hiprtc_runtime.h"};
  for (const std::string& o : options) {
    if (o.rfind("--offload-arch=", 0) == 0)
      isa = "amdgcn-amd-amdhsa--" + o.substr(strlen("--offload-arch="));
    else
      clang_opts.push_back(o);
  }
  if (isa.empty()) {
    p->log = "comgr_hiprtc: no --offload-arch= option (this stand-in has no device to ask)\n";
    return HIPRTC_ERROR_INVALID_OPTION;
  }
  std::string header;
  if (!runtime_header(&header)) {
    p->log = "comgr_hiprtc: libhiprtc-builtins (hiprtc's runtime header) not found\n";
    return HIPRTC_ERROR_INTERNAL_ERROR;
  }
  std::vector<const char*> argv;
  for (const std::string& o : clang_opts) argv.push_back(o.c_str());

  amd_comgr_data_set_t src, bc, linked, reloc, exe;
  amd_comgr_action_info_t info;
  amd_comgr_create_data_set(&src);
  amd_comgr_create_action_info(&info);
  amd_comgr_action_info_set_language(info, AMD_COMGR_LANGUAGE_HIP);
  if (amd_comgr_action_info_set_isa_name(info, isa.c_str())) {
    p->log = "comgr_hiprtc: this comgr does not know the ISA " + isa + "\n";
    amd_comgr_destroy_action_info(info);
    return HIPRTC_ERROR_INVALID_OPTION;
  }
  amd_comgr_action_info_set_logging(info, true);
  amd_comgr_action_info_set_option_list(info, argv.data(), argv.size());
  bool ok = add_data(src, AMD_COMGR_DATA_KIND_SOURCE, p->name, p->source) &&
            add_data(src, AMD_COMGR_DATA_KIND_INCLUDE, "hiprtc_runtime.h", header);
  for (const auto& h : p->headers)
    ok = ok && add_data(src, AMD_COMGR_DATA_KIND_INCLUDE, h.first, h.second);
  ok = ok && run_action(AMD_COMGR_ACTION_COMPILE_SOURCE_TO_BC, info, src, &bc, &p->log);
  // Kernels built for hiprtc use no device library, so the bitcode is linked alone.
  const char* no_opts[] = {"-O3"};
  if (ok) amd_comgr_action_info_set_option_list(info, no_opts, 1);
  ok = ok && run_action(AMD_COMGR_ACTION_LINK_BC_TO_BC, info, bc, &linked, &p->log);
  ok = ok && run_action(AMD_COMGR_ACTION_CODEGEN_BC_TO_RELOCATABLE, info, linked, &reloc, &p->log);
  ok =
      ok && run_action(AMD_COMGR_ACTION_LINK_RELOCATABLE_TO_EXECUTABLE, info, reloc, &exe, &p->log);
  if (ok) {
    amd_comgr_data_t d;
    size_t size = 0;
    ok = !amd_comgr_action_data_get_data(exe, AMD_COMGR_DATA_KIND_EXECUTABLE, 0, &d) &&
         !amd_comgr_get_data(d, &size, nullptr);
    if (ok) {
      p->code.resize(size);
      amd_comgr_get_data(d, &size, p->code.data());
      amd_comgr_release_data(d);
    }
  }
  amd_comgr_destroy_action_info(info);
  return ok ? HIPRTC_SUCCESS : HIPRTC_ERROR_COMPILATION;
}
}  // namespace

extern "C" {
__attribute__((visibility("default"))) hiprtcResult hiprtcVersion(int* major, int* minor) {
  size_t ma = 0, mi = 0;
  amd_comgr_get_version(&ma, &mi);
  *major = int(ma);
  *minor = int(mi);
  return HIPRTC_SUCCESS;
}

__attribute__((visibility("default"))) const char* hiprtcGetErrorString(hiprtcResult r) {
  return r == HIPRTC_SUCCESS             ? "HIPRTC_SUCCESS"
         : r == HIPRTC_ERROR_COMPILATION ? "HIPRTC_ERROR_COMPILATION"
                                         : "HIPRTC_ERROR (comgr_hiprtc stand-in)";
}

__attribute__((visibility("default"))) hiprtcResult
hiprtcCreateProgram(void** prog, const char* src, const char* name, int num_headers,
                    const char** headers, const char** include_names) {
  if (!prog || !src) return HIPRTC_ERROR_INVALID_INPUT;
  Program* p = new Program;
  p->source = src;
  p->name = name ? name : "source.hip";
  for (int i = 0; i < num_headers; ++i) p->headers.emplace_back(include_names[i], headers[i]);
  *prog = p;
  return HIPRTC_SUCCESS;
}

__attribute__((visibility("default"))) hiprtcResult hiprtcCompileProgram(void* prog, int n,
                                                                         const char** opts) {
  if (!prog) return HIPRTC_ERROR_INVALID_PROGRAM;
  std::vector<std::string> options(opts, opts + n);
  return compile(static_cast<Program*>(prog), options);
}

__attribute__((visibility("default"))) hiprtcResult hiprtcGetProgramLogSize(void* prog, size_t* n) {
  *n = static_cast<Program*>(prog)->log.size() + 1;
  return HIPRTC_SUCCESS;
}

__attribute__((visibility("default"))) hiprtcResult hiprtcGetProgramLog(void* prog, char* out) {
  const std::string& log = static_cast<Program*>(prog)->log;
  memcpy(out, log.c_str(), log.size() + 1);
  return HIPRTC_SUCCESS;
}

__attribute__((visibility("default"))) hiprtcResult hiprtcGetCodeSize(void* prog, size_t* n) {
  *n = static_cast<Program*>(prog)->code.size();
  return HIPRTC_SUCCESS;
}

__attribute__((visibility("default"))) hiprtcResult hiprtcGetCode(void* prog, char* out) {
  const std::vector<char>& code = static_cast<Program*>(prog)->code;
  memcpy(out, code.data(), code.size());
  return HIPRTC_SUCCESS;
}

__attribute__((visibility("default"))) hiprtcResult hiprtcDestroyProgram(void** prog) {
  delete static_cast<Program*>(*prog);
  *prog = nullptr;
  return HIPRTC_SUCCESS;
}
}
