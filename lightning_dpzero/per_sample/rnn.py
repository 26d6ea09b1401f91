"""``nn.RNN`` (tanh, relu), ``nn.GRU`` and ``nn.LSTM`` (``proj_size`` too): several layers, bidirectional,
``batch_first`` True or False, packed sequences of unequal lengths, an initial state given or not, and
inter-layer dropout, with the user's module unchanged.

An RNN layer's weight gradients are Linear-type sums over time. For layer l, direction d, with input
``x_t`` (the layer's input at time t), previous state ``h_{t-1}`` (``h_0`` given or zero) and the gradients
of the loss with respect to the input and recurrent projections ``∂xp_t`` and ``∂hp_t`` (``gates·H``
values, where ``xp_t = W_ih x_t + b_ih`` and ``hp_t = W_hh h_{t-1} + b_hh``):

* ``weight_ih``: rows ``(x_t, ∂xp_t)``; ``bias_ih``: ``Σ_t ∂xp_t``;
* ``weight_hh``: rows ``(h_{t-1}, ∂hp_t)``; ``bias_hh``: ``Σ_t ∂hp_t``;
* ``weight_hr`` (LSTM with ``proj_size``; ``h_t = W_hr u_t``, ``u_t = o_t ⊙ tanh(c_t)``): rows ``(u_t, ∂h_t)``.

For an LSTM and a plain RNN ``∂hp_t = ∂xp_t``; for a GRU they differ in the candidate gate, whose recurrent
term is gated by the reset gate (``n = tanh(xp_n + r ⊙ hp_n)``, PyTorch's placement). Norms and clipped sums
then come from the shared rows arithmetic (:mod:`.maths`) on the path :func:`.paths.site_rows_path` picks
per weight (ghost, instantiate, or instantiate-and-reuse).

PyTorch's fused kernels (cuDNN, the native CPU one) return no per-step gradients, so the backward recomputes
the recurrence under autograd, unrolled in time (the input projection of every step as one matmul, then
the recurrence step by step), and takes ``∂xp``, ``∂hp`` and the input and initial-state gradients from it.
The forward is PyTorch's own kernel (the same outputs as the layer, bit for bit), except with inter-layer
dropout in training, where the unrolled recurrence runs with dropout masks drawn as PyTorch's CPU kernel
draws them (one Bernoulli mask per layer output but the last, in the same order and layout: the same masks
for the same seed on the CPU) and kept for the backward. cuDNN draws its dropout masks from its own
generator, so on a GPU the masks have PyTorch's distribution but not its stream.

Packed sequences (``torch.nn.utils.rnn.pack_padded_sequence``) run padded to ``(T, B)`` in the packed
(length-sorted) order, each state frozen after its sequence's last step (so the reverse direction starts at
the sequence's own end), and return a ``PackedSequence`` with PyTorch's data order, ``h_n`` in the batch's
order. Example i of the batch is row ``unsorted_indices[i]`` of the packed order; norms and coefficients are
exchanged with the engine in the batch's order. The batch size is ``batch_sizes[0]`` for a packed input,
``input.shape[1]`` with ``batch_first=False``.

Refused: unbatched (2-D) inputs.
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.nn.functional as F
from torch import _VF, nn
from torch.nn.utils.rnn import PackedSequence, unpack_sequence

from .base import Inputs, LayerRule, UnsupportedLayerError
from .maths import param_shape, per_example_sq, rows_norm_sq, rows_per_example, weighted_rows_grad, weighted_sum
from .paths import site_rows_path
from .registry import register_rule

_NAME = re.compile(r"(weight|bias)_(ih|hh|hr)_l(\d+)(_reverse)?$")
_KERNELS = {"LSTM": _VF.lstm, "GRU": _VF.gru, "RNN_TANH": _VF.rnn_tanh, "RNN_RELU": _VF.rnn_relu}


def _directions(module) -> int:
    return 2 if module.bidirectional else 1


def _weights(module, params) -> list[dict]:
    """Per (layer, direction) k = l·D + d: ``{"weight_ih": W, "bias_hh": b, ...}`` from the flat parameters."""
    out = [{} for _ in range(module.num_layers * _directions(module))]
    for name, p in zip(module._flat_weights_names, params):
        kind, which, layer, rev = _NAME.match(name).groups()
        out[int(layer) * _directions(module) + int(rev is not None)][f"{kind}_{which}"] = p
    return out


def _step(mode: str, xp, hp, h, c):
    """One step of the cell from the input and recurrent projections: ``(u, c)`` (``c`` None but for LSTM)."""
    if mode == "LSTM":
        i, f, g, o = (xp + hp).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        xr, xz, xn = xp.chunk(3, 1)
        hr, hz, hn = hp.chunk(3, 1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return n + z * (h - n), None
    pre = xp + hp
    return (torch.relu(pre) if mode == "RNN_RELU" else torch.tanh(pre)), None


def unroll(module, x, h0, c0, params, keep=None, valid=None, tape=None):
    """The recurrence of ``module`` over time-major ``x`` (T, B, d) from ``h0`` (L·D, B, P) and, for an LSTM,
    ``c0`` (L·D, B, H): ``(output (T, B, D·P), h_n, c_n or None)``. ``keep``: per layer but the last, the
    dropout mask (T, B, D·P) of its output; ``valid`` (T, B, 1) bool: the steps of each (packed) sequence
    (states are frozen, outputs zero, after its end). With a list ``tape``, appends per (layer, direction)
    the tensors the backward differentiates and the rows the norms need."""
    mode, D, T = module.mode, _directions(module), x.shape[0]
    W = _weights(module, params)
    layer_in, hn, cn = x, [], []
    for layer in range(module.num_layers):
        outs = []
        for d in range(D):
            k = layer * D + d
            w = W[k]
            xp = F.linear(layer_in, w["weight_ih"], w.get("bias_ih"))
            xs = xp.unbind(0)  # one gradient buffer for all steps (indexing would add T full-size ones)
            h, c = h0[k], (c0[k] if c0 is not None else None)
            ys, rec = [None] * T, {"in": layer_in, "xp": xp, "hprev": [None] * T, "hp": [None] * T,
                                   "y": [None] * T, "u": [None] * T}
            for t in (range(T) if d == 0 else range(T - 1, -1, -1)):
                hp = F.linear(h, w["weight_hh"], w.get("bias_hh"))
                u, c_new = _step(mode, xs[t], hp, h, c)
                y = F.linear(u, w["weight_hr"]) if "weight_hr" in w else u
                rec["hprev"][t], rec["hp"][t], rec["y"][t], rec["u"][t] = h, hp, y, u
                if valid is not None:  # a packed sequence: its state stays as at its last step
                    m = valid[t]
                    h, c = torch.where(m, y, h), (torch.where(m, c_new, c) if c is not None else None)
                    y = y.masked_fill(~m, 0)
                else:
                    h, c = y, c_new
                ys[t] = y
            outs.append(torch.stack(ys))
            hn.append(h)
            cn.append(c)
            if tape is not None:
                tape.append(rec)
        layer_out = torch.cat(outs, 2) if D == 2 else outs[0]
        layer_in = layer_out * keep[layer] if keep is not None and layer < module.num_layers - 1 else layer_out
    return layer_out, torch.stack(hn), (torch.stack(cn) if c0 is not None else None)


@register_rule(nn.RNN, nn.GRU, nn.LSTM)
class RNNRule(LayerRule):
    """``nn.RNN``, ``nn.GRU``, ``nn.LSTM``: one layer (one group in layer-wise clipping) per module, whatever
    its number of layers and directions. ``site.x`` holds the layer-0 input rows ``(B, T, d)`` (its
    ``options``: the packed order), ``site.g`` one ``(kind, rows...)`` entry per flat parameter."""

    multi_input = True
    forward_methods = ("forward", "_update_flat_weights", "permute_hidden", "check_forward_args")

    def params(self, module):
        return [getattr(module, n) for n in module._flat_weights_names]

    def batch_size(self, module, x, extra=((), {})):
        if isinstance(x, PackedSequence):
            return int(x.batch_sizes[0]), None
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            dim = 0 if module.batch_first else 1
            return x.shape[dim], dim
        raise UnsupportedLayerError(
            f"{type(module).__name__} received an input of shape {tuple(getattr(x, 'shape', ()))}; per-example "
            "clipping needs a batched input: (B, T, features) with batch_first=True, (T, B, features) with "
            "batch_first=False, or a PackedSequence.")

    def layout_inputs(self, module, args, kwargs):
        a = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
        x, hx = a["input"], a.get("hx")
        if isinstance(x, PackedSequence):
            x = list(unpack_sequence(x))  # the B sequences, in the batch's order
        elif not module.batch_first:
            x = x.movedim(1, 0)
        states = () if hx is None else (hx if isinstance(hx, tuple) else (hx,))
        return [x, *(h.movedim(1, 0) for h in states)]  # a state is (layers x directions, B, H)

    # ------------------------------------------------------------------ the call
    def bind(self, module, x, args, kwargs):
        a = inspect.signature(type(module).forward).bind(module, x, *args, **kwargs).arguments
        hx = a.get("hx")
        D, P = _directions(module), module.proj_size or module.hidden_size
        o = {"packed": None, "valid": None, "flat": None,
             "dropout": module.dropout if module.training and module.num_layers > 1 else 0.0}
        if isinstance(x, PackedSequence):
            data, bs, si, ui = x
            B, T = int(bs[0]), len(bs)
            valid = torch.arange(B)[None, :] < bs[:, None]  # (T, B): step t of the j-th longest sequence
            o.update(packed=(bs, si, ui), valid=valid.to(data.device).unsqueeze(2),
                     flat=valid.flatten().nonzero().squeeze(1).to(data.device), T=T)
        else:
            data, B = x, x.shape[0 if module.batch_first else 1]
        o["B"] = B
        lstm = module.mode == "LSTM"
        h0, c0 = (hx if hx is not None else (None, None)) if lstm else (hx, None)
        shapes = [("h0", h0, P)] + ([("c0", c0, module.hidden_size)] if lstm else [])
        states = []
        for name, t, size in shapes:
            want = (module.num_layers * D, B, size)
            if t is None:
                t = data.new_zeros(want)
            elif tuple(t.shape) != want:
                raise RuntimeError(f"{type(module).__name__}: expected {name} of size {want}, got {tuple(t.shape)}.")
            states.append(t)
        return (data, *states), o

    def _time_major(self, module, x, h0, c0, o):
        """Input (T, B, d) and states in the internal (packed, length-sorted) order."""
        if o["packed"] is None:
            return (x.transpose(0, 1) if module.batch_first else x), h0, c0
        _, si, _ = o["packed"]
        T, B = o["T"], o["B"]
        xt = x.new_zeros(T * B, x.shape[1]).index_copy(0, o["flat"], x).view(T, B, x.shape[1])
        if si is not None:
            h0, c0 = h0.index_select(1, si), (c0.index_select(1, si) if c0 is not None else None)
        return xt, h0, c0

    def _outputs(self, module, out, hn, cn, o):
        """The layer's outputs (output or packed data, h_n[, c_n]) from the internal (T, B, ·) results."""
        if o["packed"] is None:
            out = out.transpose(0, 1) if module.batch_first else out
        else:
            out = out.reshape(-1, out.shape[2]).index_select(0, o["flat"])
            ui = o["packed"][2]
            if ui is not None:
                hn, cn = hn.index_select(1, ui), (cn.index_select(1, ui) if cn is not None else None)
        return (out, hn) if cn is None else (out, hn, cn)

    def _draw_dropout(self, module, x, o):
        """Per layer but the last, the inter-layer dropout mask in the internal layout, drawn like PyTorch's
        CPU kernel: ``at::dropout`` of each layer's output, time-major (T, B, D·P) or packed (N, D·P)."""
        shape = (x.shape[0],) if o["packed"] is not None else (x.shape[1 if module.batch_first else 0], o["B"])
        width = _directions(module) * (module.proj_size or module.hidden_size)
        keep = []
        for _ in range(module.num_layers - 1):
            m = F.dropout(x.new_ones(*shape, width), o["dropout"], True)
            if o["packed"] is not None:
                m = m.new_zeros(o["T"] * o["B"], width).index_copy(0, o["flat"], m).view(o["T"], o["B"], width)
            keep.append(m)
        return keep

    def forward(self, module, inputs, *params):
        x, h0 = inputs[0], inputs[1]
        c0 = inputs[2] if module.mode == "LSTM" else None
        o = inputs.options
        if o["dropout"] > 0:  # PyTorch's kernel would draw masks the backward could not see
            if o.get("keep") is None:
                o["keep"] = self._draw_dropout(module, x, o)
            return self._outputs(module, *unroll(module, *self._time_major(module, x, h0, c0, o), params,
                                                 o["keep"], o["valid"]), o)
        hx = (h0, c0) if c0 is not None else h0
        kernel = _KERNELS[module.mode]
        if o["packed"] is None:
            res = kernel(x, hx, list(params), module.bias, module.num_layers, 0.0, False, module.bidirectional,
                         module.batch_first)
            return tuple(res)
        bs, si, ui = o["packed"]
        if si is not None:
            hx = tuple(t.index_select(1, si) for t in hx) if c0 is not None else hx.index_select(1, si)
        res = kernel(x, bs, hx, list(params), module.bias, module.num_layers, 0.0, False, module.bidirectional)
        if ui is not None:
            res = (res[0], *(t.index_select(1, ui) for t in res[1:]))
        return tuple(res)

    def assemble(self, module, outputs, options):
        out, h = outputs[0], (tuple(outputs[1:]) if module.mode == "LSTM" else outputs[1])
        if options["packed"] is not None:
            out = PackedSequence(out, *options["packed"])
        return out, h

    def backward_multi(self, module, inputs, params, grads, needs_input_grad):
        o, lstm, D = inputs.options, module.mode == "LSTM", _directions(module)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(inputs, needs_input_grad)]
            tape: list[dict] = []
            xt, h0, c0 = self._time_major(module, leaves[0], leaves[1], leaves[2] if lstm else None, o)
            # parameters as leaves that require grad, so that every step's projections do (their gradients are
            # the rows; autograd.grad computes nothing for the parameters themselves)
            ps = [p.detach().requires_grad_(True) for p in params]
            outs = self._outputs(module, *unroll(module, xt, h0, c0, ps, o.get("keep"), o["valid"], tape), o)
            gru, proj = module.mode == "GRU", module.proj_size > 0
            wrt = [r["xp"] for r in tape] + [h for r in tape for h in (r["hp"] if gru else [])] \
                + [y for r in tape for y in (r["y"] if proj else [])]
            want = [t for t, n in zip(leaves, needs_input_grad) if n]
            pairs = [(t, g) for t, g in zip(outs, grads) if g is not None]
            got = torch.autograd.grad([t for t, _ in pairs], wrt + want, [g for _, g in pairs], allow_unused=True)
        got = [torch.zeros_like(t) if g is None else g for t, g in zip(wrt + want, got)]
        n, T = len(tape), xt.shape[0]
        dxp, rest = got[:n], got[n:]
        dhp = [torch.stack(rest[i * T:(i + 1) * T]) for i in range(n)] if gru else dxp
        rest = rest[n * T:] if gru else rest
        dy = [torch.stack(rest[i * T:(i + 1) * T]) for i in range(n)] if proj else None
        it = iter(rest[n * T:] if proj else rest)
        gin = [next(it) if need else None for need in needs_input_grad]

        def bt(t):  # (T, B, ·) → rows (B, T, ·)
            return t.detach().transpose(0, 1)

        pieces = []
        for name in module._flat_weights_names:
            kind, which, layer, rev = _NAME.match(name).groups()
            k = int(layer) * D + int(rev is not None)
            r, gx, gh = tape[k], bt(dxp[k]), bt(dhp[k])
            if kind == "bias":
                pieces.append(("b", gx if which == "ih" else gh))
            elif which == "ih":
                pieces.append(("w", bt(r["in"]), gx))
            elif which == "hh":
                pieces.append(("w", bt(torch.stack(r["hprev"])), gh))
            else:
                pieces.append(("w", bt(torch.stack(r["u"])), bt(dy[k])))
        packed = o["packed"]
        order = {"sorted": packed[1], "unsorted": packed[2]} if packed is not None else {}
        return gin, Inputs((bt(xt),), order), pieces

    # ------------------------------------------------------------------ per-example gradients (batch order)
    @staticmethod
    def _to_batch(site, t):
        """Per-example values in the packed order → the batch's order."""
        ui = site.x.options.get("unsorted")
        return t if ui is None else t.index_select(0, ui)

    @staticmethod
    def _from_batch(site, coef):
        si = site.x.options.get("sorted")
        return coef if si is None else coef.index_select(0, si.to(coef.device))

    def norm_sq(self, site, mask):
        out, paths = [], set()
        for i, (piece, m) in enumerate(zip(site.g, mask)):
            sq = None
            if m and piece[0] == "b":
                sq = per_example_sq(piece[1].float().sum(1))
            elif m:
                a, g = piece[1], piece[2]
                path = site_rows_path(site, a, g)
                paths.add(path)
                if path == "reuse":
                    per = rows_per_example(a, g)
                    site.kept[i] = per
                    sq = per_example_sq(per)
                else:
                    sq = rows_norm_sq(a, g, path)
            out.append(None if sq is None else self._to_batch(site, sq))
        site.path = paths.pop() if len(paths) == 1 else ("mixed" if paths else None)
        return out

    def per_example(self, site, mask):
        out = []
        for piece, m, p in zip(site.g, mask, self.params(site.module)):
            if not m:
                out.append(None)
                continue
            per = piece[1].float().sum(1) if piece[0] == "b" else rows_per_example(piece[1], piece[2])
            out.append(self._to_batch(site, per).reshape(per.shape[0], *param_shape(p)))
        return out

    def clipped_grads(self, site, coef, mask):
        coef = self._from_batch(site, coef)
        out = []
        for i, (piece, m, p) in enumerate(zip(site.g, mask, self.params(site.module))):
            kept = site.kept.pop(i, None)
            if not m:
                out.append(None)
            elif kept is not None:
                out.append(weighted_sum(kept, coef).to(piece[-1].dtype))
            elif piece[0] == "b":
                out.append(weighted_sum(piece[1].float().sum(1), coef).to(piece[1].dtype))
            else:
                out.append(weighted_rows_grad(piece[1], piece[2], coef).reshape(param_shape(p)))
        return out
