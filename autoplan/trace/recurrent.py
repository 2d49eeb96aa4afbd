"""Recurrent layers as the planner traces them: ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` unrolled over time.

On a CPU ``torch.lstm`` runs as oneDNN's ``mkldnn_rnn_layer``, one opaque kernel per layer whose
backward needs a workspace the functional graph never holds (the lowered backward fails on it), and
which no sharding rule splits. A GPU runs cuDNN's fused RNN instead, a different kernel again.
Written out, both are the same arithmetic: one matmul projecting every time step's input at once,
then per step one matmul of the hidden state and the pointwise gates. Traced that way the layer is
made of ops every stage knows: its batch splits over ranks (each rank runs the recurrence on its
own sequences), its hidden dim can split as any matmul's can, the FLOPs are cuDNN's, and the
backward is autograd's, so the step equals one device's. The graph grows with the sequence length
(a few dozen nodes per step and layer, forward and backward together).

Packed sequences (``nn.utils.rnn.PackedSequence``) are not written out: they stop tracing with an
error that says so.
"""

from __future__ import annotations

import torch

from autoplan.errors import TracingError


def _dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if not train or p == 0:
        return x
    return torch.native_dropout(x, p, True)[0]


def _lstm_step(gates: torch.Tensor, c: torch.Tensor, w_hr: torch.Tensor | None):
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return (h if w_hr is None else h @ w_hr.t()), c


def _direction(kind: str, x: torch.Tensor, h, c, weights: list[torch.Tensor], has_biases: bool, reverse: bool):
    """One layer in one direction over ``x`` (batch, time, features): the outputs (batch, time,
    hidden) and the last hidden (and cell) state. Batch first, so the projection's matmul flattens
    (batch, time) with the batch outermost, a dim a batch split keeps."""
    w_ih, w_hh = weights[0], weights[1]
    b_ih, b_hh = (weights[2], weights[3]) if has_biases else (None, None)
    w_hr = weights[4 if has_biases else 2] if len(weights) > (4 if has_biases else 2) else None
    projected = x @ w_ih.t()  # every step's input in one matmul, as cuDNN does
    if b_ih is not None:
        projected = projected + b_ih
    steps = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
    outs = []
    for t in steps:
        recurrent = h @ w_hh.t()
        if b_hh is not None:
            recurrent = recurrent + b_hh
        if kind == "lstm":
            h, c = _lstm_step(projected[:, t] + recurrent, c, w_hr)
        elif kind == "gru":
            ir, iz, in_ = projected[:, t].chunk(3, dim=-1)
            hr, hz, hn = recurrent.chunk(3, dim=-1)
            r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
            n = torch.tanh(in_ + r * hn)
            h = n + z * (h - n)
        else:
            pre = projected[:, t] + recurrent
            h = torch.tanh(pre) if kind == "rnn_tanh" else torch.relu(pre)
        outs.append(h)
    if reverse:
        outs.reverse()
    return torch.stack(outs, dim=1), h, c


def _run(kind, x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    h0, c0 = (hx[0], hx[1]) if kind == "lstm" else (hx, None)
    directions = 2 if bidirectional else 1
    per = len(params) // (num_layers * directions)
    if not batch_first:
        x = x.transpose(0, 1)
    last_h, last_c = [], []
    for layer in range(num_layers):
        if layer:
            x = _dropout(x, dropout, train)
        outs = []
        for d in range(directions):
            k = layer * directions + d
            weights = list(params[k * per : (k + 1) * per])
            out, h, c = _direction(kind, x, h0[k], None if c0 is None else c0[k], weights, has_biases, reverse=d == 1)
            outs.append(out)
            last_h.append(h)
            last_c.append(c)
        x = outs[0] if directions == 1 else torch.cat(outs, dim=-1)
    out = x if batch_first else x.transpose(0, 1)
    if kind == "lstm":
        return out, torch.stack(last_h), torch.stack(last_c)
    return out, torch.stack(last_h)


def _unpacked(name: str, args) -> None:
    # the packed form is (data, batch_sizes, hx, params, ...): a 1-D tensor of batch sizes second
    if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].ndim == 1:
        raise TracingError(
            f"torch.{name} over a PackedSequence cannot be traced: its batch shrinks step by step with the "
            "data's lengths. Pad the sequences (and mask the padded outputs) instead of packing them"
        )


def _traced(kind: str):
    """``torch.<kind>(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
    batch_first)`` unrolled: (output, h_n) and, for an LSTM, c_n."""

    def run(*args, **kwargs):
        _unpacked(kind, args)
        return _run(kind, *args, **kwargs)

    return run


FUNCTIONS = {f: _traced(f.__name__) for f in (torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu)}
