// The direct path in native code: a synchronous all_reduce, all_gather_single or
// reduce_scatter_single, checked, issued and waited on without running Python;
// and the MIN all-reduce that tallies a should_commit vote (kMinAllReduce).
//
// Why: after a blocking wait on a real transfer, every line of Python runs with
// cold caches; the checks, the issue and the wait cost 50-60 us of the calling
// thread in Python and a few us here (docs/bench/direct-path.md, "The direct
// path in native code").  commslayer/comm/native.py builds this file and loads it;
// Communicator._direct_run (commslayer/comm/op_path.py) decides when it runs and does the bookkeeping
// (sequence numbers, errors) in Python, as the pure-Python path does.
//
// The same ops issued async through the c10d adapter (FSDP2's and DDP's) are
// issued here too (DirectPath.issue_async): their c10d Work (AsyncOpWork)
// waits without Python until an op does not simply complete, when Python
// settles it (docs/bench/async-path.md).
//
// The flight recorder's record of such an op is written here too, into a
// NativeRing (tracing/record/recorder.py reads it at dump time and takes a record
// over when its op fails): filling a Python record cost 25-48 us of the
// calling thread per op (docs/bench/direct-path.md, "The recorder in native code").

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/chrono.h>

#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace {

static_assert(static_cast<int>(c10::ScalarType::NumOptions) <= 64, "a dtype is a bit of a uint64_t");

// commslayer.comm.op_path.DIRECT_OPS[kind]; kMinAllReduce is should_commit's tally,
// which only DirectPath.run takes.
enum Kind : int { kAllReduce = 0, kAllGather = 1, kReduceScatter = 2, kMinAllReduce = 3 };

// A record's state, by its index in tracing.records.STATES.
enum State : int { kScheduled = 0, kStarted = 1, kCompleted = 2, kTimedOut = 3, kFailed = 4, kAborted = 5 };

// time.monotonic_ns(): the clock of every record.
int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// CPython 3.11's frame (_PyInterpreterFrame, Include/internal/pycore_frame.h),
// as far as a call site reads it.  A thread's frames change only as that
// thread runs Python, so a thread that released the GIL to issue an op can read
// its own without it.  NativeRing checks the layout once, against the public
// API, before it trusts it; other versions take the GIL and the public API.
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define COMMSLAYER_RAW_FRAMES 1
struct RawFrame {
  PyObject* f_func;
  PyObject* f_globals;
  PyObject* f_builtins;
  PyObject* f_locals;
  PyCodeObject* f_code;
  PyObject* frame_obj;
  RawFrame* previous;
  _Py_CODEUNIT* prev_instr;
  int stacktop;
  bool is_entry;
  char owner;
};
constexpr char kOwnedByGenerator = 1;  // FRAME_OWNED_BY_GENERATOR

// The first complete frame from f outwards (PyFrame_GetBack's rule: a frame
// whose code has not begun yet is skipped).
const RawFrame* complete(const RawFrame* f) {
  while (f != nullptr && f->owner != kOwnedByGenerator &&
         f->prev_instr < _PyCode_CODE(f->f_code) + f->f_code->_co_firsttraceable) {
    f = f->previous;
  }
  return f;
}

// The calling thread's innermost complete frame, or null (a thread that never ran Python).
const RawFrame* innermost_raw() {
  PyThreadState* state = PyGILState_GetThisThreadState();
  if (state == nullptr || state->cframe == nullptr) {
    return nullptr;
  }
  return complete(reinterpret_cast<const RawFrame*>(state->cframe->current_frame));
}

// The calling thread's frames without the GIL.
struct RawFrames {
  using Frame = const RawFrame*;
  static Frame back(Frame f) {
    return complete(f->previous);
  }
  static PyObject* code(Frame f) {
    return reinterpret_cast<PyObject*>(f->f_code);
  }
  static int lasti(Frame f) {  // PyFrame_GetLasti's
    int lasti = static_cast<int>(f->prev_instr - _PyCode_CODE(f->f_code));
    return lasti < 0 ? -1 : lasti * static_cast<int>(sizeof(_Py_CODEUNIT));
  }
};
#endif

// The calling thread's frames through the public API (GIL held); each one
// walked becomes a frame object.
struct PublicFrames {
  using Frame = py::object;
  static Frame back(const Frame& f) {
    return py::reinterpret_steal<py::object>(
        reinterpret_cast<PyObject*>(PyFrame_GetBack(reinterpret_cast<PyFrameObject*>(f.ptr()))));
  }
  static PyObject* code(const Frame& f) {  // borrowed: the frame holds it
    PyCodeObject* code = PyFrame_GetCode(reinterpret_cast<PyFrameObject*>(f.ptr()));
    Py_DECREF(code);
    return reinterpret_cast<PyObject*>(code);
  }
  static int lasti(const Frame& f) {
    return PyFrame_GetLasti(reinterpret_cast<PyFrameObject*>(f.ptr()));
  }
  static Frame innermost() {
    PyFrameObject* current = PyEval_GetFrame();
    return current == nullptr ? py::object() : py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(current));
  }
};

constexpr int64_t kNoStep = INT64_MIN;  // a record outside a resilient job's steps

// One op's record.  Plain data, so that it is written without the GIL: the
// Python objects it points to are the ring's (ids, code), kept while it may point to them.
struct Slot {
  int64_t op_id = 0;  // 0: empty (never written, or taken over by Python)
  int64_t seq = 0;
  int kind = kAllReduce;
  int state = kScheduled;
  at::ScalarType dtype = at::ScalarType::Undefined;
  c10::SmallVector<int64_t, 4> in_shape;  // more dimensions than 4 go to the heap
  c10::SmallVector<int64_t, 4> out_shape;
  double timeout_s = 0;
  int64_t start_ns = 0;
  int64_t end_ns = -1;  // -1: not ended
  bool async_op = false;
  int64_t wait_ns = -1;  // an async op's first wait began (-1: not waited on)
  int64_t wait_end_ns = -1;  // and its last one ended
  unsigned long thread = 0;
  int lasti = 0;
  PyObject* ids = nullptr;  // the communicator's (name, uid, generation): NativeRing::hold
  PyObject* code = nullptr;  // the call site's code object (NativeRing::where_), or null
  int64_t step = kNoStep;  // the resilient job's step
  std::string error;  // the error text of an aborted op ("": none)
};

// The flight recorder's ring for the direct path's ops (tracing.record.recorder's
// FlightRecorder holds one).  Each slot is written while its op runs; the
// recorder reads them all at dump time and merges them with its own records
// by op_id.  A record is begun without the GIL where the call site can be
// read without it (COMMSLAYER_RAW_FRAMES, once the thread is named and the
// codes on its walk are known): c10d calls GroupBackend without the GIL, and
// taking it back and walking frame objects cost 3.1-6.2 us an op against
// 1.3-4.1 now (docs/bench/async-path.md, "The recorder's record without the GIL").
class NativeRing {
 public:
  // internal_paths and threading_file say which frames are ours (the call site
  // walk of tracing.record.recorder._caller); thread_names is the recorder's dict of
  // thread names, which this fills for each thread's first op.  GIL held.
  NativeRing(int64_t capacity, py::dict thread_names, py::tuple internal_paths, py::object threading_file,
             py::object current_thread)
      : capacity_(std::max<int64_t>(capacity, 1)),
        thread_names_(std::move(thread_names)),
        internal_paths_(std::move(internal_paths)),
        threading_file_(std::move(threading_file)),
        current_thread_(std::move(current_thread)) {
#ifdef COMMSLAYER_RAW_FRAMES
    raw_frames_ = raw_frames_agree();
#endif
  }

  int64_t count() {
    std::lock_guard<std::mutex> lock(mutex_);
    return count_;
  }

  int64_t taken() {
    std::lock_guard<std::mutex> lock(mutex_);
    return taken_;
  }

  // Whether records are begun without the GIL (the call site read from CPython's frames).
  bool raw_frames() const {
    return raw_frames_;
  }

  // The resilient job's current step, None outside one (tracing.record.recorder's step hook sets it).
  py::object step() const {
    int64_t step = step_.load();
    return step == kNoStep ? py::object(py::none()) : py::object(py::int_(step));
  }

  void set_step(const py::object& step) {
    step_.store(step.is_none() ? kNoStep : step.cast<int64_t>());
  }

  // Keep ids (a communicator's (name, uid, generation)) for the records that
  // point to it (GIL held): as long as the ring, since a dump may come after
  // the communicator is gone.
  void hold(const py::object& ids) {
    for (const py::object& held : held_) {
      if (held.ptr() == ids.ptr()) {
        return;
      }
    }
    held_.push_back(ids);
  }

  // A new record, of an op that starts now: its slot, which stays where it is
  // while the ring grows.  gil: whether the caller holds the GIL; the record
  // takes it only where the call site cannot be read without it.  ids: held.
  Slot* begin(int64_t op_id, int64_t seq, int kind, const at::Tensor& output, const at::Tensor& input,
              PyObject* ids, double timeout_s, bool async_op, bool gil) {
    thread_local bool named = false;
    std::optional<py::gil_scoped_acquire> taken;
    if (!gil && (!raw_frames_ || !named)) {
      taken.emplace();
      gil = true;
    }
    if (!named) {
      thread_names_[py::int_(PyThread_get_thread_ident())] = current_thread_().attr("name");
      named = true;
    }
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
      Site site;
#ifdef COMMSLAYER_RAW_FRAMES
      if (raw_frames_) {
        lock.lock();
        site = walk<RawFrames>(innermost_raw());
      }
#endif
      if (!raw_frames_) {
        // Every thread holds the GIL here, and where_ changes only with it: the walk
        // needs no lock, and takes none while the public API makes frame objects
        // (which may run Python).  Its site's code is kept only if where_ still has it.
        site = walk<PublicFrames>(PublicFrames::innermost());
        lock.lock();
        if (site.code != nullptr && where(site.code) == kUnknown) {
          site.unknown = site.code;  // let go of meanwhile, by another thread's learn
        }
      }
      if (site.unknown == nullptr) {
        return write(op_id, seq, kind, output, input, ids, timeout_s, async_op, site);
      }
      lock.unlock();
      if (!gil) {
        taken.emplace();
        gil = true;
      }
      learn(site.unknown);
    }
  }

  // The op of slot s completed at end_ns; a slot that another op took meanwhile,
  // or that an abort marked, stays as it is.  Ints only: an async op's wait
  // writes them without the GIL.
  static void completed(Slot& s, int64_t op_id, int64_t end_ns) {
    if (s.op_id == op_id && s.state == kStarted) {
      s.state = kCompleted;
      s.end_ns = end_ns;
    }
  }

  // The caller of async op op_id blocked in a wait from began_ns to end_ns (the
  // first wait's start, the last one's end), as completed: without the GIL.
  static void waited(Slot& s, int64_t op_id, int64_t began_ns, int64_t end_ns) {
    if (s.op_id == op_id) {
      if (s.wait_ns < 0) {
        s.wait_ns = began_ns;
      }
      s.wait_end_ns = end_ns;
    }
  }

  // Every record, oldest first, as tuples (tracing.record.recorder.Record.from_native).
  py::list records() {
    py::list out;
    for (const Copy& c : copies(0).second) {
      if (c.slot.op_id != 0) {
        out.append(fields(c));
      }
    }
    return out;
  }

  // The records begun at or after position `from` (records ever begun before
  // them), the oldest the ring still holds if it moved past `from`: (the
  // position of the first, a list with None where a record was taken).  For a
  // reader that comes back for the new ones only (the status figures).
  py::tuple records_from(int64_t from) {
    auto [first, copied] = copies(from);
    py::list out;
    for (const Copy& c : copied) {
      out.append(c.slot.op_id != 0 ? fields(c) : py::object(py::none()));
    }
    return py::make_tuple(first, out);
  }

  // Take the record of op_id out of the ring (its op failed: Python settles it
  // from here on); None when the ring has moved past it, or when an abort ended
  // it: that record is final, and a trace sink may have read it already.
  py::object take(int64_t op_id) {
    std::optional<Copy> copy;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (Slot& s : slots_) {
        if (s.op_id == op_id) {
          if (s.end_ns >= 0) {
            return py::none();
          }
          copy.emplace(copy_of(s));
          s.op_id = 0;
          ++taken_;
          break;
        }
      }
    }
    return copy ? py::object(fields(*copy)) : py::object(py::none());
  }

  // Mark the ops of communicator uid still in flight as aborted at now_ns; how many.
  int abort(const py::str& uid, int64_t now_ns, const py::str& error) {
    std::vector<PyObject*> of_uid;  // the held ids of that communicator
    for (const py::object& ids : held_) {
      if (py::str(ids[py::int_(1)]).equal(uid)) {
        of_uid.push_back(ids.ptr());
      }
    }
    std::string text = error;
    int marked = 0;
    std::lock_guard<std::mutex> lock(mutex_);
    for (Slot& s : slots_) {
      if (s.op_id != 0 && s.state == kStarted && s.end_ns < 0 &&
          std::find(of_uid.begin(), of_uid.end(), s.ids) != of_uid.end()) {
        s.state = kAborted;
        s.end_ns = now_ns;
        s.error = text;
        ++marked;
      }
    }
    return marked;
  }

 private:
  enum Where : int { kOutside = 0, kInternal = 1, kThreading = 2, kUnknown = 3 };

  // A walk's outcome: the call site (code null: none), or a code it has not classified yet.
  struct Site {
    PyObject* code = nullptr;
    int lasti = 0;
    PyObject* unknown = nullptr;
  };

  // A slot as a reader copied it, with references to its Python objects.
  struct Copy {
    Slot slot;
    py::object ids;
    py::object code;
  };

  // Where code is, by what learn found (mutex_ held).
  int where(PyObject* code) const {
    auto found = where_.find(code);
    return found == where_.end() ? kUnknown : found->second.second;
  }

  // The call site, as code object and instruction offset:
  // tracing.record.recorder._caller's, two frames up (the op's method called
  // Communicator._direct_run, which called DirectPath.run, or torch.distributed's
  // function and its logger called c10d), unless an op of ours issued it.
  // mutex_ held, or (the public API) the GIL, by every thread.  Stops at the
  // first code not classified yet.
  template <typename Frames>
  Site walk(typename Frames::Frame frame) {
    Site site;
    auto at = [&](const typename Frames::Frame& f) {
      int found = where(Frames::code(f));
      if (found == kUnknown) {
        site.unknown = Frames::code(f);
      }
      return found;
    };
    for (int i = 0; i < 2 && frame; ++i) {
      frame = Frames::back(frame);
    }
    if (frame) {
      int here = at(frame);
      if (here == kInternal) {
        typename Frames::Frame inner{};
        while (frame && here == kInternal) {
          inner = frame;
          frame = Frames::back(frame);
          here = frame ? at(frame) : kOutside;
        }
        if (inner && frame && here == kThreading) {
          frame = inner;  // an op of commslayer's own thread: the outermost frame of ours
        }
      }
      if (site.unknown != nullptr) {
        return site;
      }
    }
    if (frame) {
      site.code = Frames::code(frame);
      site.lasti = Frames::lasti(frame);
    }
    return site;
  }

  // Classify code (GIL held), keeping it while where_ may point to it.  When
  // where_ is full, the codes that no record points to go.
  void learn(PyObject* code_ptr) {
    py::object code = py::reinterpret_borrow<py::object>(code_ptr);
    py::object filename = code.attr("co_filename");
    int where = kOutside;
    if (filename.equal(threading_file_)) {
      where = kThreading;
    } else if (py::bool_(filename.attr("startswith")(internal_paths_))) {
      where = kInternal;
    }
    std::vector<py::object> dropped;  // let go of after the lock: a code's weakref callback runs Python
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (where_.size() >= kWhereCapacity) {
        std::unordered_set<PyObject*> sites;
        for (const Slot& s : slots_) {
          if (s.op_id != 0 && s.code != nullptr) {
            sites.insert(s.code);
          }
        }
        for (auto it = where_.begin(); it != where_.end();) {
          if (sites.count(it->first) == 0) {
            dropped.push_back(std::move(it->second.first));
            it = where_.erase(it);
          } else {
            ++it;
          }
        }
      }
      where_.emplace(code_ptr, std::make_pair(std::move(code), where));
    }
  }

  // The slot of a new record, with its call site (mutex_ held).
  Slot* write(int64_t op_id, int64_t seq, int kind, const at::Tensor& output, const at::Tensor& input,
              PyObject* ids, double timeout_s, bool async_op, const Site& site) {
    if (static_cast<int64_t>(slots_.size()) < capacity_) {
      slots_.emplace_back();  // the ring grows as ops come, up to its capacity
    }
    Slot& s = slots_[static_cast<size_t>(count_ % capacity_)];
    ++count_;
    s.op_id = op_id;
    s.seq = seq;
    s.kind = kind;
    s.state = kStarted;
    s.dtype = input.scalar_type();
    s.in_shape.assign(input.sizes().begin(), input.sizes().end());
    s.out_shape.assign(output.sizes().begin(), output.sizes().end());
    s.timeout_s = timeout_s;
    s.ids = ids;
    s.step = step_.load();
    s.error.clear();
    s.thread = PyThread_get_thread_ident();
    s.code = site.code;
    s.lasti = site.lasti;
    s.end_ns = -1;
    s.async_op = async_op;
    s.wait_ns = s.wait_end_ns = -1;
    s.start_ns = monotonic_ns();
    return &s;
  }

  // Slot s with references to its Python objects (GIL and mutex_ held: no allocation of Python's).
  static Copy copy_of(const Slot& s) {
    return Copy{s, s.ids == nullptr ? py::object() : py::reinterpret_borrow<py::object>(s.ids),
                s.code == nullptr ? py::object() : py::reinterpret_borrow<py::object>(s.code)};
  }

  // The slots of the records begun at or after position `from`, as copied
  // under the lock (GIL held), and the position of the first.
  std::pair<int64_t, std::vector<Copy>> copies(int64_t from) {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t first = std::max<int64_t>({int64_t{0}, from, count_ - capacity_});
    std::vector<Copy> out;
    out.reserve(static_cast<size_t>(std::max<int64_t>(0, count_ - first)));
    for (int64_t i = first; i < count_; ++i) {
      out.push_back(copy_of(slots_[static_cast<size_t>(i % capacity_)]));
    }
    return {first, std::move(out)};
  }

  static py::tuple fields(const Copy& c) {
    const Slot& s = c.slot;
    py::tuple in_shape(s.in_shape.size());
    for (size_t i = 0; i < s.in_shape.size(); ++i) {
      in_shape[i] = py::int_(s.in_shape[i]);
    }
    py::tuple out_shape(s.out_shape.size());
    for (size_t i = 0; i < s.out_shape.size(); ++i) {
      out_shape[i] = py::int_(s.out_shape[i]);
    }
    auto optional = [](int64_t value) { return value < 0 ? py::object(py::none()) : py::object(py::int_(value)); };
    return py::make_tuple(
        s.op_id, c.ids, s.seq, s.kind, s.dtype, in_shape, out_shape, s.timeout_s, s.state, s.start_ns,
        optional(s.end_ns), s.thread, c.code ? c.code : py::object(py::none()), s.lasti,
        s.step == kNoStep ? py::object(py::none()) : py::object(py::int_(s.step)),
        s.error.empty() ? py::object(py::none()) : py::object(py::str(s.error)), s.async_op, optional(s.wait_ns),
        optional(s.wait_end_ns));
  }

#ifdef COMMSLAYER_RAW_FRAMES
  // Whether CPython's frames, read as RawFrame, are the public API's (GIL held):
  // the same codes and offsets, frame by frame, from the constructor's caller out.
  static bool raw_frames_agree() {
    if (PyGILState_GetThisThreadState() != PyThreadState_Get()) {
      return false;
    }
    const RawFrame* raw = innermost_raw();
    py::object frame = PublicFrames::innermost();
    for (int depth = 0; depth < 16 && (raw != nullptr || frame); ++depth) {
      if (raw == nullptr || !frame || RawFrames::code(raw) != PublicFrames::code(frame) ||
          RawFrames::lasti(raw) != PublicFrames::lasti(frame)) {
        return false;
      }
      raw = RawFrames::back(raw);
      frame = PublicFrames::back(frame);
    }
    return true;
  }
#endif

  static constexpr size_t kWhereCapacity = 4096;

  int64_t capacity_;
  bool raw_frames_ = false;
  std::atomic<int64_t> step_{kNoStep};
  // Guards what follows; never held while the GIL is taken.
  std::mutex mutex_;
  // The ring: op i in slot i % capacity_.  A deque, so that a slot stays where
  // it is while the ring grows (an op holds its slot while it runs).
  std::deque<Slot> slots_;
  int64_t count_ = 0;  // records ever begun
  int64_t taken_ = 0;  // of those, taken over by Python
  std::vector<py::object> held_;  // every ids a record may point to (GIL-guarded, not mutex_)
  std::unordered_map<PyObject*, std::pair<py::object, int>> where_;  // code object -> Where (kept)
  py::dict thread_names_;
  py::tuple internal_paths_;
  py::object threading_file_;
  py::object current_thread_;
};

// Whether two tensors are plain memory of one dtype on the CPU (contiguous, no
// conjugate or negative bit), which the copies below move with memcpy or a loop:
// at::Tensor::copy_'s TensorIterator runs several us of code that a blocking wait
// left cold (docs/bench/async-path.md).
bool plain_pair(const at::Tensor& a, const at::Tensor& b) {
  return a.is_cpu() && b.is_cpu() && a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type() &&
      !a.is_conj() && !b.is_conj() && !a.is_neg() && !b.is_neg();
}

// dst = src, two tensors of one size that do not overlap.
void copy_into(at::Tensor& dst, const at::Tensor& src) {
  if (plain_pair(dst, src) && dst.numel() == src.numel()) {
    std::memcpy(dst.data_ptr(), src.data_ptr(), dst.nbytes());
  } else {
    dst.copy_(src);
  }
}

template <typename T>
void divide_elements(at::Tensor& out, const at::Tensor& in, int64_t divisor) {
  const T* from = in.const_data_ptr<T>();
  T* to = out.mutable_data_ptr<T>();
  const T by = static_cast<T>(divisor);
  for (int64_t i = 0, n = out.numel(); i < n; ++i) {
    to[i] = from[i] / by;
  }
}

// out = in / divisor, AVG's division: for float and double one IEEE division per
// element, what at::div_out computes (bitwise); other dtypes through at::div_out.
void divide_into(at::Tensor& out, const at::Tensor& in, int64_t divisor) {
  bool plain = plain_pair(out, in) && out.numel() == in.numel();
  if (plain && out.scalar_type() == at::kFloat) {
    divide_elements<float>(out, in, divisor);
  } else if (plain && out.scalar_type() == at::kDouble) {
    divide_elements<double>(out, in, divisor);
  } else {
    at::div_out(out, in, divisor);
  }
}

// Gloo's reduce-scatter is an all-reduce of a copy of the input, whose slice
// for this rank is copied out when the caller waits, and that wait ignores its
// timeout (ProcessGroupGloo's reduce_scatter_tensor_coalesced).  Where the
// wait must keep its timeout (a liveness monitor breaks the communicator
// between slices), the direct path runs the same steps itself: the same sum,
// bitwise, with a wait that times out.
class AllReduceScatterWork : public c10d::Work {
 public:
  AllReduceScatterWork(c10::intrusive_ptr<c10d::Work> all_reduce, at::Tensor sum, at::Tensor output, int64_t rank,
                       int64_t size)
      : all_reduce_(std::move(all_reduce)), sum_(std::move(sum)), output_(std::move(output)), rank_(rank),
        size_(size) {}

  // Completed once the all-reduce ended: a sum that arrived is copied out here
  // (an async op's watchdog asks, and must not wait on the all-reduce itself).
  bool isCompleted() override {
    if (!all_reduce_->isCompleted()) {
      return false;
    }
    if (all_reduce_->isSuccess()) {
      copy_out();
    }
    return true;
  }

  bool isSuccess() const override {
    return all_reduce_->isSuccess();
  }

  std::exception_ptr exception() const override {
    return all_reduce_->exception();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    all_reduce_->wait(timeout);  // raises when the timeout runs out, or the op failed
    copy_out();
    return true;
  }

  // The all-reduce: it ends when the transfer does.
  const c10::intrusive_ptr<c10d::Work>& all_reduce() const {
    return all_reduce_;
  }

 private:
  void copy_out() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!copied_) {
      if (plain_pair(output_, sum_) && sum_.numel() == output_.numel() * size_) {  // this rank's block of the sum
        std::memcpy(output_.data_ptr(), static_cast<const char*>(sum_.const_data_ptr()) + rank_ * output_.nbytes(),
                    output_.nbytes());
      } else {
        output_.copy_(sum_.chunk(size_)[rank_]);
      }
      copied_ = true;
    }
  }

  c10::intrusive_ptr<c10d::Work> all_reduce_;
  at::Tensor sum_;
  at::Tensor output_;
  int64_t rank_;
  int64_t size_;
  std::mutex mutex_;
  bool copied_ = false;
};

// The staging buffers of write isolation whose ops completed, for the next op of
// the same dtype and shape: a fresh buffer costs its page faults at every op,
// several times the copy (docs/bench/async-path.md).  A buffer whose op did not
// complete is never handed back: the backend may still write into it.
// Let go of Python objects from code that may not hold the GIL: with the GIL, or,
// while the interpreter ends, not at all (the OS takes them back at exit).
template <typename... Objects>
void drop_python(Objects&... objects) {
  if (Py_IsInitialized() && !_Py_IsFinalizing()) {
    py::gil_scoped_acquire gil;
    ((objects = Objects()), ...);
  } else {
    (objects.release(), ...);
  }
}

// A new contiguous tensor of `like`'s dtype, shape and device.
at::Tensor contiguous_like(const at::Tensor& like) {
  return at::empty(like.sizes(), like.options().memory_format(c10::MemoryFormat::Contiguous));
}

class StagingPool {
 public:
  static constexpr size_t kMaxBytes = size_t{64} << 20;  // kept in all: a larger buffer pays its faults each op

  // A buffer like `like` (contiguous, its dtype, shape and device), kept or new.
  at::Tensor take(const at::Tensor& like) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->scalar_type() == like.scalar_type() && it->sizes() == like.sizes() &&
            it->device() == like.device()) {
          at::Tensor kept = std::move(*it);
          free_.erase(it);
          bytes_ -= kept.nbytes();
          return kept;
        }
      }
    }
    return contiguous_like(like);
  }

  // The buffer of an op that completed and whose result was copied out.
  void give(at::Tensor buffer) {
    if (buffer.nbytes() > kMaxBytes) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_ += buffer.nbytes();
    free_.push_back(std::move(buffer));
    while (bytes_ > kMaxBytes) {  // the oldest go first
      bytes_ -= free_.front().nbytes();
      free_.erase(free_.begin());
    }
  }

 private:
  std::mutex mutex_;
  std::vector<at::Tensor> free_;
  size_t bytes_ = 0;  // of the buffers in free_
};

// The process's op ids (records, settle_native_async's registry): one series for the
// ops Python issues (DirectPath.next_op_id) and those GroupBackend issues without it.
std::atomic<int64_t> next_op_id{1};

// The Python function that settles an async op whose wait did not simply
// complete (commslayer.comm.op_path.settle_native_async): set once by the
// module's set_settle and never freed, since a work may need it while the
// interpreter ends.
py::object* settle_function = nullptr;
// What it returns: the op still runs; it completed; it failed and a held group took the error.
enum SettleOutcome : int { kSettleRunning = 0, kSettleCompleted = 1, kSettleHeld = 2 };

struct PathShared;

// An async all_reduce, all_gather_single or reduce_scatter_single issued by
// DirectPath.issue_async: what c10d's callers (torch.distributed's async ops,
// DDP's reducer, FSDP2) get back, with the op's deadline.  A wait that
// completes runs no Python.  One that does not (the deadline, a slice of it
// or the caller's timeout ran out, or the backend failed) hands the op to
// Python (settle_native_async), which settles it as the general path's Work
// would: it waits on in slices while a liveness monitor may break the
// communicator, classifies the error, marks the communicator broken, and
// raises the CommError, which this work keeps for later waits.  The
// communicator's watchdog sweeps the works nobody waits on (DirectPath.sweep).
class AsyncOpWork : public c10d::Work {
 public:
  enum Settled : int { kRunning = 0, kSettling = 1, kDone = 2, kFailed = 3 };

  // output: the caller's tensor; staged: the copy the backend writes instead (write
  // isolation; undefined: the backend writes output); divisor: AVG's, or 0; path:
  // what the issuing DirectPath shares with its ops.
  AsyncOpWork(c10::intrusive_ptr<c10d::Work> inner, int64_t key, int kind, int64_t op_id, int64_t seq,
              double timeout_s, std::chrono::milliseconds slice, at::Tensor output, at::Tensor staged,
              int64_t divisor, std::shared_ptr<PathShared> path)
      : inner_(std::move(inner)), key_(key), kind_(kind), op_id_(op_id), seq_(seq), timeout_s_(timeout_s),
        slice_(slice), output_(std::move(output)), staged_(std::move(staged)), divisor_(divisor),
        path_(std::move(path)) {
    start_ns_ = monotonic_ns();
    deadline_ns_ = start_ns_ + static_cast<int64_t>(timeout_s * 1e9);
  }

  ~AsyncOpWork() override {
    if (error_) {
      drop_python(error_);
    }
  }

  // The op's id, sequence number and issue time, for the Python Work that wraps it (NativeWork).
  int64_t op_id() const {
    return op_id_;
  }

  int64_t seq() const {
    return seq_;
  }

  int64_t start_ns() const {
    return start_ns_;
  }

  // Where the op's record is (a NativeRing's slot, kept alive by its DirectPath), or null.
  void record_in(Slot* slot) {
    slot_ = slot;
  }

  // Done (a failed op too); a caller may read the outputs of one that succeeded,
  // so its finish step runs first.
  bool isCompleted() override {
    if (settled_.load() >= kDone) {
      return true;
    }
    if (!inner_->isCompleted()) {
      return false;
    }
    if (settled_.load() == kRunning && inner_->isSuccess()) {
      finish();
    }
    return true;
  }

  bool isSuccess() const override {
    int settled = settled_.load();
    if (settled == kDone) {
      return !held_.load();
    }
    if (settled == kFailed || !inner_->isSuccess()) {
      return false;
    }
    finish();
    return true;
  }

  std::exception_ptr exception() const override {
    return inner_->exception();
  }

  std::vector<at::Tensor> result() override {
    return output_.defined() ? std::vector<at::Tensor>{output_} : inner_->result();  // not a staging buffer
  }

  // Block until the op is done (timeout: the caller's bound, 0 for none); raise
  // its CommError if it failed.
  bool wait(std::chrono::milliseconds timeout) override {
    int64_t began_ns = slot_ != nullptr ? monotonic_ns() : 0;  // only a record reads it
    if (settled_.load() == kDone) {
      recorded(began_ns, false);
      return true;
    }
    int64_t left_ns = left(timeout);
    if (settled_.load() == kRunning) {
      auto first = std::chrono::milliseconds(std::max<int64_t>(1, left_ns / 1000000));  // 0: forever, for c10d
      if (slice_.count() > 0) {
        first = std::min(first, slice_);
      }
      try {
        inner_->wait(first);
        finish();
        int running = kRunning;
        settled_.compare_exchange_strong(running, kDone);
        recorded(began_ns, true);
        leave_in_flight();  // last: it may let go of this work
        return true;
      } catch (const std::exception&) {
        left_ns = left(timeout);  // Python settles the op from here
      }
    }
    py::gil_scoped_acquire gil;
    settle(static_cast<double>(left_ns) / 1e9, true);
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    c10::intrusive_ptr<c10::ivalue::Future> inner = inner_->getFuture();
    c10::intrusive_ptr<AsyncOpWork> self = c10::intrusive_ptr<AsyncOpWork>::reclaim_copy(this);
    return inner->then(
        [self](c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) {
            // The backend marks its future failed before its work: Python is told the
            // error here, or it would find the work still running and settle nothing.
            std::string what = "the backend's future failed";
            try {
              std::rethrow_exception(done.exception_ptr());
            } catch (const std::exception& e) {
              what = e.what();
            } catch (...) {
            }
            py::gil_scoped_acquire gil;
            self->settle(0.0, true, py::str(what));  // raises the op's CommError into the future
            return self->outputs();  // unless a held group took it: done, its outputs as they are
          }
          self->finish();
          int running = kRunning;
          self->settled_.compare_exchange_strong(running, kDone);
          if (self->slot_ != nullptr) {
            NativeRing::completed(*self->slot_, self->op_id_, monotonic_ns());
          }
          return self->output_.defined() ? self->outputs() : done.value();
        },
        inner->elementType());
  }

  // Whether the op completed (without running Python to find out), its finish step run.
  bool completed() {
    int settled = settled_.load();
    if (settled == kDone) {
      return true;
    }
    if (settled != kRunning || !inner_->isCompleted() || !inner_->isSuccess()) {
      return false;
    }
    finish();
    return true;
  }

  // The watchdog's look (GIL held): settle the op if it failed, is overdue, or its
  // communicator broke (broken); true once it needs no more looks.
  bool sweep(int64_t now_ns, bool broken) {
    if (settled_.load() != kRunning) {
      return settled_.load() != kSettling;
    }
    if (inner_->isCompleted()) {
      if (inner_->isSuccess()) {
        finish();  // nobody may wait: the caller's tensors get the result all the same
        if (slot_ != nullptr) {
          NativeRing::completed(*slot_, op_id_, now_ns);  // ended by now; its wait, if any, completes it
        }
        return true;
      }
    } else if (now_ns < deadline_ns_ && !broken) {
      return false;
    }
    settle(0.0, false);
    return settled_.load() >= kDone;
  }

 private:
  // The step between the backend's success and the caller's: the staged result
  // copied into the caller's tensor, AVG's division; once, whoever comes first.
  void finish() const;  // below PathShared, whose pool takes the staging copy back
  void leave_in_flight();

  // What the backend's future holds, with the caller's tensor where the backend had a copy.
  c10::IValue outputs() const {
    return c10::IValue(std::vector<at::Tensor>{output_.defined() ? output_ : inner_->result().at(0)});
  }

  // A wait that began at began_ns returned now: the record says so (and that
  // the op completed, with ended).
  void recorded(int64_t began_ns, bool ended) {
    if (slot_ != nullptr) {
      int64_t end_ns = monotonic_ns();
      NativeRing::waited(*slot_, op_id_, began_ns, end_ns);
      if (ended) {
        NativeRing::completed(*slot_, op_id_, end_ns);
      }
    }
  }

  // Nanoseconds a wait has left: to the op's deadline, or the caller's timeout if sooner.
  int64_t left(std::chrono::milliseconds timeout) const {
    int64_t left_ns = deadline_ns_ - monotonic_ns();
    if (timeout.count() > 0) {
      left_ns = std::min<int64_t>(left_ns, timeout.count() * 1000000);
    }
    return left_ns;
  }

  // Hand the op to Python (GIL held), once: another thread settling it
  // meanwhile is waited for.  raise: raise the op's error (a wait), else keep it (the watchdog).
  // failure: the backend's error, where its future failed (else None).
  void settle(double wait_left_s, bool raise, py::object failure = py::none()) {
    int running = kRunning;
    if (settled_.compare_exchange_strong(running, kSettling)) {
      int outcome = kRunning;  // Python may find the op still running (the watchdog's look at a broken group)
      try {
        int done = (*settle_function)(key_, kind_, op_id_, seq_, start_ns_, timeout_s_,
                                      py::cast(inner_), wait_left_s, failure).cast<int>();
        if (done == kSettleCompleted) {
          finish();
        }
        held_.store(done == kSettleHeld);
        outcome = done == kSettleRunning ? kRunning : kDone;
      } catch (py::error_already_set& e) {
        error_ = e.value();
        outcome = kFailed;
      }
      settled_.store(outcome);
      if (outcome == kRunning) {
        return;
      }
    } else {
      py::gil_scoped_release no_gil;
      while (settled_.load() == kSettling) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    if (settled_.load() == kFailed && raise) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error_.ptr())), error_.ptr());
      throw py::error_already_set();
    }
  }

  c10::intrusive_ptr<c10d::Work> inner_;
  int64_t key_;  // the communicator's, in settle_native_async's registry
  int kind_;
  int64_t op_id_;
  int64_t seq_;
  double timeout_s_;
  std::chrono::milliseconds slice_;  // 0: waits block to the deadline
  int64_t start_ns_ = 0;
  int64_t deadline_ns_ = 0;
  std::atomic<int> settled_{kRunning};
  py::object error_;  // the CommError of a failed op (kFailed)
  Slot* slot_ = nullptr;  // its record, or null
  at::Tensor output_;  // undefined: no finish step
  at::Tensor staged_;
  int64_t divisor_;
  mutable std::mutex finish_mutex_;
  mutable bool finished_ = false;
  std::atomic<bool> held_{false};  // it failed, and a held group took the error
  std::shared_ptr<PathShared> path_;
};

// What a DirectPath shares with its async ops: the staging buffers they hand
// back, and the ops not yet seen to end, which the watchdog sweeps.  An op a wait
// saw end leaves that list at once, so the caller that drops it frees it then, as
// c10d's callers free Gloo's work, and not the next issue, an op later, when
// what it touches has left the cache (docs/bench/async-path.md).
struct PathShared {
  StagingPool staging;
  std::mutex in_flight_mutex;  // GroupBackend issues without the GIL
  std::deque<c10::intrusive_ptr<AsyncOpWork>> in_flight;
};

void AsyncOpWork::finish() const {
  if (!output_.defined()) {
    return;
  }
  std::lock_guard<std::mutex> lock(finish_mutex_);
  if (finished_) {
    return;
  }
  at::NoGradGuard no_grad;
  at::Tensor output = output_;
  if (divisor_ != 0) {
    divide_into(output, staged_.defined() ? staged_ : output, divisor_);  // what copy_ then div_ gives
  } else {
    copy_into(output, staged_);
  }
  finished_ = true;
  if (staged_.defined() && kind_ != kReduceScatter) {
    path_->staging.give(staged_);  // its op completed: the backend is done with it
  }
}

void AsyncOpWork::leave_in_flight() {
  c10::intrusive_ptr<AsyncOpWork> listed;  // let go of after the lock
  std::lock_guard<std::mutex> lock(path_->in_flight_mutex);
  auto& works = path_->in_flight;
  if (!works.empty() && works.back().get() == this) {  // waited on as soon as issued
    listed = std::move(works.back());
    works.pop_back();
  } else if (!works.empty() && works.front().get() == this) {  // the oldest: waited on in issue order
    listed = std::move(works.front());
    works.pop_front();
  }  // else the next issues or the sweep let go of it
}

// One communicator's direct path: its backend, what a tensor must be to take
// it, and the deadline its option structs carry.
class DirectPath {
 public:
  // What the options of an async op c10d asked for leave this path to do: a sum (an
  // all-gather counts as one), an average (a sum, then divided: Gloo has no AVG), or
  // nothing (another reduce op, or a timeout of their own).
  enum Reduction : int { kNotPlain = 0, kSum = 1, kAverage = 2 };

  static Reduction reduction_of(const c10d::ReduceOp& op, std::chrono::milliseconds timeout) {
    if (timeout != c10d::kUnsetTimeout) {
      return kNotPlain;
    }
    return op.op_ == c10d::ReduceOp::SUM ? kSum : op.op_ == c10d::ReduceOp::AVG ? kAverage : kNotPlain;
  }

  DirectPath(
      c10::intrusive_ptr<c10d::Backend> backend,
      int64_t size,
      const std::string& device_type,
      const std::vector<at::ScalarType>& dtypes,
      const std::vector<int>& untimed,
      py::object ids,
      std::chrono::duration<double> timeout,
      std::chrono::milliseconds wait)
      : backend_(std::move(backend)),
        size_(size),
        device_type_(c10::Device(device_type).type()),
        ids_(std::move(ids)) {
    for (auto dtype : dtypes) {
      dtypes_ |= uint64_t{1} << static_cast<int>(dtype);
    }
    rank_ = backend_->getRank();
    for (int kind : untimed) {
      if (kind != kReduceScatter) {
        throw std::invalid_argument("only the reduce-scatter runs as an all-reduce, not kind " + std::to_string(kind));
      }
      untimed_ |= 1u << kind;
    }
    set_timeout(timeout, wait);
  }

  // A backend's destructor may block on its own threads, and those may need the
  // GIL (a future's Python callback): let go of the backend without it, as
  // torch's bindings do for theirs.
  // A GroupBackend's issue may drop the last reference, on a thread without the
  // GIL: the Python objects are let go of with it.
  ~DirectPath() {
    {
      std::optional<py::gil_scoped_release> released;
      if (PyGILState_Check()) {
        released.emplace();
      }
      backend_.reset();
      forget_in_flight();
    }
    for (auto& ring : retired_rings_) {
      drop_python(ring);
    }
    drop_python(ids_, ring_object_);
  }

  DirectPath(const DirectPath&) = delete;
  DirectPath& operator=(const DirectPath&) = delete;

  // The op's deadline (in the backend's option structs) and how long one wait
  // blocks: the whole deadline, or a slice when a liveness monitor may break
  // the communicator meanwhile.  Set as the communicator is built, before its
  // ops, and when its deadline changes (Communicator.set_timeout), not while
  // GroupBackend issues.
  void set_timeout(std::chrono::duration<double> timeout, std::chrono::milliseconds wait) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
    allreduce_.timeout = ms;
    allreduce_min_.timeout = ms;
    allgather_.timeout = ms;
    reduce_scatter_.timeout = ms;
    timeout_s_ = timeout.count();
    wait_ = wait;
    slice_ = wait < ms ? wait : std::chrono::milliseconds(0);
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

  // The communicator's key in settle_native_async's registry, given to its async ops.
  void set_key(int64_t key) {
    key_ = key;
  }

  // Whether async ops write into staging copies (commslayer.comm.isolation's rule).
  void set_isolate(bool isolate) {
    isolate_.store(isolate);
  }

  // Whether GroupBackend may issue c10d's async ops here: Python's conditions for
  // the native async path hold (no hook observes, the communicator is clean).
  void set_open(bool open) {
    open_.store(open);
  }

  // The input size from which a reduce-scatter takes the ring instead (-1: never): those go to Python.
  void set_ring_from(int64_t bytes) {
    ring_from_.store(bytes);
  }

  // The communicator's collectives so far, and the next one's number: counted here
  // so that GroupBackend numbers its ops without Python (Communicator._seq).
  int64_t seq() const {
    return seq_.load();
  }

  int64_t next_seq() {
    return seq_.fetch_add(1) + 1;
  }

  void set_seq(int64_t seq) {
    seq_.store(seq);
  }

  // Where run records its ops (a NativeRing), or None: the flight recorder sets it.
  void record_into(py::object ring) {
    if (ring_.load() != nullptr) {
      retired_rings_.push_back(ring_object_);  // async ops in flight may still write into it
    }
    NativeRing* native = ring.is_none() ? nullptr : ring.cast<NativeRing*>();
    if (native != nullptr) {
      native->hold(ids_);
    }
    ring_.store(native);
    ring_object_ = std::move(ring);
  }

  // An async op of the communicator's own API (Communicator._native_async, GIL
  // held): DIRECT_OPS[kind] (a: the output, b: the input; all_reduce passes its one
  // tensor as both) with the reduction opts asks for, as issue does; None where
  // this path does not take it.
  py::object issue_async(int kind, py::handle a, py::handle b, py::handle opts) {
    const at::Tensor* output = tensor(a);
    const at::Tensor* input = a.ptr() == b.ptr() ? output : tensor(b);
    if (output == nullptr || input == nullptr) {
      return py::none();
    }
    c10::intrusive_ptr<AsyncOpWork> work = issue_async_op(kind, *output, *input, plain_options(kind, opts), true);
    if (!work) {
      return py::none();
    }
    return py::cast(work);
  }

  // The async op a caller of c10d asked for (GroupBackend, or issue_async): issue
  // DIRECT_OPS[kind] with the communicator's deadline as its next op, and return its
  // AsyncOpWork; null when the op is not one this path takes (the path is closed,
  // a tensor does not fit, a reduction other than a sum or an average of
  // floating-point tensors, a reduce-scatter that takes the ring).  gil: whether
  // the caller holds the GIL.  With write isolation the backend writes a staging
  // copy.  An all_reduce whose output is not its input reads the input and writes
  // only the output (Collectives._all_reduce_into).
  c10::intrusive_ptr<AsyncOpWork> issue_async_op(int kind, const at::Tensor& output, const at::Tensor& input,
                                                 Reduction reduction, bool gil) {
    if (!open_.load() || settle_function == nullptr || !fits_async(kind, output, input, reduction)) {
      return {};
    }
    int64_t ring_from = ring_from_.load();
    if (kind == kReduceScatter && ring_from >= 0 && static_cast<int64_t>(input.nbytes()) >= ring_from) {
      return {};  // Python decides whether it takes the ring
    }
    int64_t seq = next_seq();
    int64_t op_id = next_op_id.fetch_add(1);
    NativeRing* ring = ring_.load();
    Slot* slot = ring == nullptr ? nullptr
                                 : ring->begin(op_id, seq, kind, output, input, ids_.ptr(), timeout_s_, true, gil);
    c10::intrusive_ptr<c10d::Work> inner;
    at::Tensor staged;  // write isolation: the backend writes a copy, the caller's tensor gets it on success
    {
      std::optional<py::gil_scoped_release> released;
      if (gil) {
        released.emplace();
      }
      if (isolate_.load()) {
        // Not pooled: Gloo's reduce-scatter copies this rank's slice out in its wait,
        // which may come after the finish step (a poll ran it first).
        staged = kind == kReduceScatter ? at::empty_like(output) : shared_->staging.take(output);
        if (kind == kAllReduce) {
          copy_into(staged, input);  // all_reduce reads it first
        }
      } else if (kind == kAllReduce && !input.is_same(output)) {
        at::Tensor reduced = output;
        copy_into(reduced, input);  // reduced in place, in the output
      }
      inner = issue(kind, staged.defined() ? staged : output, input);
    }
    if (slot != nullptr) {
      record_end(inner, slot, op_id);
    }
    bool finishes = staged.defined() || reduction == kAverage;
    auto work = c10::make_intrusive<AsyncOpWork>(std::move(inner), key_, kind, op_id, seq, timeout_s_, slice_,
                                                 finishes ? output : at::Tensor(), staged,
                                                 reduction == kAverage ? size_ : 0, shared_);
    work->record_in(slot);
    // Freeing an op may take the GIL (its tensors' Python objects), and the
    // watchdog's sweep may run meanwhile: the ended ones are freed here, out of
    // the list's lock.  Two of the oldest at most (no wait saw them end), the sweep frees the rest.
    c10::intrusive_ptr<AsyncOpWork> ended[2];
    {
      std::lock_guard<std::mutex> lock(shared_->in_flight_mutex);
      auto& works = shared_->in_flight;
      for (auto& one : ended) {
        if (works.empty() || !works.front()->completed()) {
          break;
        }
        one = std::move(works.front());
        works.pop_front();
      }
      works.push_back(work);
    }
    return work;
  }

  // The watchdog's sweep (GIL held): settle the async ops that failed, are overdue,
  // or whose communicator broke (broken); let go of those that ended.  How many are left.
  size_t sweep(int64_t now_ns, bool broken) {
    // Settling runs Python, and freeing an op may let go of the GIL: either lets
    // another thread issue an op meanwhile, so the sweep works on the ops issued
    // so far, taken out of the list, and frees those that ended (swept) once
    // the list is whole again.
    std::deque<c10::intrusive_ptr<AsyncOpWork>> swept;
    {
      std::lock_guard<std::mutex> lock(shared_->in_flight_mutex);
      swept.swap(shared_->in_flight);
    }
    std::deque<c10::intrusive_ptr<AsyncOpWork>> kept;
    for (auto& work : swept) {
      if (!work->sweep(now_ns, broken)) {
        kept.push_back(work);
      }
    }
    std::lock_guard<std::mutex> lock(shared_->in_flight_mutex);
    auto& works = shared_->in_flight;
    kept.insert(kept.end(), works.begin(), works.end());
    works.swap(kept);
    return works.size();
  }

  // Issue op op_id, number seq, and wait for it, without the GIL; with a ring
  // and an op_id (not 0), its record goes into the ring.  None once it
  // completed; (backend work, message) when the wait raised (the deadline, or
  // a slice of it, ran out, or the backend failed): the caller settles the op,
  // and takes its record over (NativeRing.take).  An error of the issue itself
  // propagates as the backend's exception.  The caller has checked the tensors
  // (fits, fits_sized).
  py::object run(int kind, py::handle a, py::handle b, int64_t op_id, int64_t seq) {
    const at::Tensor& first = THPVariable_Unpack(a.ptr());
    const at::Tensor& second = THPVariable_Unpack(b.ptr());
    NativeRing* ring = op_id != 0 ? ring_.load() : nullptr;
    Slot* slot = ring == nullptr ? nullptr
                                 : ring->begin(op_id, seq, kind, first, second, ids_.ptr(), timeout_s_, false, true);
    int64_t end_ns = 0;
    py::object failed = issue_and_wait(kind, first, second, &end_ns);
    if (slot != nullptr && failed.is_none()) {
      NativeRing::completed(*slot, op_id, end_ns);
    }
    return failed;
  }

 private:
  const at::Tensor* tensor(py::handle t) const {
    if (!THPVariable_CheckExact(t.ptr())) {
      return nullptr;
    }
    const at::Tensor& tensor = THPVariable_Unpack(t.ptr());
    return fits_tensor(tensor) ? &tensor : nullptr;
  }

  // A dense, contiguous tensor on the group's device type, of a dtype it carries,
  // that no Python subclass dispatches.
  bool fits_tensor(const at::Tensor& t) const {
    return t.layout() == c10::kStrided && t.device().type() == device_type_ &&
        ((dtypes_ >> static_cast<int>(t.scalar_type())) & 1) && t.is_contiguous() &&
        !t.unsafeGetTensorImpl()->is_python_dispatch();
  }

  // Whether an async op's tensors fit this path: both fit, and an all_reduce's have
  // one dtype and shape; a gather's or scatter's one dtype, the big one size times the small.
  bool fits_async(int kind, const at::Tensor& output, const at::Tensor& input, Reduction reduction) const {
    if (reduction == kNotPlain || (reduction == kAverage && !output.is_floating_point() && !output.is_complex())) {
      return false;  // an integer AVG truncates: the general path
    }
    if (!fits_tensor(output) || (!input.is_same(output) && !fits_tensor(input))) {
      return false;
    }
    if (kind == kAllReduce) {
      return input.scalar_type() == output.scalar_type() && input.sizes() == output.sizes();
    }
    const at::Tensor& big = kind == kAllGather ? output : input;
    const at::Tensor& small = kind == kAllGather ? input : output;
    return big.scalar_type() == small.scalar_type() && big.numel() == small.numel() * size_;
  }

  // The record of async op op_id (in slot) takes the time the transfer ends, from
  // the backend's completion callback, as the general path's records do; a work
  // without a future (Gloo's own reduce-scatter) records its end when waited on.
  static void record_end(const c10::intrusive_ptr<c10d::Work>& work, Slot* slot, int64_t op_id) {
    auto* scatter = dynamic_cast<AllReduceScatterWork*>(work.get());
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = (scatter != nullptr ? scatter->all_reduce() : work)->getFuture();
    } catch (const std::exception&) {
      return;
    }
    future->addCallback([slot, op_id](c10::ivalue::Future& done) {
      if (!done.hasError()) {
        NativeRing::completed(*slot, op_id, monotonic_ns());
      }
    });
  }

  static Reduction plain_options(int kind, py::handle opts) {
    switch (kind) {
      case kAllReduce: {
        if (!py::isinstance<c10d::AllreduceOptions>(opts)) {
          return kNotPlain;
        }
        const auto& o = opts.cast<const c10d::AllreduceOptions&>();
        return reduction_of(o.reduceOp, o.timeout);
      }
      case kAllGather: {
        if (!py::isinstance<c10d::AllgatherOptions>(opts)) {
          return kNotPlain;
        }
        return opts.cast<const c10d::AllgatherOptions&>().timeout == c10d::kUnsetTimeout ? kSum : kNotPlain;
      }
      case kReduceScatter: {
        if (!py::isinstance<c10d::ReduceScatterOptions>(opts)) {
          return kNotPlain;
        }
        const auto& o = opts.cast<const c10d::ReduceScatterOptions&>();
        return reduction_of(o.reduceOp, o.timeout);
      }
      default:
        return kNotPlain;
    }
  }

  // The body of run: end_ns gets the time the wait returned.
  py::object issue_and_wait(int kind, const at::Tensor& first, const at::Tensor& second, int64_t* end_ns) {
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
      *end_ns = monotonic_ns();
    }  // a completed work is released here, without the GIL
    if (!failed) {
      return py::none();
    }
    return py::make_tuple(py::cast(std::move(failed)), py::str(failure));
  }

  // Let go of the async ops still listed, which hold shared_ back: as the path goes.
  void forget_in_flight() {
    std::deque<c10::intrusive_ptr<AsyncOpWork>> works;
    std::lock_guard<std::mutex> lock(shared_->in_flight_mutex);
    works.swap(shared_->in_flight);
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
      case kMinAllReduce: {
        std::vector<at::Tensor> tensors{first};
        return backend_->allreduce(tensors, allreduce_min_);
      }
      case kReduceScatter: {
        if ((untimed_ >> kind) & 1) {
          at::Tensor sum = contiguous_like(second);
          copy_into(sum, second);
          std::vector<at::Tensor> tensors{sum};
          return c10::make_intrusive<AllReduceScatterWork>(backend_->allreduce(tensors, allreduce_), sum, first,
                                                           rank_, size_);
        }
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
  unsigned untimed_ = 0;  // a bit per kind that runs as AllReduceScatterWork
  int64_t rank_ = 0;
  c10d::AllreduceOptions allreduce_;  // reduceOp: SUM, the default
  c10d::AllreduceOptions allreduce_min_{c10d::ReduceOp::MIN};
  c10d::AllgatherOptions allgather_;
  c10d::ReduceScatterOptions reduce_scatter_;
  std::chrono::milliseconds wait_{0};
  std::chrono::milliseconds slice_{0};  // an async op's wait slice: wait_ where it is one, else 0
  int64_t key_ = 0;  // this communicator's in settle_native_async's registry (set_key)
  std::atomic<bool> isolate_{false};  // async ops write into staging copies (set_isolate)
  std::atomic<bool> open_{false};  // GroupBackend may issue here (set_open)
  std::atomic<int64_t> ring_from_{-1};  // set_ring_from
  std::atomic<int64_t> seq_{0};  // the communicator's collectives so far
  // Its async ops hold it too; the ops in its list hold it back, until forget_in_flight.
  std::shared_ptr<PathShared> shared_ = std::make_shared<PathShared>();
  double timeout_s_ = 0;  // the deadline, as the records give it
  py::object ids_;  // the communicator's (name, uid, generation), for the records
  std::atomic<NativeRing*> ring_{nullptr};  // where ops record, kept alive by ring_object_
  py::object ring_object_;
  std::vector<py::object> retired_rings_;  // rings recorded into before, kept for the async ops' slots
};

// A Python Work (commslayer.comm.process_group.C10dWork) as a c10d Work, for the
// ops GroupBackend hands to Python: every virtual a caller of c10d may use goes
// to the Python object, with the GIL (torch's own holder forwards only wait and
// get_future).
class PythonWork : public c10d::Work {
 public:
  explicit PythonWork(py::object work) : work_(std::move(work)) {}

  ~PythonWork() override {
    drop_python(work_);
  }

  bool isCompleted() override {
    py::gil_scoped_acquire gil;
    return work_.attr("is_completed")().cast<bool>();
  }

  bool isSuccess() const override {
    py::gil_scoped_acquire gil;
    return work_.attr("is_success")().cast<bool>();
  }

  std::exception_ptr exception() const override {
    py::gil_scoped_acquire gil;
    py::object error = work_.attr("exception")();
    if (error.is_none()) {
      return nullptr;
    }
    return std::make_exception_ptr(std::runtime_error(py::str(error).cast<std::string>()));
  }

  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return work_.attr("_source_rank")().cast<int>();
  }

  std::vector<at::Tensor> result() override {
    py::gil_scoped_acquire gil;
    return work_.attr("result")().cast<std::vector<at::Tensor>>();
  }

  bool wait(std::chrono::milliseconds timeout) override {
    py::gil_scoped_acquire gil;
    py::object bound = timeout.count() > 0 ? py::cast(timeout) : py::none();
    return work_.attr("wait")(bound).cast<bool>();
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    py::gil_scoped_acquire gil;
    return work_.attr("get_future")().cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
  }

 private:
  py::object work_;
};

// A commslayer group's backend, registered on c10d's own ProcessGroup for each
// of its device types (commslayer/comm/process_group.py): what torch.distributed's
// calls and C++ callers (DDP's reducer, FSDP2) reach through c10d's dispatcher.
// The async all_reduce, all_gather_single and reduce_scatter_single that the CPU
// communicator's direct path takes are issued here without a line of Python
// (DirectPath::issue_async_op); every other op, and those where the path is
// closed, go to the group's Python ops with the GIL (CommslayerGroup), their
// Work a PythonWork.  The few ops commslayer does not carry go to c10d's backend
// of the tensors' device (inners: the first communicators' backends), as c10d
// would send them.
class GroupBackend : public c10d::Backend {
 public:
  GroupBackend(int rank, int size, py::object ops,
               const std::map<std::string, c10::intrusive_ptr<c10d::Backend>>& inners)
      : c10d::Backend(rank, size), ops_(std::move(ops)) {
    for (const auto& [device_type, backend] : inners) {
      inners_.emplace_back(c10::Device(device_type).type(), backend);
    }
  }

  ~GroupBackend() override {
    drop_python(ops_);
    std::optional<py::gil_scoped_release> released;  // a backend's destructor may need the GIL on its threads
    if (PyGILState_Check()) {
      released.emplace();
    }
    inners_.clear();
  }

  const std::string getBackendName() const override {
    return "commslayer";
  }

  // The group's Python ops (CommslayerGroup), for commslayer's helpers.
  py::object ops() const {
    return ops_;
  }

  // The CPU communicator's direct path, which issues the native ops (a DirectPath,
  // or None: every op goes to Python).  Held weakly: a communicator that let go of
  // its path (it was retired) has none.
  void set_path(const std::shared_ptr<DirectPath>& path) {
    std::lock_guard<std::mutex> lock(path_mutex_);
    path_ = path;
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    if (tensors.size() == 1) {
      if (auto work = native(kAllReduce, tensors[0], tensors[0], opts.reduceOp, opts.timeout)) {
        return work;
      }
    }
    return python("allreduce", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    if (auto work = native(kAllGather, output, input, c10d::ReduceOp::SUM, opts.timeout)) {
      return work;
    }
    return python("_allgather_base", output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    if (auto work = native(kReduceScatter, output, input, opts.reduceOp, opts.timeout)) {
      return work;
    }
    return python("_reduce_scatter_base", output, input, opts);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override {
    return python("allreduce_coalesced", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    return python("allgather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override {
    return python("allgather_into_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    return python("reduce_scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override {
    return python("reduce_scatter_tensor_coalesced", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override {
    return python("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return python("broadcast", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override {
    return python("reduce", tensors, opts);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    return python("gather", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    return python("scatter", outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return python("barrier", opts);
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return python("send", tensors, dst, tag);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return python("recv", tensors, src, tag);
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return python("recv_anysource", tensors, tag);
  }

  // What commslayer does not carry, as c10d would have done it.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    return inner(inputs.at(0))->allgather_coalesced(outputs, inputs, opts);
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    return inner(inputs.at(0))->alltoall(outputs, inputs, opts);
  }

  // c10d sends it to the CPU backend whatever the group's devices (Gloo's alone has one).
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    inner(at::empty({0}))->monitoredBarrier(opts, wait_all_ranks);
  }

  void abort() override {
    py::gil_scoped_acquire gil;
    ops_.attr("abort")();
  }

  void shutdown() override {
    py::gil_scoped_acquire gil;
    ops_.attr("shutdown")();
  }

 private:
  const c10::intrusive_ptr<c10d::Backend>& inner(const at::Tensor& t) const {
    for (const auto& [device_type, backend] : inners_) {
      if (device_type == t.device().type()) {
        return backend;
      }
    }
    throw std::invalid_argument("the group has no backend for " + t.device().str() + " tensors");
  }

  c10::intrusive_ptr<c10d::Work> native(int kind, const at::Tensor& output, const at::Tensor& input,
                                        const c10d::ReduceOp& op, std::chrono::milliseconds timeout) {
    DirectPath::Reduction reduction = DirectPath::reduction_of(op, timeout);
    if (reduction == DirectPath::kNotPlain) {
      return {};
    }
    std::shared_ptr<DirectPath> path;
    {
      std::lock_guard<std::mutex> lock(path_mutex_);
      path = path_.lock();
    }
    if (!path) {
      return {};
    }
    return path->issue_async_op(kind, output, input, reduction, PyGILState_Check());
  }

  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> python(const char* method, Args&&... args) {
    py::gil_scoped_acquire gil;
    return c10::make_intrusive<PythonWork>(ops_.attr(method)(std::forward<Args>(args)...));
  }

  py::object ops_;
  std::vector<std::pair<c10::DeviceType, c10::intrusive_ptr<c10d::Backend>>> inners_;
  std::mutex path_mutex_;
  std::weak_ptr<DirectPath> path_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "commslayer's direct path in native code (commslayer/comm/native.py builds and loads it)";
  py::class_<NativeRing>(m, "NativeRing")
      .def(py::init<int64_t, py::dict, py::tuple, py::object, py::object>(), py::arg("capacity"),
           py::arg("thread_names"), py::arg("internal_paths"), py::arg("threading_file"), py::arg("current_thread"))
      .def("records_from", &NativeRing::records_from, py::arg("from"))
      .def_property_readonly("count", &NativeRing::count)
      .def_property_readonly("taken", &NativeRing::taken)
      .def_property("step", &NativeRing::step, &NativeRing::set_step)
      .def_property_readonly("raw_frames", &NativeRing::raw_frames)
      .def("records", &NativeRing::records)
      .def("take", &NativeRing::take, py::arg("op_id"))
      .def("abort", &NativeRing::abort, py::arg("uid"), py::arg("now_ns"), py::arg("error"));
  py::class_<AsyncOpWork, c10d::Work, c10::intrusive_ptr<AsyncOpWork>>(m, "AsyncOpWork")
      .def_property_readonly("op_id", &AsyncOpWork::op_id)
      .def_property_readonly("seq", &AsyncOpWork::seq)
      .def_property_readonly("start_ns", &AsyncOpWork::start_ns);
  m.def("set_settle", [](py::object fn) {
    if (settle_function == nullptr) {
      settle_function = new py::object();
    }
    *settle_function = std::move(fn);
  }, py::arg("fn"));
  py::class_<DirectPath, std::shared_ptr<DirectPath>>(m, "DirectPath")
      .def(
          py::init<c10::intrusive_ptr<c10d::Backend>, int64_t, const std::string&, const std::vector<at::ScalarType>&,
                   const std::vector<int>&, py::object, std::chrono::duration<double>, std::chrono::milliseconds>(),
          py::arg("backend"), py::arg("size"), py::arg("device_type"), py::arg("dtypes"), py::arg("untimed"), py::arg("ids"),
          py::arg("timeout"), py::arg("wait"))
      .def("set_timeout", &DirectPath::set_timeout, py::arg("timeout"), py::arg("wait"))
      .def("fits", &DirectPath::fits, py::arg("t"))
      .def("fits_sized", &DirectPath::fits_sized, py::arg("big"), py::arg("small"))
      .def("record_into", &DirectPath::record_into, py::arg("ring"))
      .def("set_key", &DirectPath::set_key, py::arg("key"))
      .def("set_isolate", &DirectPath::set_isolate, py::arg("isolate"))
      .def("issue_async", &DirectPath::issue_async, py::arg("kind"), py::arg("a"), py::arg("b"), py::arg("opts"))
      .def("set_open", &DirectPath::set_open, py::arg("open"))
      .def("set_ring_from", &DirectPath::set_ring_from, py::arg("bytes"))
      .def("seq", &DirectPath::seq)
      .def("next_seq", &DirectPath::next_seq)
      .def("set_seq", &DirectPath::set_seq, py::arg("seq"))
      .def_static("next_op_id", []() { return next_op_id.fetch_add(1); })
      .def_static("start_op_ids", [](int64_t first) { next_op_id.store(first); }, py::arg("first"))
      .def("sweep", &DirectPath::sweep, py::arg("now_ns"), py::arg("broken"))
      .def("run", &DirectPath::run, py::arg("kind"), py::arg("a"), py::arg("b"), py::arg("op_id"), py::arg("seq"));
  py::class_<PythonWork, c10d::Work, c10::intrusive_ptr<PythonWork>>(m, "PythonWork");
  py::class_<GroupBackend, c10d::Backend, c10::intrusive_ptr<GroupBackend>>(m, "GroupBackend")
      .def(py::init<int, int, py::object, const std::map<std::string, c10::intrusive_ptr<c10d::Backend>>&>(),
           py::arg("rank"), py::arg("size"), py::arg("ops"), py::arg("inners"))
      .def_property_readonly("ops", &GroupBackend::ops)
      .def("set_path", &GroupBackend::set_path, py::arg("path"));
}
