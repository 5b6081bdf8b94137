#include "python/torch_backend/reductions.hpp"

#include <iterator>

namespace cpsim::torch_backend {
namespace {

using R = c10d::ReduceOp;
using Takes = Reduction::Takes;

const Reduction kReductions[] = {
    {R::SUM, "SUM", Takes::any, [](at::Tensor& a, const at::Tensor& x) { a.add_(x); }},
    {R::AVG, "AVG", Takes::floating, [](at::Tensor& a, const at::Tensor& x) { a.add_(x); }, true},
    {R::PRODUCT, "PRODUCT", Takes::any, [](at::Tensor& a, const at::Tensor& x) { a.mul_(x); }},
    {R::MIN, "MIN", Takes::any, [](at::Tensor& a, const at::Tensor& x) { a = at::minimum(a, x); }},
    {R::MAX, "MAX", Takes::any, [](at::Tensor& a, const at::Tensor& x) { a = at::maximum(a, x); }},
    {R::BAND, "BAND", Takes::integral, [](at::Tensor& a, const at::Tensor& x) { a.bitwise_and_(x); }},
    {R::BOR, "BOR", Takes::integral, [](at::Tensor& a, const at::Tensor& x) { a.bitwise_or_(x); }},
    {R::BXOR, "BXOR", Takes::integral, [](at::Tensor& a, const at::Tensor& x) { a.bitwise_xor_(x); }},
    {R::PREMUL_SUM, "PREMUL_SUM", Takes::any, nullptr},
};

}  // namespace

const Reduction* reduction_of(const c10d::ReduceOp& op) {
  for (const Reduction& r : kReductions)
    if (r.op == op.op_) return &r;
  return nullptr;
}

std::string reduce_name(const c10d::ReduceOp& op) {
  const Reduction* r = reduction_of(op);
  return r ? r->name : "UNUSED";
}

}  // namespace cpsim::torch_backend
