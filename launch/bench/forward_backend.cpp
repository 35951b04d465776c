// A c10d Backend that hands c10d's async all_reduce, all_gather_single and
// reduce_scatter_single to a Gloo backend and does nothing else: what
// launch/bench/bench_overhead.py --dispatch measures, the cost of reaching a
// C++ backend through torch.distributed, as a commslayer group built on one
// would be reached (docs/bench/async-path.md).  Not part of commslayer.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;

class ForwardBackend : public c10d::Backend {
 public:
  explicit ForwardBackend(c10::intrusive_ptr<c10d::Backend> inner)
      : c10d::Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}

  const std::string getBackendName() const override {
    return "forward";
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    ++forwarded_;
    return inner_->allreduce(tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    ++forwarded_;
    return inner_->_allgather_base(output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    ++forwarded_;
    return inner_->_reduce_scatter_base(output, input, opts);
  }

  // How many ops reached this backend: the benchmark checks that its calls did.
  int64_t forwarded() const {
    return forwarded_;
  }

 private:
  c10::intrusive_ptr<c10d::Backend> inner_;
  int64_t forwarded_ = 0;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module_::import("torch.distributed");  // c10d's Backend type, this class's base
  py::class_<ForwardBackend, c10d::Backend, c10::intrusive_ptr<ForwardBackend>>(m, "ForwardBackend")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>>(), py::arg("inner"))
      .def("forwarded", &ForwardBackend::forwarded);
}
