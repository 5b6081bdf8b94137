// A minimal reverse-mode autograd tape, shaped like PyTorch's.
// A Var holds a value and, when it was computed from Vars that require a gradient,
// the Node that computed it. backward(loss) runs only the nodes the loss reaches,
// accumulates leaf gradients, and leaves grad() undefined where no path exists:
// exactly what makes a PyTorch rank skip a backward collective.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"

namespace cpsim {

struct Node;

struct VarImpl {
  Tensor value;
  bool requires_grad = false;
  Tensor grad;                      // accumulated by backward(); leaves only
  std::shared_ptr<Node> grad_fn;    // null for leaves
};

class Var {
 public:
  Var() = default;
  explicit Var(Tensor value, bool requires_grad = false);

  bool defined() const { return impl_ != nullptr; }
  const Tensor& value() const { return impl_->value; }
  bool requires_grad() const { return impl_ && impl_->requires_grad; }
  // Undefined when backward() found no path from the loss to this leaf.
  const Tensor& grad() const { return impl_->grad; }
  void zero_grad() { impl_->grad = Tensor(); }
  const std::shared_ptr<VarImpl>& impl() const { return impl_; }

 private:
  std::shared_ptr<VarImpl> impl_;
};

// Maps the gradient of a node's output to one gradient per input (undefined = zero).
using BackwardFn = std::function<std::vector<Tensor>(const Tensor& grad_output)>;

struct Node {
  std::string name;
  std::vector<Var> inputs;
  BackwardFn backward;
  // Its gradients are zeros (an anchor's): they reach the inputs, so the inputs'
  // backward runs, but they are never added into another gradient's memory, only
  // applied as +0 (add_zero_inplace), which leaves a sparse gradient sparse.
  bool zero_gradients = false;
};

// Records `value = name(inputs)`; the result requires grad iff any input does.
// `zero_gradients`: what `backward` returns is zeros (Node::zero_gradients).
Var record(Tensor value, std::string name, std::vector<Var> inputs, BackwardFn backward,
           bool zero_gradients = false);

// Runs the reachable part of the tape from a scalar loss (seed gradient 1).
void backward(const Var& loss);

// Small differentiable helpers for building losses in tests and checks.
Var dot(const Var& x, const Tensor& weights);  // sum(x * weights), a scalar
Var add(const Var& a, const Var& b);            // same shape
Var constant_scalar(double v, DType dtype = DType::f64);

}  // namespace cpsim
