// The extension's Python module (attngrad_tiles): the eager fast path of a repeated
// forward that nothing differentiates, as a decode loop or an evaluation makes it
// (attngrad.torch.eager_plans.unmasked). Python publishes a plan's prepared forward under
// its call's own arguments (q, k, v's sizes, strides and dtype, is_causal, scale,
// enable_gqa, the dispatch state's serial); a later call with the same arguments is found
// here and run by forward_planned, without a signature built in Python or a trip through
// PyTorch's dispatcher, which cost a tiny call more than its arithmetic. Everything the
// dispatcher would have decided is asked first: Python asks for the regime (eager, no
// transform or mode), and `plain` below for the tensors; the op's own entry checks run
// as through the dispatcher. The table is only touched with the GIL held.
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstring>
#include <deque>
#include <optional>

#include "checked_call.h"

namespace attngrad_tiles {
namespace {

constexpr size_t kKept = 64;  // as eager_plans.KEPT; the oldest leaves first

struct Signature {
    std::array<int64_t, 24> layout;  // q, k, v: 4 sizes, then 4 strides each
    at::ScalarType dtype;
    bool causal, gqa, scaled;
    uint64_t scale_bits;  // the scale's bits where `scaled` (compared by bits: no NaN surprise)
    int64_t state;

    bool operator==(const Signature&) const = default;
};

struct Published {
    Signature signature;
    at::Tensor key_ranges, options;  // forward_planned's
};

std::deque<Published>& table = *new std::deque<Published>();  // never destroyed: it may outlive ATen at exit

// A plain CPU tensor, as PyTorch's dispatcher would route straight to the op's CPU kernel:
// no functorch wrapper, Python key, conjugate or negative bit, other backend. Autograd's
// keys (absent from inference tensors) are `fast_forward`'s business; autocast's, which
// every tensor carries, change nothing for an op without an autocast kernel, as this one.
bool plain(const at::Tensor& t) {
    const c10::DispatchKeySet keys =
        t.key_set() - c10::autograd_dispatch_keyset_with_ADInplaceOrView - c10::autocast_dispatch_keyset;
    return keys == c10::DispatchKeySet(c10::DispatchKey::CPU);
}

// `t` as the tiles take it, as native._work makes it (the same values, so the same bits):
// contiguous, float64 kept, every other floating type computed in float32.
at::Tensor work(const at::Tensor& t) {
    const at::ScalarType dtype = t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    return t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(dtype).contiguous();
}

// The call's signature, or none where the fast path does not serve it (the table never
// holds such a one: `publish` refuses them).
std::optional<Signature> signature_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                      std::optional<double> scale, bool gqa, int64_t state) {
    if (!q.defined() || !k.defined() || !v.defined() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) {
        return std::nullopt;
    }
    if (!plain(q) || !plain(k) || !plain(v) || !at::isFloatingType(q.scalar_type()) ||
        k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type()) {
        return std::nullopt;
    }
    Signature s{};
    const at::Tensor* tensors[3] = {&q, &k, &v};
    for (int i = 0; i < 3; ++i) {
        for (int d = 0; d < 4; ++d) {
            s.layout[i * 8 + d] = tensors[i]->size(d);
            s.layout[i * 8 + 4 + d] = tensors[i]->stride(d);
        }
    }
    s.dtype = q.scalar_type();
    s.causal = causal;
    s.gqa = gqa;
    s.scaled = scale.has_value();
    if (scale) std::memcpy(&s.scale_bits, &*scale, sizeof(double));
    s.state = state;
    return s;
}

// Publish forward_planned(q, k, v, key_ranges, options) for every later call with these
// arguments; an entry already there for them is replaced.
void publish(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, std::optional<double> scale,
             bool gqa, int64_t state, const at::Tensor& key_ranges, const at::Tensor& options) {
    const std::optional<Signature> s = signature_of(q, k, v, causal, scale, gqa, state);
    TORCH_CHECK(s.has_value(), "attngrad_tiles.publish: q, k and v must be plain 4-D CPU tensors of one floating dtype; got ",
                Context{&q, &k, &v});
    for (auto it = table.begin(); it != table.end(); ++it) {
        if (it->signature == *s) {
            table.erase(it);
            break;
        }
    }
    table.push_back(Published{*s, key_ranges, options});
    while (table.size() > kKept) table.pop_front();
}

// The published forward's output for this call, or None: no entry for its arguments, or
// reverse mode tracks one of q, k, v (the caller's plan then runs it through autograd).
py::object fast_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                   std::optional<double> scale, bool gqa, int64_t state) {
    if (c10::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) {
        return py::none();
    }
    const std::optional<Signature> s = signature_of(q, k, v, causal, scale, gqa, state);
    if (!s) return py::none();
    const Published* found = nullptr;
    for (const Published& entry : table) {
        if (entry.signature == *s) {
            found = &entry;
            break;
        }
    }
    if (found == nullptr) return py::none();
    const at::Tensor key_ranges = found->key_ranges, options = found->options;  // the table may change once released
    at::Tensor out;
    {
        py::gil_scoped_release released;
        RECORD_FUNCTION("attngrad_tiles::forward_planned", std::vector<c10::IValue>({q, k, v}));
        out = std::get<0>(forward_planned_unmasked(work(q), work(k), work(v), key_ranges, options));
    }
    return py::cast(out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type()));
}

}  // namespace
}  // namespace attngrad_tiles

// Named here, not by TORCH_EXTENSION_NAME, which cpp_extension versions within a process
// (attngrad_tiles_v1 after a first failed try): build.py imports it by this name.
PYBIND11_MODULE(attngrad_tiles, m) {
    using namespace attngrad_tiles;
    m.doc() = "attngrad's compiled tiles: the eager fast path (the ops are torch.ops.attngrad_tiles.*)";
    m.def("publish", &publish, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("causal"), py::arg("scale"),
          py::arg("gqa"), py::arg("state"), py::arg("key_ranges"), py::arg("options"));
    m.def("forward", &fast_forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("causal"), py::arg("scale"),
          py::arg("gqa"), py::arg("state"));
    m.def("clear", [] { table.clear(); }, "forget every published forward");
    m.def("published", [] { return table.size(); }, "how many forwards are published");
}
