// The gated delta rule under CP, in the one kernel source: one thread per (row,
// head) runs that head's tokens in order (the state is K x V; the recurrence is
// sequential in t). Passes:
//   publish         (M, S_ext) of the plan's published segment, from a zero state
//   forward         fold the gathered transitions into the first segment's state,
//                   keep S0 and the first segment's M, run every segment (reset at
//                   each start) and write o
//   backward_local  every segment with only d_o; publish [M_first^T | dS] of the first
//   backward_fold   fold the gathered state gradients into the published segment's
//                   end gradient and run that segment's backward once more
// Each step S_t = (I - b k k^T) Diag(exp g) S_{t-1} + b k v^T, o_t = S_t^T q_t.
#pragma once

#include <cmath>

#include "core/kernels/hd.hpp"
#include "core/kernels/table.hpp"

namespace cpsim::kernels {

CPSIM_HD inline index_t recurrence_workspace(index_t L, index_t K, index_t V) {
  const index_t n = K > V ? K : V;
  return (L + 1) * K * V + 4 * K * V + K * K + 3 * n;
}

// One head of one row: token views and the step algebra on raw K x n matrices.
struct HeadView {
  const RecurrenceArgs* a;
  index_t b, h;
  CPSIM_HD index_t bth(index_t t) const { return (b * a->L + t) * a->H + h; }
  CPSIM_HD const double* q(index_t t) const { return a->q + bth(t) * a->K; }
  CPSIM_HD const double* k(index_t t) const { return a->k + bth(t) * a->K; }
  CPSIM_HD const double* v(index_t t) const { return a->v + bth(t) * a->V; }
  CPSIM_HD double beta(index_t t) const { return a->beta[bth(t)]; }
  CPSIM_HD const double* g(index_t t) const { return a->g + bth(t) * a->K; }

  // X (K x n) <- (I - beta k k^T) Diag(exp g) X; u is n scratch.
  CPSIM_HD void decay_and_project(double* X, index_t n, index_t t, double* u) const {
    const index_t K = a->K;
    for (index_t j = 0; j < n; ++j) u[j] = 0;
    for (index_t i = 0; i < K; ++i) {
      const double d = exp(g(t)[i]);
      for (index_t j = 0; j < n; ++j) {
        X[i * n + j] *= d;
        u[j] += k(t)[i] * X[i * n + j];
      }
    }
    for (index_t i = 0; i < K; ++i)
      for (index_t j = 0; j < n; ++j) X[i * n + j] -= beta(t) * k(t)[i] * u[j];
  }
  CPSIM_HD void add_outer(double* S, index_t t) const {
    for (index_t i = 0; i < a->K; ++i)
      for (index_t j = 0; j < a->V; ++j) S[i * a->V + j] += beta(t) * k(t)[i] * v(t)[j];
  }
  // (M, S_ext) of tokens [t0, t1): S_out = M S_in + S_ext.
  CPSIM_HD void transition(index_t t0, index_t t1, double* M, double* S_ext, double* u) const {
    const index_t K = a->K, V = a->V;
    for (index_t i = 0; i < K * K; ++i) M[i] = 0;
    for (index_t i = 0; i < K; ++i) M[i * K + i] = 1;
    for (index_t i = 0; i < K * V; ++i) S_ext[i] = 0;
    for (index_t t = t0; t < t1; ++t) {
      decay_and_project(M, K, t, u);
      decay_and_project(S_ext, V, t, u);
      add_outer(S_ext, t);
    }
  }
  // Tokens [t0, t1) from S (in place); writes o when asked; keeps S_{t-1} in states.
  CPSIM_HD void run_forward(index_t t0, index_t t1, double* S, bool write_o, double* states, double* u) const {
    const index_t K = a->K, V = a->V;
    for (index_t t = t0; t < t1; ++t) {
      if (states)
        for (index_t i = 0; i < K * V; ++i) states[(t - t0) * K * V + i] = S[i];
      decay_and_project(S, V, t, u);
      add_outer(S, t);
      if (!write_o) continue;
      double* ot = a->o + bth(t) * V;
      for (index_t j = 0; j < V; ++j) {
        double acc = 0;
        for (index_t i = 0; i < K; ++i) acc += S[i * V + j] * q(t)[i];
        ot[j] = acc;
      }
    }
  }
  // X (K x V) <- A X + X_ext for one block [K][K+V] = [A | X_ext]; tmp is K*V scratch.
  CPSIM_HD void apply_block(const double* blk, double* X, double* tmp) const {
    const index_t K = a->K, V = a->V;
    for (index_t i = 0; i < K; ++i)
      for (index_t j = 0; j < V; ++j) {
        double acc = blk[i * (K + V) + K + j];
        for (index_t m = 0; m < K; ++m) acc += blk[i * (K + V) + m] * X[m * V + j];
        tmp[i * V + j] = acc;
      }
    for (index_t i = 0; i < K * V; ++i) X[i] = tmp[i];
  }
  // Backward over [t0, t1) from the state S_init before t0 and the gradient dS at the
  // end; accumulates token gradients (d_o null: zero) and leaves dS_init in dS.
  CPSIM_HD void run_backward(index_t t0, index_t t1, const double* S_init, double* dS, double* w) const {
    const index_t K = a->K, V = a->V, n = K > V ? K : V;
    double* states = w;
    double* S = states + (a->L + 1) * K * V;
    double* A = S + K * V;
    double* dA = A + K * V;
    double* u = dA + K * V + K * V + K * K;  // after tmp and M
    double* e = u + n;
    double* du = e + n;
    for (index_t i = 0; i < K * V; ++i) S[i] = S_init[i];
    run_forward(t0, t1, S, false, states, u);
    for (index_t t = t1 - 1; t >= t0; --t) {
      const double* prev = states + (t - t0) * K * V;
      const double bt = beta(t);
      for (index_t j = 0; j < V; ++j) u[j] = 0;
      for (index_t i = 0; i < K; ++i)
        for (index_t j = 0; j < V; ++j) {
          A[i * V + j] = exp(g(t)[i]) * prev[i * V + j];
          u[j] += k(t)[i] * A[i * V + j];
        }
      const double* dot = a->d_o ? a->d_o + bth(t) * V : nullptr;
      for (index_t i = 0; i < K; ++i) {
        double dq = 0;
        for (index_t j = 0; j < V; ++j) {
          const double go = dot ? dot[j] : 0.0;
          const double St = A[i * V + j] + bt * k(t)[i] * (v(t)[j] - u[j]);
          dq += St * go;
          dS[i * V + j] += q(t)[i] * go;
        }
        a->gq[bth(t) * K + i] += dq;
      }
      for (index_t j = 0; j < V; ++j) e[j] = 0;
      for (index_t i = 0; i < K; ++i)
        for (index_t j = 0; j < V; ++j) e[j] += k(t)[i] * dS[i * V + j];
      double dbeta = 0;
      for (index_t j = 0; j < V; ++j) {
        dbeta += e[j] * (v(t)[j] - u[j]);
        a->gv[bth(t) * V + j] += bt * e[j];
        du[j] = -bt * e[j];
      }
      a->gbeta[bth(t)] += dbeta;
      for (index_t i = 0; i < K; ++i) {
        double dk = 0, dg = 0;
        for (index_t j = 0; j < V; ++j) {
          dk += bt * dS[i * V + j] * (v(t)[j] - u[j]) + A[i * V + j] * du[j];
          dA[i * V + j] = dS[i * V + j] + k(t)[i] * du[j];
          dg += dA[i * V + j] * A[i * V + j];
        }
        a->gk[bth(t) * K + i] += dk;
        a->gg[bth(t) * K + i] += dg;
        for (index_t j = 0; j < V; ++j) dS[i * V + j] = exp(g(t)[i]) * dA[i * V + j];
      }
    }
  }
};

// Workspace of (b, h): states | S | A | dA | tmp | M | u | e | du.
struct Workspace {
  double* base;
  index_t L, K, V;
  CPSIM_HD double* states() const { return base; }
  CPSIM_HD double* S() const { return base + (L + 1) * K * V; }
  CPSIM_HD double* tmp() const { return S() + 3 * K * V; }
  CPSIM_HD double* M() const { return tmp() + K * V; }
  CPSIM_HD double* u() const { return M() + K * K; }
};

struct RecurrencePass {
  RecurrenceArgs a;
  RecurrenceStep pass;
  CPSIM_HD void operator()(index_t i) const {
    const index_t b = i / a.H, h = i - b * a.H, K = a.K, V = a.V, KV = K * (K + V);
    const HeadView hv{&a, b, h};
    const Workspace w{a.work + i * recurrence_workspace(a.L, K, V), a.L, K, V};
    const RecurrencePlanView& p = a.plan;
    const std::int64_t* seg = p.segments + p.seg_at[b];
    const index_t nseg = p.seg_at[b + 1] - p.seg_at[b] - 1;
    const bool publishes_transition = p.publishes[b] & 1, publishes_gradient = p.publishes[b] & 2;
    const index_t ts = p.transition_segment[b];
    double* block = a.mine + (b * a.H + h) * KV;
    if (pass == RecurrenceStep::publish) {
      if (!publishes_transition) return;
      double* S_ext = w.S();
      hv.transition(seg[ts], seg[ts + 1], w.M(), S_ext, w.u());
      for (index_t r = 0; r < K; ++r) {
        for (index_t m = 0; m < K; ++m) block[r * (K + V) + m] = w.M()[r * K + m];
        for (index_t j = 0; j < V; ++j) block[r * (K + V) + K + j] = S_ext[r * V + j];
      }
    } else if (pass == RecurrenceStep::forward) {
      double* S0 = a.S0 + i * K * V;
      for (index_t x = 0; x < K * V; ++x) S0[x] = 0;
      for (index_t f = p.fwd_at[b]; f < p.fwd_at[b + 1]; ++f)
        hv.apply_block(a.all + ((p.fold_fwd[f] * a.B + b) * a.H + h) * KV, S0, w.tmp());
      if (nseg > 0) hv.transition(seg[0], seg[1], a.M_first + i * K * K, w.S(), w.u());  // none on an empty rank
      for (index_t s = 0; s < nseg; ++s) {
        for (index_t x = 0; x < K * V; ++x) w.S()[x] = s == 0 ? S0[x] : 0.0;  // reset at every segment start
        hv.run_forward(seg[s], seg[s + 1], w.S(), true, nullptr, w.u());
      }
    } else if (pass == RecurrenceStep::backward_local) {
      for (index_t s = 0; s < nseg; ++s) {  // dS lives in tmp, which run_backward leaves alone
        for (index_t x = 0; x < K * V; ++x) w.tmp()[x] = 0;
        hv.run_backward(seg[s], seg[s + 1], s == 0 ? a.S0 + i * K * V : zero_state(w), w.tmp(), w.base);
        if (s != 0 || !publishes_gradient) continue;
        const double* M1 = a.M_first + i * K * K;
        for (index_t r = 0; r < K; ++r) {
          for (index_t m = 0; m < K; ++m) block[r * (K + V) + m] = M1[m * K + r];  // M^T
          for (index_t j = 0; j < V; ++j) block[r * (K + V) + K + j] = w.tmp()[r * V + j];
        }
      }
    } else {  // backward_fold
      if (!publishes_transition) return;
      double* dS = w.tmp();
      for (index_t x = 0; x < K * V; ++x) dS[x] = 0;
      for (index_t f = p.bwd_at[b]; f < p.bwd_at[b + 1]; ++f)
        hv.apply_block(a.all + ((p.fold_bwd[f] * a.B + b) * a.H + h) * KV, dS, w.S());
      hv.run_backward(seg[ts], seg[ts + 1], ts == 0 ? a.S0 + i * K * V : zero_state(w), dS, w.base);
    }
  }
  // A zero K x V state: the last K*V doubles of the states area are never written
  // by run_forward over at most L tokens (it keeps L states of L + 1 slots).
  CPSIM_HD static const double* zero_state(const Workspace& w) {
    double* z = w.states() + w.L * w.K * w.V;
    for (index_t x = 0; x < w.K * w.V; ++x) z[x] = 0;
    return z;
  }
};

template <class Policy>
void recurrence_pass(Policy&& policy, const RecurrenceArgs& a, RecurrenceStep pass) {
  for_each_index(policy, a.B * a.H, RecurrencePass{a, pass});
}

}  // namespace cpsim::kernels
