// qtvm_run: run a qtvm artefact on a device with the TVM runtime only (no Python).
//
//   qtvm_run model.so --metadata                      print the artefact's metadata JSON
//   qtvm_run model.so NAME=in.npy ... [-o OUTDIR]     run main; save OUTDIR/<output>.npy
//
// Inputs are .npy files (little-endian, C order) named as the metadata names them; the
// VM runs on the CPU (a device part, e.g. OpenCL, needs a runtime built with it).
// Links against libtvm_ffi.so and libtvm_runtime.so; built by `qtvm bundle-runtime` or
// by the CMake project beside this file (CMakeLists.txt).
// Exit codes: 0 ok, 2 bad input (one line on stderr), 3 runtime failure.
// An artefact's weights are a blob beside the VM's module (qtvm/deploy/weights.py has its
// layout): copied once into tensors of their own and passed to main as the parameters that
// name them (qtvm_w<index>).
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/json.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace ffi = tvm::ffi;

namespace {

struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct CpuAlloc {
  void AllocData(DLTensor* t) {
    size_t bytes = (ffi::GetDataSize(*t) + 63) / 64 * 64;
    t->data = std::aligned_alloc(64, bytes ? bytes : 64);
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

struct NpyType {
  const char* descr;
  DLDataType dtype;
  const char* name;
};

const NpyType kTypes[] = {
    {"<f4", {kDLFloat, 32, 1}, "float32"}, {"<f2", {kDLFloat, 16, 1}, "float16"},
    {"<f8", {kDLFloat, 64, 1}, "float64"}, {"<i8", {kDLInt, 64, 1}, "int64"},
    {"<i4", {kDLInt, 32, 1}, "int32"},     {"<i2", {kDLInt, 16, 1}, "int16"},
    {"|i1", {kDLInt, 8, 1}, "int8"},       {"|u1", {kDLUInt, 8, 1}, "uint8"},
    {"|b1", {kDLBool, 8, 1}, "bool"},
};

const NpyType* TypeByName(const std::string& name) {
  for (const auto& t : kTypes)
    if (name == t.name) return &t;
  return nullptr;
}

const NpyType* TypeByDtype(DLDataType d) {
  for (const auto& t : kTypes)
    if (t.dtype.code == d.code && t.dtype.bits == d.bits && t.dtype.lanes == d.lanes) return &t;
  return nullptr;
}

std::string HeaderValue(const std::string& header, const std::string& key) {
  size_t at = header.find("'" + key + "'");
  if (at == std::string::npos) return "";
  at = header.find(':', at);
  size_t start = header.find_first_not_of(" ", at + 1);
  if (header[start] == '\'') return header.substr(start + 1, header.find('\'', start + 1) - start - 1);
  if (header[start] == '(') return header.substr(start + 1, header.find(')', start) - start - 1);
  return header.substr(start, header.find_first_of(",}", start) - start);
}

ffi::Tensor LoadNpy(const std::string& path, std::string* descr) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw BadInput("cannot open input file '" + path + "'");
  char magic[8];
  f.read(magic, 8);
  if (!f || std::memcmp(magic, "\x93NUMPY", 6) != 0) throw BadInput("'" + path + "' is not a .npy file");
  uint32_t header_len = 0;
  if (magic[6] == 1) {
    uint16_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 2);
    header_len = n;
  } else {
    f.read(reinterpret_cast<char*>(&header_len), 4);
  }
  std::string header(header_len, '\0');
  f.read(&header[0], header_len);
  if (HeaderValue(header, "fortran_order") != "False") throw BadInput("'" + path + "' is not in C order");
  *descr = HeaderValue(header, "descr");
  const NpyType* type = nullptr;
  for (const auto& t : kTypes)
    if (*descr == t.descr) type = &t;
  if (type == nullptr) throw BadInput("'" + path + "' has unsupported dtype " + *descr);
  std::vector<int64_t> shape;
  std::stringstream dims(HeaderValue(header, "shape"));
  for (std::string d; std::getline(dims, d, ',');)
    if (d.find_first_not_of(" ") != std::string::npos) shape.push_back(std::stoll(d));
  ffi::Tensor t = ffi::Tensor::FromNDAlloc(CpuAlloc(), ffi::ShapeView(shape.data(), shape.size()), type->dtype,
                                           DLDevice{kDLCPU, 0});
  size_t bytes = ffi::GetDataSize(*t.GetDLTensorPtr());
  f.read(static_cast<char*>(t.data_ptr()), bytes);
  if (static_cast<size_t>(f.gcount()) != bytes) throw BadInput("'" + path + "' is truncated");
  return t;
}

void SaveNpy(const std::string& path, const ffi::Tensor& t) {
  const DLTensor* dl = t.GetDLTensorPtr();
  const NpyType* type = TypeByDtype(dl->dtype);
  if (type == nullptr) throw std::runtime_error("output of unsupported dtype");
  std::string shape;
  for (int i = 0; i < dl->ndim; ++i) shape += std::to_string(dl->shape[i]) + (dl->ndim == 1 || i + 1 < dl->ndim ? "," : "");
  std::string header = "{'descr': '" + std::string(type->descr) + "', 'fortran_order': False, 'shape': (" + shape + "), }";
  header.append(64 - (10 + header.size() + 1) % 64, ' ');
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  uint16_t n = static_cast<uint16_t>(header.size());
  f.write("\x93NUMPY\x01\x00", 8);
  f.write(reinterpret_cast<const char*>(&n), 2);
  f << header;
  f.write(static_cast<const char*>(t.data_ptr()), ffi::GetDataSize(*dl));
  if (!f) throw std::runtime_error("cannot write '" + path + "'");
}

std::string Str(const ffi::Any& v) { return std::string(v.cast<ffi::String>()); }

// The CPU flags /proc/cpuinfo lists (x86 Linux); empty where there is no such line.
std::vector<std::string> CpuFlags() {
  std::ifstream f("/proc/cpuinfo");
  std::vector<std::string> flags;
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("flags", 0) != 0 || line.find(':') == std::string::npos) continue;
    std::stringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;) flags.push_back(w);
    break;
  }
  return flags;
}

// As qtvm.runtime does: refuse an artefact whose CPU features this CPU lacks (it would die of SIGILL).
void CheckCpuFlags(const ffi::Map<ffi::Any, ffi::Any>& meta, const std::string& model) {
  auto it = meta.find(ffi::String("required_cpu_flags"));
  if (it == meta.end()) return;
  std::vector<std::string> have = CpuFlags();
  if (have.empty()) return;  // not x86 Linux: nothing to compare with
  std::string missing;
  for (const ffi::Any& flag : (*it).second.cast<ffi::Array<ffi::Any>>()) {
    std::string f = Str(flag);
    bool found = false;
    for (const auto& h : have) found = found || h == f;
    if (!found) missing += (missing.empty() ? "" : ", ") + f;
  }
  if (!missing.empty())
    throw BadInput("'" + model + "' needs CPU features " + missing + " that this CPU lacks; recompile it with --target host");
}

// A table of the metadata ({dim: bound}); empty where the artefact has none.
ffi::Map<ffi::Any, ffi::Any> Table(const ffi::Map<ffi::Any, ffi::Any>& meta, const char* key) {
  auto it = meta.find(ffi::String(key));
  return it == meta.end() ? ffi::Map<ffi::Any, ffi::Any>() : (*it).second.cast<ffi::Map<ffi::Any, ffi::Any>>();
}

// As qtvm.runtime does for sizes of one symbol or none: a fixed size, at least 1 (0 where the
// dim may be empty: a KV cache's past), at least a convolution's window (dim_minimums), at
// most a position table's length (dim_limits). The VM would die of a negative or huge size.
void CheckDims(const std::string& name, const ffi::Array<ffi::Any>& dims, const ffi::Tensor& t,
               const ffi::Map<ffi::Any, ffi::Any>& meta) {
  auto limits = Table(meta, "dim_limits"), minimums = Table(meta, "dim_minimums");
  std::vector<std::string> zero;
  auto it = meta.find(ffi::String("may_be_zero"));
  if (it != meta.end())
    for (const ffi::Any& d : (*it).second.cast<ffi::Array<ffi::Any>>()) zero.push_back(Str(d));
  for (int i = 0; i < t.ndim(); ++i) {
    int64_t size = t.size(i);
    std::string at = "input '" + name + "' has size " + std::to_string(size) + " on axis " + std::to_string(i);
    if (auto fixed = dims[i].try_cast<int64_t>()) {
      if (*fixed != size) throw BadInput(at + ", expected " + std::to_string(*fixed));
      continue;
    }
    std::string dim = Str(dims[i]);
    bool may_be_zero = std::find(zero.begin(), zero.end(), dim) != zero.end();
    if (size < 1 && !(size == 0 && may_be_zero)) throw BadInput(at + " ('" + dim + "'); sizes must be >= 1");
    auto low = minimums.find(ffi::String(dim));
    if (low != minimums.end() && size < (*low).second.cast<int64_t>())
      throw BadInput(at + " ('" + dim + "'), but this model takes " + dim + " >= " +
                     std::to_string((*low).second.cast<int64_t>()) + " (a convolution over it would cover nothing); pad the input");
    auto top = limits.find(ffi::String(dim));
    if (top != limits.end() && size > (*top).second.cast<int64_t>())
      throw BadInput(at + " ('" + dim + "'), but this model takes " + dim + " <= " +
                     std::to_string((*top).second.cast<int64_t>()) + " (the length of its position tables)");
  }
}

// The weights blob (qtvm/deploy/weights.py), copied into tensors of their own; none where
// the artefact keeps its weights in the VM's constants.
std::vector<ffi::Tensor> LoadWeights(const std::string& model) {
  std::vector<ffi::Tensor> out;
  void* handle = dlopen(model.c_str(), RTLD_LAZY | RTLD_NOLOAD);  // the library TVM loaded
  const char* blob = handle ? static_cast<const char*>(dlsym(handle, "qtvm_weights")) : nullptr;
  if (blob == nullptr) return out;
  if (std::memcmp(blob, "QTVMWTS1", 8) != 0) throw BadInput("'" + model + "' has a damaged weights blob");
  uint64_t count, data_start;
  std::memcpy(&count, blob + 8, 8);
  std::memcpy(&data_start, blob + 16, 8);
  const char* rec = blob + 24;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t offset, nbytes;
    uint16_t lanes;
    uint32_t ndim;
    std::memcpy(&offset, rec, 8);
    std::memcpy(&nbytes, rec + 8, 8);
    DLDataType dtype{static_cast<uint8_t>(rec[16]), static_cast<uint8_t>(rec[17]), 0};
    std::memcpy(&lanes, rec + 18, 2);
    std::memcpy(&ndim, rec + 20, 4);
    dtype.lanes = lanes;
    std::vector<int64_t> dims(ndim);
    std::memcpy(dims.data(), rec + 24, 8 * ndim);
    rec += 24 + 8 * ndim;
    ffi::Tensor t = ffi::Tensor::FromNDAlloc(CpuAlloc(), ffi::Shape(dims), dtype, DLDevice{kDLCPU, 0});
#ifdef MADV_HUGEPAGE
    // 2 MiB pages where THP allows (a weight-streaming kernel reads them faster), advised before
    // the copy writes the memory so it faults in that way
    const uintptr_t huge = 2u << 20, at = reinterpret_cast<uintptr_t>(t.data_ptr());
    if ((at + nbytes) / huge > (at + huge - 1) / huge)
      madvise(reinterpret_cast<void*>((at + huge - 1) / huge * huge),
              (at + nbytes) / huge * huge - (at + huge - 1) / huge * huge, MADV_HUGEPAGE);
#endif
    const char* src = blob + data_start + offset;
    std::memcpy(t.data_ptr(), src, nbytes);
    uintptr_t lo = (reinterpret_cast<uintptr_t>(src) + page - 1) / page * page;
    uintptr_t hi = (reinterpret_cast<uintptr_t>(src) + nbytes) / page * page;
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);  // the library's copy
    out.push_back(t);
  }
  return out;
}

// ``args`` with the weights ``name`` takes appended (its parameters named qtvm_w<index>).
void AppendWeights(ffi::Module vm, const std::string& name, const std::vector<ffi::Tensor>& weights,
                   std::vector<ffi::Any>* args) {
  if (weights.empty()) return;
  int64_t arity = vm->GetFunction("get_function_arity").value()(name).cast<int64_t>();
  for (int64_t i = 0; i < arity; ++i) {
    std::string param = vm->GetFunction("get_function_param_name").value()(name, i).cast<ffi::String>();
    if (param.rfind("qtvm_w", 0) != 0 || param.size() == 6 ||
        param.find_first_not_of("0123456789", 6) != std::string::npos)
      continue;
    size_t index = std::stoul(param.substr(6));
    if (index >= weights.size()) throw BadInput("'" + name + "' takes a weight the artefact does not hold");
    args->push_back(weights[index]);
  }
}

int Run(int argc, char** argv) {
  if (argc < 2) throw BadInput("usage: qtvm_run model.so [--metadata] [NAME=in.npy ...] [-o OUTDIR]");
  std::string model = argv[1], out_dir = ".";
  bool print_metadata = false;
  std::map<std::string, std::string> feeds;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--metadata") {
      print_metadata = true;
    } else if (arg == "-o" && i + 1 < argc) {
      out_dir = argv[++i];
    } else if (arg.find('=') != std::string::npos) {
      feeds[arg.substr(0, arg.find('='))] = arg.substr(arg.find('=') + 1);
    } else {
      throw BadInput("argument '" + arg + "' is not NAME=file.npy, --metadata or -o OUTDIR");
    }
  }
  if (!std::ifstream(model)) throw BadInput("artefact '" + model + "' does not exist");
  if (model.find('/') == std::string::npos) model = "./" + model;  // dlopen searches the library path otherwise
  ffi::Module lib = ffi::Module::LoadFromFile(model);
  std::vector<ffi::Tensor> weights = LoadWeights(model);
  ffi::Module vm = lib->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
  vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, 2 /* pooled allocator */);
  auto meta_fn = vm->GetFunction("qtvm_metadata");
  if (!meta_fn.has_value()) throw BadInput("'" + model + "' has no qtvm metadata (not built by qtvm?)");
  ffi::Tensor raw = meta_fn.value()().cast<ffi::Tensor>();
  std::string text(static_cast<const char*>(raw.data_ptr()), raw.size(0));
  if (print_metadata) std::printf("%s\n", text.c_str());
  if (feeds.empty()) return 0;
  auto meta = ffi::json::Parse(text).cast<ffi::Map<ffi::Any, ffi::Any>>();
  CheckCpuFlags(meta, model);
  auto inputs = meta.at(ffi::String("inputs")).cast<ffi::Array<ffi::Any>>();
  auto outputs = meta.at(ffi::String("outputs")).cast<ffi::Array<ffi::Any>>();
  std::vector<ffi::Any> args;
  for (const ffi::Any& spec_any : inputs) {
    auto spec = spec_any.cast<ffi::Map<ffi::Any, ffi::Any>>();
    std::string name = Str(spec.at(ffi::String("name"))), dtype = Str(spec.at(ffi::String("dtype")));
    auto it = feeds.find(name);
    if (it == feeds.end()) throw BadInput("missing input '" + name + "'");
    std::string descr;
    ffi::Tensor t = LoadNpy(it->second, &descr);
    const NpyType* want = TypeByName(dtype);
    if (want == nullptr || descr != want->descr) throw BadInput("input '" + name + "' has dtype " + descr + ", expected " + dtype);
    auto dims = spec.at(ffi::String("shape")).cast<ffi::Array<ffi::Any>>();
    if (static_cast<int64_t>(dims.size()) != t.ndim()) throw BadInput("input '" + name + "' has the wrong rank");
    CheckDims(name, dims, t, meta);
    args.push_back(t);
    feeds.erase(it);
  }
  if (!feeds.empty()) throw BadInput("unknown input '" + feeds.begin()->first + "'");
  AppendWeights(vm, "main", weights, &args);
  std::vector<ffi::AnyView> views(args.begin(), args.end());
  ffi::Any result;
  vm->GetFunction("main").value().CallPacked(views.data(), static_cast<int32_t>(views.size()), &result);
  std::vector<ffi::Tensor> values;
  if (auto arr = result.try_cast<ffi::Array<ffi::Any>>()) {
    for (const ffi::Any& v : *arr) values.push_back(v.cast<ffi::Tensor>());
  } else {
    values.push_back(result.cast<ffi::Tensor>());
  }
  for (size_t i = 0; i < values.size() && i < outputs.size(); ++i) {
    std::string name = Str(outputs[i].cast<ffi::Map<ffi::Any, ffi::Any>>().at(ffi::String("name")));
    SaveNpy(out_dir + "/" + name + ".npy", values[i]);
    std::printf("%s: saved %s/%s.npy\n", name.c_str(), out_dir.c_str(), name.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const BadInput& e) {
    std::fprintf(stderr, "qtvm_run: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::string what = e.what();
    std::fprintf(stderr, "qtvm_run: runtime error: %s\n", what.substr(0, what.find('\n')).c_str());
    return 3;
  }
}
