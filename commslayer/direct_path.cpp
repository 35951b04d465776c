// The direct path in native code: a synchronous all_reduce, all_gather_single or
// reduce_scatter_single, checked, issued and waited on without running Python.
//
// Why: after a blocking wait on a real transfer, every line of Python runs with
// cold caches; the checks, the issue and the wait cost 50-60 us of the calling
// thread in Python and a few us here (docs/benchmarks.md, "The direct path in
// native code").  commslayer/native.py builds this file and loads it;
// Communicator._direct_run decides when it runs and does the bookkeeping
// (sequence numbers, records, errors) in Python, as the pure-Python path does.

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

static_assert(static_cast<int>(c10::ScalarType::NumOptions) <= 64, "a dtype is a bit of a uint64_t");

enum Kind : int { kAllReduce = 0, kAllGather = 1, kReduceScatter = 2 };

// One communicator's direct path: its backend, what a tensor must be to take
// it, and the deadline its option structs carry.
class DirectPath {
 public:
  DirectPath(
      c10::intrusive_ptr<c10d::Backend> backend,
      int64_t size,
      const std::string& device_type,
      const std::vector<at::ScalarType>& dtypes,
      std::chrono::milliseconds timeout,
      std::chrono::milliseconds wait)
      : backend_(std::move(backend)),
        size_(size),
        device_type_(c10::Device(device_type).type()) {
    for (auto dtype : dtypes) {
      dtypes_ |= uint64_t{1} << static_cast<int>(dtype);
    }
    set_timeout(timeout, wait);
  }

  // A backend's destructor may block on its own threads, and those may need the
  // GIL (a future's Python callback): let go of the backend without it, as
  // torch's bindings do for theirs.
  ~DirectPath() {
    if (PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      backend_.reset();
    } else {
      backend_.reset();
    }
  }

  DirectPath(const DirectPath&) = delete;
  DirectPath& operator=(const DirectPath&) = delete;

  // The op's deadline (in the backend's option structs) and how long one wait
  // blocks: the whole deadline, or a slice when a liveness monitor may break
  // the communicator meanwhile.
  void set_timeout(std::chrono::milliseconds timeout, std::chrono::milliseconds wait) {
    allreduce_.timeout = timeout;
    allgather_.timeout = timeout;
    reduce_scatter_.timeout = timeout;
    wait_ = wait;
  }

  // Communicator._direct_run's check for one tensor: a plain (not a subclass)
  // dense, contiguous tensor on the group's device type, of a dtype it carries.
  bool fits(py::handle t) const {
    return tensor(t) != nullptr;
  }

  // fits for both, one dtype, and big holding size times small's elements.
  bool fits_sized(py::handle big, py::handle small) const {
    const at::Tensor* b = tensor(big);
    const at::Tensor* s = tensor(small);
    return b != nullptr && s != nullptr && b->scalar_type() == s->scalar_type() &&
        b->numel() == s->numel() * size_;
  }

  // Issue the op and wait for it, without the GIL.  None once it completed;
  // (backend work, message) when the wait raised (the deadline, or a slice of
  // it, ran out, or the backend failed): the caller settles it.  An error of
  // the issue itself propagates as the backend's exception.  The caller has
  // checked the tensors (fits, fits_sized).
  py::object run(int kind, py::handle a, py::handle b) {
    const at::Tensor& first = THPVariable_Unpack(a.ptr());
    const at::Tensor& second = THPVariable_Unpack(b.ptr());
    c10::intrusive_ptr<c10d::Work> failed;  // the work whose wait raised, for the caller to settle
    std::string failure;
    {
      py::gil_scoped_release no_gil;
      c10::intrusive_ptr<c10d::Work> work = issue(kind, first, second);
      try {
        work->wait(wait_);
      } catch (const c10::Error& e) {
        failure = e.what_without_backtrace();
        failed = std::move(work);
      } catch (const std::exception& e) {
        failure = e.what();
        failed = std::move(work);
      }
    }  // a completed work is released here, without the GIL
    if (!failed) {
      return py::none();
    }
    return py::make_tuple(py::cast(std::move(failed)), py::str(failure));
  }

 private:
  const at::Tensor* tensor(py::handle t) const {
    if (!THPVariable_CheckExact(t.ptr())) {
      return nullptr;
    }
    const at::Tensor& tensor = THPVariable_Unpack(t.ptr());
    if (tensor.layout() != c10::kStrided || tensor.device().type() != device_type_ ||
        !((dtypes_ >> static_cast<int>(tensor.scalar_type())) & 1) || !tensor.is_contiguous()) {
      return nullptr;
    }
    return &tensor;
  }

  c10::intrusive_ptr<c10d::Work> issue(int kind, const at::Tensor& first, const at::Tensor& second) {
    switch (kind) {
      case kAllReduce: {
        std::vector<at::Tensor> tensors{first};
        return backend_->allreduce(tensors, allreduce_);
      }
      case kAllGather: {
        at::Tensor output = first;
        at::Tensor input = second;
        return backend_->_allgather_base(output, input, allgather_);
      }
      case kReduceScatter: {
        at::Tensor output = first;
        at::Tensor input = second;
        return backend_->_reduce_scatter_base(output, input, reduce_scatter_);
      }
      default:
        throw std::invalid_argument("unknown op kind " + std::to_string(kind));
    }
  }

  c10::intrusive_ptr<c10d::Backend> backend_;
  int64_t size_;
  c10::DeviceType device_type_;
  uint64_t dtypes_ = 0;
  c10d::AllreduceOptions allreduce_;  // reduceOp: SUM, the default
  c10d::AllgatherOptions allgather_;
  c10d::ReduceScatterOptions reduce_scatter_;
  std::chrono::milliseconds wait_{0};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "commslayer's direct path in native code (commslayer/native.py builds and loads it)";
  py::class_<DirectPath>(m, "DirectPath")
      .def(
          py::init<c10::intrusive_ptr<c10d::Backend>, int64_t, const std::string&, const std::vector<at::ScalarType>&,
                   std::chrono::milliseconds, std::chrono::milliseconds>(),
          py::arg("backend"), py::arg("size"), py::arg("device_type"), py::arg("dtypes"), py::arg("timeout"),
          py::arg("wait"))
      .def("set_timeout", &DirectPath::set_timeout, py::arg("timeout"), py::arg("wait"))
      .def("fits", &DirectPath::fits, py::arg("t"))
      .def("fits_sized", &DirectPath::fits_sized, py::arg("big"), py::arg("small"))
      .def("run", &DirectPath::run, py::arg("kind"), py::arg("a"), py::arg("b"));
}
