// A bound list of operator calls, run by one call from Python.
//
// The fast decode step (model/fast_decode.py) is ~140 calls of ops on tensors bound once per
// step shape. Called one by one from Python, each pays ~1.5-2 us of argument parsing and
// dispatch, ~0.25 ms a step of the 90m model: more than its norms, adds and rotary
// embeddings compute. Here the same calls, with the same arguments, go through the
// dispatcher's boxed path in a loop (~0.2 us each). Nothing is computed here: each entry is
// an existing operator (ours or ATen's), so the results are those of the Python loop.
#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/InferenceMode.h>

#include <string>
#include <utility>
#include <vector>

namespace {

struct CallProgram : torch::CustomClassHolder {
  std::vector<std::pair<c10::OperatorHandle, std::vector<c10::IValue>>> calls;

  // ``args``: a tuple of every argument of the schema, in its order (keyword-only ones and
  // defaults filled in by the caller, call_program.py).
  void add(const std::string& name, const std::string& overload, const c10::IValue& args) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    TORCH_CHECK(args.isTuple(), "CallProgram.add: args must be a tuple, got ", args.tagKind());
    const auto& elements = args.toTupleRef().elements();
    TORCH_CHECK(elements.size() == op.schema().arguments().size(), "CallProgram.add: ", name, " takes ",
                op.schema().arguments().size(), " arguments, got ", elements.size());
    calls.emplace_back(op, std::vector<c10::IValue>(elements.begin(), elements.end()));
  }

  void run() {
    c10::InferenceMode guard;  // no autograd bookkeeping: the Python loop ran under no_grad
    torch::jit::Stack stack;
    for (auto& [op, args] : calls) {
      stack.assign(args.begin(), args.end());
      op.callBoxed(stack);
      stack.clear();  // the ops here return nothing (out= / in place); drop what any returns
    }
  }

  int64_t size() const { return static_cast<int64_t>(calls.size()); }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(trainforge_cpu, m) {
  m.class_<CallProgram>("CallProgram")
      .def(torch::init<>())
      .def("add", &CallProgram::add)
      .def("run", &CallProgram::run)
      .def("size", &CallProgram::size);
}
