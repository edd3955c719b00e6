// commcheck's DDP comm hook in C++ (commcheck/native/ddphook.py builds it; commcheck/rank/ddp.py
// registers it): per gradient bucket, what the Python hook records as `ddp_allreduce`, with
// no Python on the bucket's path but one call that hands out the record's key.
//
// runHook, on the reducer's thread: divide by the group size (DDP's default numerics, as
// torch's built-in ALLREDUCE hook), take the key from Python (`begin()`: the ring, the
// group's next seq, the step, the call site; None: record nothing), write the entry record
// (a rank that hangs in the all-reduce leaves it), fingerprint the input, then launch the
// SUM all-reduce. Its future's C++ `then` fingerprints the output and writes the completion
// record. Records go through ccapi.h (commcheck/native/hot.c), field for field what
// commcheck/rank/session.py writes for the same bucket.
//
// Whatever this path does not cover (a user's hook holding commcheck's slot, CUDA or sparse
// buckets, dtypes the fingerprint kernel does not take) goes to the slot's Python dispatch,
// through torch's own PythonCommHook: the same hook commcheck registers without this file.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ccapi.h"

namespace {

// commcheck/native/loader.py: FP_CODES, with the names torch prints (commcheck's dtype field)
struct DtypeCode {
  at::ScalarType type;
  int code;
  const char* name;
};
constexpr DtypeCode kDtypes[] = {
    {at::kFloat, 0, "float32"}, {at::kDouble, 1, "float64"}, {at::kHalf, 2, "float16"},
    {at::kBFloat16, 3, "bfloat16"}, {at::kChar, 4, "int8"}, {at::kByte, 5, "uint8"},
    {at::kShort, 6, "int16"}, {at::kInt, 7, "int32"}, {at::kLong, 8, "int64"},
    {at::kBool, 9, "bool"},
};

const DtypeCode* dtype_of(const at::Tensor& t) {
  for (const auto& d : kDtypes)
    if (d.type == t.scalar_type()) return &d;
  return nullptr;
}

cc_str str(const std::string& s) { return cc_str{s.data(), s.size()}; }

// What Python may read and switch: the native path on or off (off: every bucket goes to the
// slot's Python dispatch), and what the hook counted.
struct Control {
  std::atomic<bool> native{true};
  std::atomic<int64_t> buckets{0};   // buckets recorded natively
  std::atomic<int64_t> errors{0};    // internal errors (training unaffected)
  std::atomic<int64_t> dropped{0};   // records the ring refused (full or too big)
  std::mutex mu;
  std::string last_error;

  void fail(const std::string& what) {
    if (errors.fetch_add(1) == 0) {
      std::lock_guard<std::mutex> lock(mu);
      last_error = what;
    }
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu);
    return last_error;
  }
};

// Fixed per model: the record's key and which fingerprints to take.
struct Static {
  const cc_api* api;
  std::string group_name, op, redop, algo;
  std::vector<int64_t> ranks;
  bool hash_in, summary_in, hash_out, summary_out;
  std::shared_ptr<Control> ctl;
};

// One bucket in flight. `ring` is a strong reference to the ring's capsule, taken and
// dropped with the GIL held.
struct Pending {
  PyObject* ring = nullptr;
  void* handle = nullptr;
  int64_t seq = 0, step = 0, flags = 0;
  std::string callsite;
  const DtypeCode* dtype = nullptr;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  double t_enter = 0.0;
  uint64_t in_hash[2] = {0, 0};
  cc_summary in_summary = {0.0, 0.0, 0, 0};
  at::Tensor buffer;
};

cc_record base_record(const Static& s, const Pending& p) {
  cc_record r;
  std::memset(&r, 0, sizeof r);
  r.group_name = str(s.group_name);
  r.group_ranks = cc_ints{s.ranks.data(), s.ranks.size()};
  r.seq = p.seq;
  r.op = str(s.op);
  r.dtype = cc_str{p.dtype->name, std::strlen(p.dtype->name)};
  r.redop = str(s.redop);
  r.callsite = str(p.callsite);
  r.root = CC_NO_ROOT;
  r.peer = CC_NO_ROOT;
  r.numel_in = r.numel_out = p.numel;
  r.in_shape = r.out_shape = cc_ints{p.shape.data(), p.shape.size()};
  r.step = p.step;
  r.t_enter = p.t_enter;
  return r;
}

void put(const Static& s, const Pending& p, const cc_record& r) {
  int rc = s.api->put_record(p.handle, &r);
  if (rc == CC_PUT_FULL || rc == CC_PUT_TOO_BIG) s.ctl->dropped.fetch_add(1);
}

// fingerprint of the bucket into (hash, summary); false (counted) if the kernel refused
bool fingerprint(const Static& s, const Pending& p, bool hash, bool summary, uint64_t* h,
                 cc_summary* sm) {
  uint64_t out[6];
  const at::Tensor& t = p.buffer;
  int rc = s.api->fingerprint(t.data_ptr(), static_cast<size_t>(t.numel()), t.nbytes(),
                              p.dtype->code, hash, summary, out);
  if (rc != 0) {
    s.ctl->fail("fingerprint kernel failed (" + std::to_string(rc) + ")");
    return false;
  }
  std::memcpy(&sm->sum, &out[0], 8);
  std::memcpy(&sm->absmax, &out[1], 8);
  sm->nan = static_cast<int64_t>(out[2]);
  sm->inf = static_cast<int64_t>(out[3]);
  h[0] = out[4];
  h[1] = out[5];
  return true;
}

void release(Pending& p) {
  Py_CLEAR(p.ring);
  p.handle = nullptr;
}

// GIL held. The key from Python, the entry record (the input's fingerprint follows, without
// the GIL: fingerprint_input).
void enter(const Static& s, PyObject* begin, Pending& p) {
  PyObject* key = PyObject_CallNoArgs(begin);
  if (key == nullptr) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject* text = value ? PyObject_Str(value) : nullptr;
    const char* c = text ? PyUnicode_AsUTF8(text) : nullptr;
    s.ctl->fail(std::string("begin() raised: ") + (c ? c : "?"));
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
    return;
  }
  if (key == Py_None) {
    Py_DECREF(key);
    return;
  }
  PyObject *ring, *site;
  long long seq, step;
  if (!PyArg_ParseTuple(key, "OLLU", &ring, &seq, &step, &site)) {
    PyErr_Clear();
    Py_DECREF(key);
    s.ctl->fail("begin() returned no (ring, seq, step, callsite)");
    return;
  }
  void* handle = PyCapsule_GetPointer(ring, CC_RING_CAPSULE);
  Py_ssize_t n = 0;
  const char* c = PyUnicode_AsUTF8AndSize(site, &n);
  if (handle == nullptr || c == nullptr) {
    PyErr_Clear();
    Py_DECREF(key);
    s.ctl->fail("begin() returned no ring capsule or call site");
    return;
  }
  p.ring = ring;
  Py_INCREF(ring);
  p.handle = handle;
  p.seq = seq;
  p.step = step;
  p.callsite.assign(c, static_cast<size_t>(n));
  Py_DECREF(key);

  p.t_enter = s.api->now();
  cc_record r = base_record(s, p);
  r.phase = CC_PHASE_ENTRY;
  put(s, p, r);
}

// GIL not needed (the kernel keeps no Python state): the input's fingerprint.
void fingerprint_input(const Static& s, Pending& p) {
  if ((s.hash_in || s.summary_in) &&
      fingerprint(s, p, s.hash_in, s.summary_in, p.in_hash, &p.in_summary))
    p.flags |= (s.hash_in ? CC_F_IN_HASH : 0) | (s.summary_in ? CC_F_IN_SUMMARY : 0);
}

// GIL not needed: the completion record with the output's fingerprint, to write with
// finish().
cc_record complete(const Static& s, Pending& p) {
  cc_record r = base_record(s, p);
  r.phase = CC_PHASE_COMPLETE;
  r.flags = p.flags;
  std::memcpy(r.in_hash, p.in_hash, sizeof r.in_hash);
  r.in_summary = p.in_summary;
  if (s.hash_out || s.summary_out) {
    if (fingerprint(s, p, s.hash_out, s.summary_out, r.out_hash, &r.out_summary))
      r.flags |= (s.hash_out ? CC_F_OUT_HASH : 0) | (s.summary_out ? CC_F_OUT_SUMMARY : 0);
  }
  r.algo = str(s.algo);
  r.t_done = s.api->now();
  return r;
}

// GIL held. The completion record into the ring.
void finish(const Static& s, Pending& p, const cc_record& r) {
  put(s, p, r);
  s.ctl->buckets.fetch_add(1, std::memory_order_relaxed);
}

class Hook : public c10d::CommHookInterface {
 public:
  Hook(c10::intrusive_ptr<c10d::ProcessGroup> pg, py::object state, py::object dispatch,
       py::object begin, std::shared_ptr<const Static> s)
      : pg_(std::move(pg)),
        python_(std::make_unique<c10d::PythonCommHook>(std::move(state), std::move(dispatch))),
        begin_(begin.release().ptr()),
        s_(std::move(s)) {}

  ~Hook() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_CLEAR(begin_);
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor& buffer = bucket.getBufferRef();
    const DtypeCode* dtype = native(buffer);
    if (dtype == nullptr) return python_->runHook(bucket);
    buffer.div_(pg_->getSize());
    auto p = std::make_shared<Pending>();
    p->buffer = buffer;
    p->dtype = dtype;
    p->numel = buffer.numel();
    p->shape.assign(buffer.sizes().begin(), buffer.sizes().end());
    {
      py::gil_scoped_acquire gil;
      try {
        enter(*s_, begin_, *p);
      } catch (const std::exception& e) {
        s_->ctl->fail(e.what());
        release(*p);
      }
    }
    if (p->ring != nullptr) fingerprint_input(*s_, *p);  // before the reduction overwrites it
    std::vector<at::Tensor> tensors = {buffer};
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    try {
      fut = pg_->allreduce(tensors)->getFuture();
    } catch (...) {  // torch's error, as from the built-in hook; the entry stays
      py::gil_scoped_acquire gil;
      release(*p);
      throw;
    }
    if (p->ring == nullptr) return fut;
    auto s = s_;
    return fut->then(
        [s, p](c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) {  // DDP sees the error; the entry record stays open
            py::gil_scoped_acquire gil;
            release(*p);
            return done.value();
          }
          cc_record r{};
          bool ok = true;
          try {
            r = complete(*s, *p);  // the memory passes, without holding the GIL
          } catch (const std::exception& e) {
            s->ctl->fail(e.what());
            ok = false;
          }
          {
            py::gil_scoped_acquire gil;
            try {
              if (ok) finish(*s, *p, r);
            } catch (const std::exception& e) {
              s->ctl->fail(e.what());
            }
            release(*p);
          }
          return done.value();
        },
        fut->elementType());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isPyObject()) return python_->parseHookResult(result);
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  // The bucket's dtype where the native path takes it; nullptr: the Python dispatch.
  const DtypeCode* native(const at::Tensor& t) const {
    if (!s_->ctl->native.load(std::memory_order_relaxed)) return nullptr;
    if (!t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous() ||
        t.is_neg() || t.is_conj())
      return nullptr;
    return dtype_of(t);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::unique_ptr<c10d::PythonCommHook> python_;
  PyObject* begin_;
  std::shared_ptr<const Static> s_;
};

// Register the hook on `reducer`: `state`/`dispatch` as dist._register_comm_hook takes them
// (the Python path), `begin` as above, `api` the capsule of ccapi.h.
std::shared_ptr<Control> install(py::object reducer, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                 py::object state, py::object dispatch, py::object begin,
                                 py::capsule api, std::string group_name,
                                 std::vector<int64_t> ranks, bool hash_in, bool summary_in,
                                 bool hash_out, bool summary_out) {
  auto* table = static_cast<const cc_api*>(PyCapsule_GetPointer(api.ptr(), CC_API_CAPSULE));
  if (table == nullptr) throw py::error_already_set();
  if (table->version != CC_API_VERSION)
    throw std::runtime_error("ccapi version " + std::to_string(table->version) +
                             ", built for " + std::to_string(CC_API_VERSION));
  auto& r = reducer.cast<c10d::Reducer&>();
  auto ctl = std::make_shared<Control>();
  auto s = std::make_shared<Static>(Static{table, std::move(group_name), "ddp_allreduce",
                                           "SUM", (hash_in || hash_out) ? "xxh3-128" : "",
                                           std::move(ranks), hash_in, summary_in, hash_out,
                                           summary_out, ctl});
  r.register_comm_hook(std::make_unique<Hook>(std::move(pg), std::move(state),
                                              std::move(dispatch), std::move(begin), s));
  return ctl;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Control, std::shared_ptr<Control>>(m, "Control")
      .def_property(
          "native", [](const Control& c) { return c.native.load(); },
          [](Control& c, bool on) { c.native.store(on); })
      .def_property_readonly("buckets", [](const Control& c) { return c.buckets.load(); })
      .def_property_readonly("errors", [](const Control& c) { return c.errors.load(); })
      .def_property_readonly("dropped", [](const Control& c) { return c.dropped.load(); })
      .def_property_readonly("last_error", [](Control& c) { return c.error(); });
  m.def("install", &install, "register commcheck's native DDP hook on a reducer",
        py::arg("reducer"), py::arg("process_group"), py::arg("state"), py::arg("dispatch"),
        py::arg("begin"), py::arg("api"), py::arg("group_name"), py::arg("ranks"),
        py::arg("hash_in"), py::arg("summary_in"), py::arg("hash_out"),
        py::arg("summary_out"));
}
