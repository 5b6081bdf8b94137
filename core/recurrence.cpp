#include "core/recurrence.hpp"

#include <cmath>
#include <vector>

#include "core/plan.hpp"

namespace cpsim {

namespace {

using Mat = std::vector<double>;  // row-major

struct Dims {
  std::int64_t B, L, H, K, V;
};

// Pointers to one token of one head.
struct Token {
  const double *q, *k, *v, *beta, *g;
};

struct Inputs {
  Dims d;
  const double *q, *k, *v, *beta, *g;
  Token at(std::int64_t b, std::int64_t t, std::int64_t h) const {
    const std::int64_t bth = (b * d.L + t) * d.H + h;
    return {q + bth * d.K, k + bth * d.K, v + bth * d.V, beta + bth, g + bth * d.K};
  }
};

// X (K x n) <- (I - beta k k^T) Diag(exp g) X.
void decay_and_project(Mat& X, std::int64_t K, std::int64_t n, const Token& tk) {
  std::vector<double> u(n, 0.0);
  for (std::int64_t i = 0; i < K; ++i) {
    const double d = std::exp(tk.g[i]);
    for (std::int64_t j = 0; j < n; ++j) {
      X[i * n + j] *= d;
      u[j] += tk.k[i] * X[i * n + j];
    }
  }
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < n; ++j) X[i * n + j] -= *tk.beta * tk.k[i] * u[j];
}

void add_outer(Mat& S, std::int64_t V, const Token& tk, std::int64_t K) {
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < V; ++j) S[i * V + j] += *tk.beta * tk.k[i] * tk.v[j];
}

// Affine transition (M, S_ext) of tokens [t0, t1) of one row and head.
void transition(const Inputs& in, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t t1, Mat& M, Mat& S_ext) {
  const std::int64_t K = in.d.K, V = in.d.V;
  M.assign(K * K, 0.0);
  for (std::int64_t i = 0; i < K; ++i) M[i * K + i] = 1.0;
  S_ext.assign(K * V, 0.0);
  for (std::int64_t t = t0; t < t1; ++t) {
    const Token tk = in.at(b, t, h);
    decay_and_project(M, K, K, tk);
    decay_and_project(S_ext, K, V, tk);
    add_outer(S_ext, V, tk, K);
  }
}

// Runs tokens [t0, t1) from S (in place); writes o; keeps every S_{t-1} when `states`.
void run_forward(const Inputs& in, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t t1, Mat& S, double* o,
                 std::vector<Mat>* states) {
  const std::int64_t K = in.d.K, V = in.d.V;
  for (std::int64_t t = t0; t < t1; ++t) {
    if (states) states->push_back(S);
    const Token tk = in.at(b, t, h);
    decay_and_project(S, K, V, tk);
    add_outer(S, V, tk, K);
    if (o == nullptr) continue;
    double* ot = o + ((b * in.d.L + t) * in.d.H + h) * V;
    for (std::int64_t j = 0; j < V; ++j) {
      double acc = 0;
      for (std::int64_t i = 0; i < K; ++i) acc += S[i * V + j] * tk.q[i];
      ot[j] = acc;
    }
  }
}

struct Grads {
  double *q, *k, *v, *beta, *g;
};

// Backward over tokens [t0, t1) given the state S_init before t0 and the gradient
// dS at the end; writes token gradients and leaves the gradient of S_init in dS.
void run_backward(const Inputs& in, std::int64_t b, std::int64_t h, std::int64_t t0, std::int64_t t1, const Mat& S_init,
                  const double* d_o, Mat& dS, const Grads& gr) {
  const std::int64_t K = in.d.K, V = in.d.V;
  std::vector<Mat> states;
  Mat S = S_init;
  run_forward(in, b, h, t0, t1, S, nullptr, &states);
  Mat A(K * V), dA(K * V);
  std::vector<double> u(V), e(V), du(V);
  for (std::int64_t t = t1 - 1; t >= t0; --t) {
    const Token tk = in.at(b, t, h);
    const std::int64_t bth = (b * in.d.L + t) * in.d.H + h;
    const Mat& prev = states[t - t0];
    const double beta = *tk.beta;
    // Recompute A = D S_{t-1}, u = k^T A, S_t = A + beta k (v - u)^T.
    std::fill(u.begin(), u.end(), 0.0);
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t j = 0; j < V; ++j) {
        A[i * V + j] = std::exp(tk.g[i]) * prev[i * V + j];
        u[j] += tk.k[i] * A[i * V + j];
      }
    const double* dot = d_o + bth * V;
    // o = S_t^T q.
    for (std::int64_t i = 0; i < K; ++i) {
      double dq = 0;
      for (std::int64_t j = 0; j < V; ++j) {
        const double St = A[i * V + j] + beta * tk.k[i] * (tk.v[j] - u[j]);
        dq += St * dot[j];
        dS[i * V + j] += tk.q[i] * dot[j];
      }
      gr.q[bth * K + i] += dq;
    }
    std::fill(e.begin(), e.end(), 0.0);
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t j = 0; j < V; ++j) e[j] += tk.k[i] * dS[i * V + j];
    double dbeta = 0;
    for (std::int64_t j = 0; j < V; ++j) {
      dbeta += e[j] * (tk.v[j] - u[j]);
      gr.v[bth * V + j] += beta * e[j];
      du[j] = -beta * e[j];
    }
    gr.beta[bth] += dbeta;
    for (std::int64_t i = 0; i < K; ++i) {
      double dk = 0, dg = 0;
      for (std::int64_t j = 0; j < V; ++j) {
        dk += beta * dS[i * V + j] * (tk.v[j] - u[j]) + A[i * V + j] * du[j];
        dA[i * V + j] = dS[i * V + j] + tk.k[i] * du[j];
        dg += dA[i * V + j] * A[i * V + j];
      }
      gr.k[bth * K + i] += dk;
      gr.g[bth * K + i] += dg;
      for (std::int64_t j = 0; j < V; ++j) dS[i * V + j] = std::exp(tk.g[i]) * dA[i * V + j];
    }
  }
}

// Per row and head: the state entering the first local segment, and the
// transition of the first local segment (for the backward exchange).
struct RowState {
  std::vector<Mat> S0, M_first;  // [H]
};

// X (K x V) <- A X + X_ext for one exchanged block [K, K+V] = [A | X_ext]:
// the forward fold (A = M) and the backward fold (A = M^T) alike.
void apply_transition(const double* blk, Mat& X, std::int64_t K, std::int64_t V) {
  Mat next(K * V, 0.0);
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j < V; ++j) {
      double acc = blk[i * (K + V) + K + j];
      for (std::int64_t m = 0; m < K; ++m) acc += blk[i * (K + V) + m] * X[m * V + j];
      next[i * V + j] = acc;
    }
  X = std::move(next);
}

Tensor exchange(Communicator* comm, const Tensor& mine) {
  if (!is_distributed(comm)) return mine.reshape({1, mine.numel()});
  Tensor all({comm->size(), mine.numel()}, DType::f64);
  comm->all_gather(mine.raw(), all.raw(), static_cast<std::size_t>(mine.numel()), DType::f64);
  return all;
}

}  // namespace

Var gated_delta_rule(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g,
                     const PackedContext& context, Communicator* comm, const RecurrencePlanEdit& edit) {
  const Tensor &Q = q.value(), &Kt = k.value(), &Vt = v.value(), &Bt = beta.value(), &G = g.value();
  CPSIM_ENFORCE(Q.ndim() == 4 && Q.dtype() == DType::f64, "gated_delta_rule takes float64 q [B, L, H, K]");
  const Dims d{Q.dim(0), Q.dim(1), Q.dim(2), Q.dim(3), Vt.dim(3)};
  CPSIM_ENFORCE(Kt.shape() == Q.shape() && G.shape() == Q.shape() && Bt.shape() == Shape({d.B, d.L, d.H}) &&
                    Vt.shape() == Shape({d.B, d.L, d.H, d.V}) && d.L == context.local_seq_len(),
                "gated_delta_rule shapes disagree");
  const int c = comm ? comm->size() : 1, r = comm ? comm->rank() : 0;
  CPSIM_ENFORCE(c == context.cp_size(), "communicator size ", c, " != context cp_size ", context.cp_size());
  const Inputs in{d, Q.data<double>(), Kt.data<double>(), Vt.data<double>(), Bt.data<double>(), G.data<double>()};
  const std::int64_t KV = d.K * (d.K + d.V), block = d.H * KV;

  std::vector<RecurrencePlan> plan;
  for (std::int64_t b = 0; b < d.B; ++b) {
    plan.push_back(recurrence_plan(build_fla_cp_context(context, static_cast<int>(b)), r));
    if (edit) edit(plan.back(), r, static_cast<int>(b));
  }

  // (M, S_ext) of every row's last local segment; zeros where it ends locally.
  Tensor mine({d.B * block}, DType::f64);
  Mat M, S_ext;
  for (std::int64_t b = 0; b < d.B; ++b) {
    if (!plan[b].publishes_transition) continue;
    const auto& cu = plan[b].segments;
    const std::size_t s = plan[b].transition_segment;
    for (std::int64_t h = 0; h < d.H; ++h) {
      transition(in, b, h, cu[s], cu[s + 1], M, S_ext);
      double* dst = mine.data<double>() + b * block + h * KV;
      for (std::int64_t i = 0; i < d.K; ++i) {
        std::copy(&M[i * d.K], &M[i * d.K] + d.K, dst + i * (d.K + d.V));
        std::copy(&S_ext[i * d.V], &S_ext[i * d.V] + d.V, dst + i * (d.K + d.V) + d.K);
      }
    }
  }
  const Tensor all = exchange(comm, mine);  // every rank takes part

  Tensor o({d.B, d.L, d.H, d.V}, DType::f64);
  std::vector<RowState> rows(d.B);
  for (std::int64_t b = 0; b < d.B; ++b) {
    rows[b].S0.assign(d.H, Mat(d.K * d.V, 0.0));
    rows[b].M_first.assign(d.H, Mat());
    const auto& cu = plan[b].segments;
    for (std::int64_t h = 0; h < d.H; ++h) {
      Mat& S = rows[b].S0[h];
      for (int j : plan[b].fold_forward)
        apply_transition(all.data<double>() + (j * d.B + b) * block + h * KV, S, d.K, d.V);
      transition(in, b, h, cu[0], cu[1], rows[b].M_first[h], S_ext);
      for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
        Mat state = s == 0 ? rows[b].S0[h] : Mat(d.K * d.V, 0.0);  // reset at every segment start
        run_forward(in, b, h, cu[s], cu[s + 1], state, o.data<double>(), nullptr);
      }
    }
  }

  return record(o, "gated_delta_rule", {q, k, v, beta, g}, [=](const Tensor& d_o) {
    Tensor gq(Q.shape(), DType::f64), gk(Q.shape(), DType::f64), gv(Vt.shape(), DType::f64),
        gb(Bt.shape(), DType::f64), gg(Q.shape(), DType::f64);
    const Inputs in2{d, Q.data<double>(), Kt.data<double>(), Vt.data<double>(), Bt.data<double>(), G.data<double>()};
    const Grads grads{gq.data<double>(), gk.data<double>(), gv.data<double>(), gb.data<double>(), gg.data<double>()};
    // Step 1: every segment with no gradient arriving from later ranks; the first
    // segment's state gradient is then dS_ext of its backward transition.
    Tensor mine_b({d.B * block}, DType::f64);
    for (std::int64_t b = 0; b < d.B; ++b) {
      const auto& cu = plan[b].segments;
      for (std::int64_t h = 0; h < d.H; ++h)
        for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
          Mat dS(d.K * d.V, 0.0);
          run_backward(in2, b, h, cu[s], cu[s + 1], s == 0 ? rows[b].S0[h] : Mat(d.K * d.V, 0.0), d_o.data<double>(),
                       dS, grads);
          if (s != 0 || !plan[b].publishes_state_gradient) continue;
          double* dst = mine_b.data<double>() + b * block + h * KV;
          const Mat& M1 = rows[b].M_first[h];
          for (std::int64_t i = 0; i < d.K; ++i) {
            for (std::int64_t m = 0; m < d.K; ++m) dst[i * (d.K + d.V) + m] = M1[m * d.K + i];  // M^T
            std::copy(&dS[i * d.V], &dS[i * d.V] + d.V, dst + i * (d.K + d.V) + d.K);
          }
        }
    }
    const Tensor all_b = exchange(comm, mine_b);
    // Step 2: fold right to left over the successors, then redo the last segment
    // with the gradient that arrives at its end.
    for (std::int64_t b = 0; b < d.B; ++b) {
      if (!plan[b].publishes_transition) continue;
      const auto& cu = plan[b].segments;
      const std::size_t last = plan[b].transition_segment;
      for (std::int64_t h = 0; h < d.H; ++h) {
        Mat dS(d.K * d.V, 0.0);
        for (int j : plan[b].fold_backward)
          apply_transition(all_b.data<double>() + (j * d.B + b) * block + h * KV, dS, d.K, d.V);
        // Add the last segment's response to the arriving dS alone (backward is linear
        // in its incoming gradients; step 1 already covered d_o).
        Tensor zq(Q.shape(), DType::f64), zk(Q.shape(), DType::f64), zv(Vt.shape(), DType::f64),
            zb(Bt.shape(), DType::f64), zg(Q.shape(), DType::f64);
        const Grads extra{zq.data<double>(), zk.data<double>(), zv.data<double>(), zb.data<double>(), zg.data<double>()};
        const Mat S_init = last == 0 ? rows[b].S0[h] : Mat(d.K * d.V, 0.0);
        Tensor zero_do(d_o.shape(), DType::f64);
        run_backward(in2, b, h, cu[last], cu[last + 1], S_init, zero_do.data<double>(), dS, extra);
        add_inplace(gq, zq);
        add_inplace(gk, zk);
        add_inplace(gv, zv);
        add_inplace(gb, zb);
        add_inplace(gg, zg);
      }
    }
    return std::vector<Tensor>{gq, gk, gv, gb, gg};
  });
}

}  // namespace cpsim
