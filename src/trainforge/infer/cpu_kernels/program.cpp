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
  // defaults filled in by the caller, call_program.py), an empty list passed as None (Python's
  // conversion cannot type an empty list; the schema can).
  void add(const std::string& name, const std::string& overload, const c10::IValue& args) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    TORCH_CHECK(args.isTuple(), "CallProgram.add: args must be a tuple, got ", args.tagKind());
    const auto& elements = args.toTupleRef().elements();
    const auto& schema_args = op.schema().arguments();
    TORCH_CHECK(elements.size() == schema_args.size(), "CallProgram.add: ", name, " takes ", schema_args.size(),
                " arguments, got ", elements.size());
    std::vector<c10::IValue> bound(elements.begin(), elements.end());
    for (size_t i = 0; i < bound.size(); ++i)
      if (bound[i].isNone())
        if (auto list = schema_args[i].type()->cast<c10::ListType>())
          bound[i] = c10::impl::GenericList(list->getElementType());
    calls.emplace_back(op, std::move(bound));
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
