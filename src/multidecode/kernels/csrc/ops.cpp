// The torch operators `multidecode::*`: argument checks, outputs, the instruction set, and the
// split of each kernel's work over torch's intra-op threads. A split never cuts a reduction (see
// kernels.h), so the thread count changes which thread computes an output, never its bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <map>
#include <vector>

#include "kernels.h"

namespace multidecode {
namespace {

enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2, AVX512_VNNI = 3 };

struct Kernels {
  void (*linear)(const LinearArgs&, int64_t, int64_t, int64_t, int64_t);
  void (*quantize)(const QuantizeArgs&, int64_t, int64_t);
  void (*rms_norm)(const NormArgs&, int64_t, int64_t);
  void (*qlinear)(const QLinearArgs&, int64_t, int64_t, int64_t, int64_t);
  void (*attention_units)(const AttentionArgs&, int64_t, int64_t);
  void (*attention_merge)(const AttentionArgs&, int64_t, int64_t);
  void (*attention_groups)(const AttentionArgs&, const RowGroups&, int64_t, int64_t, float*);
};

#define MD_KERNELS(isa) \
  Kernels{linear_##isa, quantize_##isa, rms_norm_##isa, qlinear_##isa, attention_units_##isa, attention_merge_##isa, attention_groups_##isa}

int64_t supported_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512vnni")) return AVX512_VNNI;
  if (avx512) return AVX512;
  if (avx2) return AVX2;
#endif
  return PORTABLE;
}

const Kernels& kernels_for(int64_t isa) {
  static const int64_t best = supported_isa();
  TORCH_CHECK(isa <= best, "multidecode kernels: instruction set level ", isa, " is not supported by this CPU (best: ",
              best, ")");
  if (isa < 0) isa = best;
#if defined(__x86_64__)
  static const Kernels table[] = {MD_KERNELS(portable), MD_KERNELS(avx2), MD_KERNELS(avx512), MD_KERNELS(avx512vnni)};
#else
  static const Kernels table[] = {MD_KERNELS(portable)};
#endif
  return table[isa];
}

DataType data_type(const at::Tensor& t, const char* what) {
  if (t.scalar_type() == at::kFloat) return F32;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "multidecode kernels: ", what, " must be float32 or bfloat16, got ",
              t.scalar_type());
  return BF16;
}

// [M, K] rows with the last dimension contiguous (a copy only where the input is not so).
at::Tensor as_rows(const at::Tensor& x) {
  at::Tensor rows = x.reshape({-1, x.size(-1)});
  return rows.stride(-1) == 1 ? rows : rows.contiguous();
}

// x's rows as a pointer, a count and a stride: a contiguous x as it is (no tensor operation: a
// one-row step makes hundreds of these calls), any other through `as_rows`, kept alive in `keep`.
struct Rows {
  const void* data;
  int64_t count, width, stride;
};

Rows rows_view(const at::Tensor& x, at::Tensor& keep) {
  const int64_t width = x.size(-1);
  if (x.is_contiguous()) return {x.data_ptr(), width ? x.numel() / width : 0, width, width};
  keep = as_rows(x);
  return {keep.data_ptr(), keep.size(0), width, keep.stride(0)};
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "multidecode kernels: bias has ", bias->numel(), " values for ", n, " outputs");
  return bias->to(at::kFloat).contiguous();
}

// Work split into (row block, column block) tasks: every output belongs to one task.
template <class Run>
void over_tiles(int64_t rows, int64_t columns, int64_t row_block, int64_t column_block, const Run& run) {
  const int64_t row_tasks = (rows + row_block - 1) / row_block, column_tasks = (columns + column_block - 1) / column_block;
  at::parallel_for(0, row_tasks * column_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      int64_t m0 = (task / column_tasks) * row_block, n0 = (task % column_tasks) * column_block;
      run(m0, std::min(rows, m0 + row_block), n0, std::min(columns, n0 + column_block));
    }
  });
}

int64_t row_block(int64_t rows) { return rows <= 96 ? rows : 96; }

// Multiply-adds below which a product runs on the calling thread alone (measured: waking the other
// threads costs about as much as a 576 x 576 product of one row).
constexpr int64_t SERIAL_WORK = 1 << 19;

// ------------------------------------------------------------------------------------ operators
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "multidecode.linear: weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(x.size(-1) == weight.size(1), "multidecode.linear: x has ", x.size(-1), " features, weight takes ",
              weight.size(1));
  const Kernels& k = kernels_for(isa);
  at::Tensor rows = as_rows(x), b = float_bias(bias, weight.size(0));
  at::Tensor y = at::empty({rows.size(0), weight.size(0)}, x.options());
  LinearArgs a{rows.data_ptr(), weight.data_ptr(), b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr(),
               rows.size(0), weight.size(0), weight.size(1), rows.stride(0), data_type(x, "x"),
               data_type(weight, "weight")};
  over_tiles(a.M, a.N, row_block(a.M), 64, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    k.linear(a, m0, m1, n0, n1);
  });
  return y.view(out_shape(x, a.N));
}

// run(begin, end) over rows [0, rows), on the calling thread where `work` (the rows' values,
// weighted by what one costs) is below SERIAL_WORK: waking the other threads would cost more.
template <class Run>
void over_rows(int64_t rows, int64_t work, const Run& run) {
  if (work < SERIAL_WORK) {
    run(0, rows);
  } else {
    at::parallel_for(0, rows, 16, run);
  }
}

// Rows quantized by `k`, a value weighed as 64 of a product's multiply-adds.
void quantize(const Kernels& k, const QuantizeArgs& a) {
  over_rows(a.M, 64 * a.M * a.K, [&](int64_t begin, int64_t end) { k.quantize(a, begin, end); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.size(-1) % 32 == 0, "multidecode.quantize_rows: features must be whole groups of 32, got ", x.size(-1));
  const Kernels& k = kernels_for(isa);
  at::Tensor rows = as_rows(x);
  int64_t m = rows.size(0), groups = rows.size(1) / 32;
  at::Tensor codes = at::empty({m, rows.size(1)}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({m, groups}, x.options().dtype(at::kFloat));
  at::Tensor sum = at::empty({m, groups}, x.options().dtype(at::kFloat));
  quantize(k, QuantizeArgs{rows.data_ptr(), codes.data_ptr<int8_t>(), scale.data_ptr<float>(), sum.data_ptr<float>(),
                           m, rows.size(1), rows.stride(0), data_type(x, "x")});
  return {codes, scale, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset, int64_t isa) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "multidecode.rms_norm: weight must be a contiguous vector of x's features, in x's dtype");
  const Kernels& k = kernels_for(isa);
  at::Tensor keep;
  const Rows rows = rows_view(x, keep);
  at::Tensor y = at::empty(x.sizes(), x.options());
  NormArgs a{rows.data, weight.data_ptr(), y.data_ptr(), rows.count, rows.width, rows.stride, (float)eps,
             offset ? 1 : 0, data_type(x, "x")};
  over_rows(a.M, 8 * a.M * a.K, [&](int64_t begin, int64_t end) { k.rms_norm(a, begin, end); });
  return y;
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t out_features,
                   int64_t bits, const c10::optional<at::Tensor>& bias, int64_t isa) {
  TORCH_CHECK(bits == 4 || bits == 8, "multidecode.qlinear: bits must be 4 or 8, got ", bits);
  const int64_t inner = x.size(-1), groups = inner / 32, panels = (out_features + 15) / 16;
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  codes.numel() == panels * groups * (bits == 4 ? 256 : 512),
              "multidecode.qlinear: codes do not hold ", out_features, " x ", inner, " ", bits, "-bit weights");
  // 16 steps per (panel, group), and 16 lows after them for 4-bit codes that keep lows
  const bool lows = bits == 4 && scales.numel() == panels * groups * 32;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kShort &&
                  scales.numel() == panels * groups * (lows ? 32 : 16),
              "multidecode.qlinear: scales do not match the codes");
  const Kernels& k = kernels_for(isa);
  at::Tensor keep;
  const Rows rows = rows_view(x, keep);
  // The rows quantized as `quantize_rows` does, into one buffer: codes [M, K], then steps and sums [M, K / 32].
  at::Tensor quantized = at::empty({rows.count * (inner + 8 * groups)}, x.options().dtype(at::kByte));
  int8_t* qcodes = reinterpret_cast<int8_t*>(quantized.data_ptr<uint8_t>());
  float* qscale = reinterpret_cast<float*>(qcodes + rows.count * inner);
  float* qsum = qscale + rows.count * groups;
  quantize(k, QuantizeArgs{rows.data, qcodes, qscale, qsum, rows.count, inner, rows.stride, data_type(x, "x")});
  at::Tensor b = float_bias(bias, out_features);
  at::Tensor y = at::empty(out_shape(x, out_features), x.options());
  QLinearArgs a{{qcodes, qscale, qsum},
                codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()),
                b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr(), rows.count, out_features, inner,
                (int32_t)bits, data_type(x, "x"), lows};
  if (a.M * out_features * inner < SERIAL_WORK) {  // a thread's wake-up costs more than it saves
    k.qlinear(a, 0, a.M, 0, panels);
  } else {
    over_tiles(a.M, panels, row_block(a.M), 4, [&](int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
      k.qlinear(a, m0, m1, p0, p1);
    });
  }
  return y;
}

// Rows grouped by the units they read, in order (rows of one group: at most MD_MAX_GROUP_ROWS).
struct Groups {
  std::vector<int32_t> rows, row_start{0}, units, unit_start{0};
};

Groups row_groups(const int32_t* row_pairs, const int32_t* pair_index, int64_t rows, int64_t width) {
  std::map<std::vector<int32_t>, std::vector<int32_t>> by_units;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> units;
    for (int32_t i = row_pairs[r]; i < row_pairs[r + 1]; ++i) units.push_back(pair_index[i] / (int32_t)width);
    by_units[units].push_back((int32_t)r);
  }
  Groups g;
  for (auto& [units, members] : by_units)
    for (size_t start = 0; start < members.size(); start += MD_MAX_GROUP_ROWS) {
      size_t end = std::min(members.size(), start + MD_MAX_GROUP_ROWS);
      g.rows.insert(g.rows.end(), members.begin() + start, members.begin() + end);
      g.row_start.push_back((int32_t)g.rows.size());
      g.units.insert(g.units.end(), units.begin(), units.end());
      g.unit_start.push_back((int32_t)g.units.size());
    }
  return g;
}

// Work split over threads by interleaved tasks: thread t runs tasks t, t + T, t + 2T, ...
template <class Run>
void interleaved(int64_t tasks, const Run& run) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) run(t, threads);
  });
}

constexpr int64_t PARTIAL_BYTES = 8 << 20;
// Above this many bytes of partials, rows are worked in groups and merged as they go.

at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& unit_slots, const at::Tensor& unit_rows, const at::Tensor& unit_bits,
                     const at::Tensor& row_pairs, const at::Tensor& pair_index, double scale, double softcap,
                     int64_t merge, int64_t isa) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1 && key.dim() == 4 && key.size(0) == 1,
              "multidecode.attention: query [1, H, R, D] and key/value [1, H_kv, S, D]");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
              "multidecode.attention: query, key and value must share a dtype");
  TORCH_CHECK(key.sizes() == value.sizes(), "multidecode.attention: key and value must have one shape");
  const int64_t heads = query.size(1), rows = query.size(2), dim = query.size(3), kv_heads = key.size(1);
  TORCH_CHECK(dim <= 512 && key.size(3) == dim, "multidecode.attention: head dim up to 512, the same for q and k");
  TORCH_CHECK(heads % kv_heads == 0, "multidecode.attention: query heads must be a multiple of key heads");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "multidecode.attention: head dim must be contiguous");
  for (const at::Tensor* t : {&unit_slots, &unit_rows, &row_pairs, &pair_index})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "multidecode.attention: plan indices must be int32");
  TORCH_CHECK(unit_bits.scalar_type() == at::kLong && unit_bits.is_contiguous() && unit_bits.sizes() == unit_rows.sizes(),
              "multidecode.attention: unit_bits must be int64 [U, W] like unit_rows");
  TORCH_CHECK(unit_slots.size(1) == 64 && row_pairs.numel() == rows + 1 && unit_rows.size(1) <= MD_MAX_GROUP_ROWS,
              "multidecode.attention: the plan does not fit");
  const Kernels& k = kernels_for(isa);
  const int64_t units = unit_rows.size(0), width = unit_rows.size(1), group = heads / kv_heads;
  const bool grouped = merge == 1 || (merge < 0 && units * width * heads * (dim + 2) * 4 > PARTIAL_BYTES);
  at::Tensor out = at::empty({1, rows, heads, dim}, query.options());
  at::Tensor partials = at::empty({grouped ? 0 : units * width, heads, dim + 2}, query.options().dtype(at::kFloat));
  AttentionArgs a{query.data_ptr(), key.data_ptr(), value.data_ptr(), unit_slots.data_ptr<int32_t>(),
                  unit_rows.data_ptr<int32_t>(), reinterpret_cast<const uint64_t*>(unit_bits.data_ptr<int64_t>()),
                  row_pairs.data_ptr<int32_t>(), pair_index.data_ptr<int32_t>(), partials.data_ptr<float>(),
                  out.data_ptr(), heads, kv_heads, rows, dim, units, width, query.stride(1), query.stride(2),
                  key.stride(1), key.stride(2), value.stride(1), value.stride(2), (float)scale, (float)softcap,
                  data_type(query, "query")};
  if (!grouped) {
    interleaved(units * kv_heads, [&](int64_t t, int64_t step) { k.attention_units(a, t, step); });
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) { k.attention_merge(a, begin, end); });
    return out;
  }
  Groups g = row_groups(a.row_pairs, a.pair_index, rows, width);
  RowGroups view{g.rows.data(), g.row_start.data(), g.units.data(), g.unit_start.data(),
                 (int64_t)g.row_start.size() - 1};
  const int64_t per_thread = (MD_MAX_GROUP_ROWS * group + heads) * (dim + 2);
  at::Tensor scratch = at::empty({at::get_num_threads(), per_thread}, query.options().dtype(at::kFloat));
  interleaved(view.count * kv_heads, [&](int64_t t, int64_t step) {
    k.attention_groups(a, view, t, step, scratch.data_ptr<float>() + t * per_thread);
  });
  return out;
}

int64_t best_isa() { return supported_isa(); }

}  // namespace
}  // namespace multidecode

TORCH_LIBRARY(multidecode, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int isa) -> Tensor");
  m.def("quantize_rows(Tensor x, int isa) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool offset, int isa) -> Tensor");
  m.def("qlinear(Tensor x, Tensor codes, Tensor scales, int out_features, int bits, Tensor? bias, int isa) -> Tensor");
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor unit_slots, Tensor unit_rows, Tensor unit_bits, "
        "Tensor row_pairs, Tensor pair_index, float scale, float softcap, int merge, int isa) -> Tensor");
  m.def("best_isa() -> int", &multidecode::best_isa);
}

TORCH_LIBRARY_IMPL(multidecode, CPU, m) {
  m.impl("linear", &multidecode::linear);
  m.impl("quantize_rows", &multidecode::quantize_rows);
  m.impl("rms_norm", &multidecode::rms_norm);
  m.impl("qlinear", &multidecode::qlinear);
  m.impl("attention", &multidecode::attention);
}
