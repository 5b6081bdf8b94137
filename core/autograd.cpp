#include "core/autograd.hpp"

#include <unordered_map>
#include <unordered_set>

namespace cpsim {

Var::Var(Tensor value, bool requires_grad) : impl_(std::make_shared<VarImpl>()) {
  impl_->value = std::move(value);
  impl_->requires_grad = requires_grad;
}

Var record(Tensor value, std::string name, std::vector<Var> inputs, BackwardFn backward, bool zero_gradients) {
  bool needs = false;
  for (const auto& in : inputs) needs = needs || in.requires_grad();
  Var out(std::move(value), needs);
  if (needs) {
    auto node = std::make_shared<Node>();
    node->name = std::move(name);
    node->inputs = std::move(inputs);
    node->backward = std::move(backward);
    node->zero_gradients = zero_gradients;
    out.impl()->grad_fn = std::move(node);
  }
  return out;
}

void backward(const Var& loss) {
  CPSIM_ENFORCE(loss.defined() && loss.value().numel() == 1, "backward needs a scalar loss");
  if (!loss.requires_grad()) return;
  // Topological order of the non-leaf vars reachable from the loss (post-order DFS).
  std::vector<VarImpl*> order;
  std::unordered_set<VarImpl*> seen;
  std::vector<std::pair<VarImpl*, std::size_t>> stack{{loss.impl().get(), 0}};
  seen.insert(loss.impl().get());
  while (!stack.empty()) {
    auto& [v, next] = stack.back();
    const auto& inputs = v->grad_fn->inputs;
    if (next < inputs.size()) {
      VarImpl* in = inputs[next++].impl().get();
      if (in->grad_fn && in->requires_grad && seen.insert(in).second) stack.push_back({in, 0});
    } else {
      order.push_back(v);
      stack.pop_back();
    }
  }
  std::unordered_map<VarImpl*, Tensor> grads;
  grads[loss.impl().get()] = Tensor::full(loss.value().shape(), loss.value().dtype(), 1.0).to(loss.value().device());
  // A gradient no one else holds (an op's fresh result) is adopted. One that is
  // held elsewhere (an input, a capture, given twice) is copied into a leaf's
  // slot, and borrowed into an inner slot (whose node only reads it) until
  // something must be added to it. A later gradient is added to the slot, or the
  // slot to it when it is adopted: the same sums (addition commutes). A zero
  // gradient (Node::zero_gradients) fills an empty slot and is remembered as zero;
  // added to a slot, or a slot it filled added to it, it is +0 (add_zero_inplace):
  // the same bits as the sum, without writing the pages a sparse gradient never
  // touched.
  std::unordered_set<const Tensor*> zero_slots, borrowed;
  auto own = [&borrowed](Tensor& slot) {
    if (borrowed.erase(&slot)) slot = slot.clone();
  };
  // An empty slot takes g: adopted, else borrowed when it may be, else copied.
  auto fill = [&borrowed](Tensor& slot, Tensor&& g, bool may_borrow) {
    const bool adopt = g.sole_owner(), lend = !adopt && may_borrow;
    slot = adopt || lend ? std::move(g) : g.clone();
    if (lend) borrowed.insert(&slot);
  };
  auto accumulate = [&](Tensor& slot, Tensor&& g, bool zero, bool leaf) {
    const bool slot_zero = zero_slots.count(&slot) > 0;
    if (!slot.defined()) {
      fill(slot, std::move(g), !leaf);
      if (zero) zero_slots.insert(&slot);
    } else if (zero) {
      if (!slot_zero && has_negative_zero(slot)) {
        own(slot);
        add_zero_inplace(slot);
      }
    } else if (slot_zero) {
      zero_slots.erase(&slot);
      borrowed.erase(&slot);
      // Borrowed only when +0 changes nothing in it; what it owns takes the +0.
      fill(slot, std::move(g), !leaf && !g.sole_owner() && !has_negative_zero(g));
      if (!borrowed.count(&slot)) add_zero_inplace(slot);
    } else if (g.sole_owner() && g.device() == slot.device()) {
      add_inplace(g, slot);
      borrowed.erase(&slot);
      slot = std::move(g);
    } else {
      own(slot);
      add_inplace(slot, g);
    }
  };
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    VarImpl* v = *it;
    auto found = grads.find(v);
    if (found == grads.end()) continue;
    Tensor g = std::move(found->second);
    zero_slots.erase(&found->second);
    borrowed.erase(&found->second);
    grads.erase(found);
    const Node& node = *v->grad_fn;
    std::vector<Tensor> in_grads = node.backward(g);
    CPSIM_ENFORCE(in_grads.size() == node.inputs.size(), node.name, " returned ", in_grads.size(),
                  " gradients for ", node.inputs.size(), " inputs");
    for (std::size_t i = 0; i < in_grads.size(); ++i) {
      const auto& in = node.inputs[i].impl();
      if (!in->requires_grad || !in_grads[i].defined()) continue;
      CPSIM_ENFORCE(in_grads[i].shape() == in->value.shape(), node.name, " gradient ", i, " has shape ",
                    shape_str(in_grads[i].shape()), ", input has ", shape_str(in->value.shape()));
      const bool leaf = !in->grad_fn;
      accumulate(leaf ? in->grad : grads[in.get()], std::move(in_grads[i]), node.zero_gradients, leaf);
    }
  }
}

Var dot(const Var& x, const Tensor& weights) {
  CPSIM_ENFORCE(x.value().shape() == weights.shape(), "dot of ", shape_str(x.value().shape()),
                " and ", shape_str(weights.shape()));
  // The loss is a host scalar whatever device x is on (as .item() would give).
  const Tensor xv = x.value().is_cpu() ? x.value() : x.value().to(Device::host());
  const Tensor wv = weights.is_cpu() ? weights : weights.to(Device::host());
  double s = 0;  // left to right, in double, whatever the dtypes
  visit_dtype(xv.dtype(), [&](auto xt) {
    visit_dtype(wv.dtype(), [&](auto wt) {
      const auto* xp = reinterpret_cast<const decltype(xt)*>(xv.raw());
      const auto* wp = reinterpret_cast<const decltype(wt)*>(wv.raw());
      for (std::int64_t i = 0; i < wv.numel(); ++i) s += to_f64(xp[i]) * to_f64(wp[i]);
    });
  });
  Tensor out = Tensor::full({1}, x.value().dtype(), s);
  const DType dt = x.value().dtype();
  const Device device = x.value().device();
  return record(out, "dot", {x}, [wv, dt, device](const Tensor& g) {
    // The weights themselves when no conversion is needed (autograd copies a
    // gradient before it adds to it).
    const double scale = (g.is_cpu() ? g : g.to(Device::host())).get(0);
    Tensor gx = wv.dtype() == dt && scale == 1.0 ? wv : wv.to(dt);
    if (scale != 1.0)
      for (std::int64_t i = 0; i < gx.numel(); ++i) gx.set(i, gx.get(i) * scale);
    return std::vector<Tensor>{device.is_cpu() ? gx : gx.to(device)};
  });
}

Var add(const Var& a, const Var& b) {
  Tensor out = a.value().clone();
  add_inplace(out, b.value());
  return record(out, "add", {a, b}, [](const Tensor& g) { return std::vector<Tensor>{g, g}; });
}

Var constant_scalar(double v, DType dtype) { return Var(Tensor::full({1}, dtype, v), false); }

}  // namespace cpsim
