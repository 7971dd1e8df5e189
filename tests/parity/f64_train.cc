// tetra's training step in float64 (tests/parity/test_parity.py, docs/parity.md "float64"): the
// production model (GptT<double> over a ParamStoreT<double>, unsharded), the CPU backend's f64
// kernel table and its AdamW update, driven the way `tetra train` drives the f32 ones, so that the
// comparison with the float64 PyTorch reference tests the math without float32 rounding.
//
//   parity_f64_train --init=INIT.safetensors --batches=BATCHES.safetensors --out=OUT.safetensors
//                    [--model.*=... --train.*=... --optim.*=... --run.threads=N]
//
// The keys are `tetra train`'s (the model's shape, train.micro_batch, seq_len, grad_accum and
// steps, optim.beta1, beta2, eps, weight_decay and grad_clip); INIT is the weights' safetensors
// file in Hugging Face names and layouts, as `--init.from` takes it (f32).
//
// BATCHES holds inputs and targets, int32 (steps, grad_accum, micro_batch, seq_len), and lr, f64
// (steps): each step's learning rate (the reference's schedule). OUT gets, in f64, the final
// weights under their Hugging Face names (real vocabulary rows only), step 1's gradients before
// clipping as "grad/<name>", and "loss" and "grad_norm" (steps).
//
// The Trainer, ModelStage, Updater and AdamW classes are float-only, so their step is taken here at
// the templated layer below them, as they take it: gradients zeroed, GptT::forward_backward per
// micro-batch with the loss scale 1/grad_accum and the step's loss the mean of theirs
// (model_stage.cc); the gradient norm from Kernels::sum_squares over the store's owned segments,
// clip_scale, and Kernels::adamw_update over the same segments with their decay flags and the
// 1-based step (update.cc, adamw.cc). The scalars keep production's types: the loss scale, the
// clipping factor and AdamWStep's fields are float (test_parity.py's TOL_F64 says what that
// costs against the float64 reference).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "core/config.h"
#include "core/error.h"
#include "core/param_store.h"
#include "kernels/backend.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "train/train_config.h"

namespace tetra {
namespace {

// A file tensor by name, of the dtype and element count the caller expects.
const SafeTensor& tensor(const SafeTensorsFile& f, const std::string& name, DType dtype,
                         int64_t numel) {
  auto it = f.tensors.find(name);
  TETRA_CHECK(it != f.tensors.end(), "[f64_train] no tensor '{}'", name);
  TETRA_CHECK(it->second.dtype == dtype && shape_numel(it->second.shape) == numel,
              "[f64_train] '{}' is {} {}, expected {} elements of {}", name,
              dtype_name(it->second.dtype), shape_str(it->second.shape), numel, dtype_name(dtype));
  return it->second;
}

SafeTensor f64_tensor(const Shape& shape, const double* data) {
  SafeTensor t{DType::f64, shape, {}};
  t.bytes.resize(size_t(shape_numel(shape)) * sizeof(double));
  std::memcpy(t.bytes.data(), data, t.bytes.size());
  return t;
}

// The file's (Hugging Face) layout of tensor e: real vocabulary rows, Conv1D weights (in, out).
Shape file_shape(const ParamEntry& e) {
  Shape s = e.spec.shape;
  if (e.spec.file.rows >= 0) s[0] = e.spec.file.rows;
  if (e.spec.file.transposed) std::swap(s[0], s[1]);
  return s;
}

// Converts between a file tensor and the global tensor in tetra's layout (padding rows stay zero).
void convert(const ParamEntry& e, const double* from, double* to, bool to_file) {
  const Shape fs = file_shape(e);
  const int64_t n = shape_numel(fs);
  for (int64_t i = 0; i < n; ++i) {
    int64_t g = i;  // tetra's index of file element i
    if (e.spec.file.transposed) g = (i % fs[1]) * fs[0] + i / fs[1];
    if (to_file) {
      to[i] = from[g];
    } else {
      to[g] = from[i];
    }
  }
}

int run(int argc, char** argv) {
  std::string init, batches, out;
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--init=", 0) == 0) {
      init = a.substr(7);
    } else if (a.rfind("--batches=", 0) == 0) {
      batches = a.substr(10);
    } else if (a.rfind("--out=", 0) == 0) {
      out = a.substr(6);
    } else {
      overrides.push_back(a);
    }
  }
  TETRA_CHECK(!init.empty() && !batches.empty() && !out.empty(),
              "usage: {} --init=FILE --batches=FILE --out=FILE [--model.*=...]", argv[0]);
  const Config c = Config::from_overrides(train_config_schema(), overrides);
  const GptConfig shape = gpt_config_from(c);
  const int B = int(c.i("train.micro_batch")), T = int(c.i("train.seq_len"));
  const int A = int(c.i("train.grad_accum"));
  const int64_t steps = c.i("train.steps");

  Backend& backend = cpu_backend();
  if (c.i("run.threads") > 0) backend.set_threads(int(c.i("run.threads")));
  Kernels<double>& k = backend.f64();
  ParamStoreT<double> store(backend.device());
  GptT<double> model(backend, shape, store, B, T);
  store.finalize({});

  const SafeTensorsFile weights = read_safetensors(init);
  TETRA_CHECK(weights.tensors.size() == store.tensors().size(),
              "[f64_train] {} holds {} tensors, the model {}", init, weights.tensors.size(),
              store.tensors().size());
  for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
    const ParamEntry& e = store.tensor(id);
    const std::vector<float> v =
        tensor(weights, e.spec.name, DType::f32, shape_numel(file_shape(e))).to_f32();
    const std::vector<double> file(v.begin(), v.end());
    std::vector<double> global(size_t(shape_numel(e.spec.shape)), 0.0);
    convert(e, file.data(), global.data(), false);
    store.load_global(id, global.data());
  }

  const SafeTensorsFile data = read_safetensors(batches);
  const int64_t per_mb = int64_t(B) * T, n_tok = steps * A * per_mb;
  const SafeTensor& inputs = tensor(data, "inputs", DType::i32, n_tok);
  const SafeTensor& targets = tensor(data, "targets", DType::i32, n_tok);
  std::vector<double> lrs(static_cast<size_t>(steps));
  std::memcpy(lrs.data(), tensor(data, "lr", DType::f64, steps).bytes.data(), lrs.size() * 8);

  // update.cc's step at the kernel layer: the owned segments (all of every tensor, unsharded)
  // give the norm's ranges, and AdamW's state lies beside them.
  std::vector<FlatRange> ranges;
  for (const OwnedSegment& o : store.owned()) ranges.push_back({o.grad_pos, o.count});
  Buffer<double> m(store.state_size(), {}, backend.device());
  Buffer<double> v(store.state_size(), {}, backend.device());
  const AdamWConfig adamw{float(c.f("optim.beta1")), float(c.f("optim.beta2")),
                          float(c.f("optim.eps")), float(c.f("optim.weight_decay"))};
  const double clip = c.f("optim.grad_clip");

  SafeTensorsFile result;
  std::vector<double> losses, norms;
  for (int64_t s = 0; s < steps; ++s) {
    store.grads().zero();
    double loss = 0.0;
    for (int mb = 0; mb < A; ++mb) {
      const int64_t off = (s * A + mb) * per_mb * 4;
      loss += model.forward_backward(reinterpret_cast<const int32_t*>(inputs.bytes.data() + off),
                                     reinterpret_cast<const int32_t*>(targets.bytes.data() + off),
                                     1.0f / float(A));
    }
    losses.push_back(loss / A);
    norms.push_back(std::sqrt(k.sum_squares(store.grads().data(), ranges)));
    if (s == 0) {
      for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
        const ParamEntry& e = store.tensor(id);
        std::vector<double> g(size_t(e.numel())), f(size_t(shape_numel(file_shape(e))));
        backend.device().to_host(g.data(), store.grad(id), g.size() * sizeof(double));
        convert(e, g.data(), f.data(), true);
        result.tensors["grad/" + e.spec.name] = f64_tensor(file_shape(e), f.data());
      }
    }
    // As update.cc hands them to the f32 table: AdamWStep's fields are float.
    const AdamWStep st{.lr = float(lrs[size_t(s)]),
                       .grad_scale = clip_scale(norms.back(), clip),
                       .beta1 = adamw.beta1,
                       .beta2 = adamw.beta2,
                       .eps = adamw.eps,
                       .weight_decay = adamw.weight_decay,
                       .t = s + 1};
    k.adamw_update(store.params().data(), store.grads().data(), m.data(), v.data(), store.owned(),
                   st, nullptr);
  }

  for (TensorId id = 0; id < TensorId(store.tensors().size()); ++id) {
    const ParamEntry& e = store.tensor(id);
    std::vector<double> w(size_t(e.numel())), f(size_t(shape_numel(file_shape(e))));
    backend.device().to_host(w.data(), store.param(id), w.size() * sizeof(double));
    convert(e, w.data(), f.data(), true);
    result.tensors[e.spec.name] = f64_tensor(file_shape(e), f.data());
  }
  result.tensors["loss"] = f64_tensor({steps}, losses.data());
  result.tensors["grad_norm"] = f64_tensor({steps}, norms.data());
  write_safetensors(out, result);
  std::printf("%s: %lld steps, loss %.17g -> %.17g\n", shape.describe().c_str(),
              static_cast<long long>(steps), losses.front(), losses.back());
  return 0;
}

}  // namespace
}  // namespace tetra

int main(int argc, char** argv) {
  try {
    return tetra::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
