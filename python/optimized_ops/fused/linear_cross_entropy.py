"""Fused linear + cross-entropy (an LM head and its loss): ``cross_entropy(hidden @ weight.T + bias, target)``,
forward and backward, chunked over the tokens so that the full ``(T, V)`` logits never exist in memory.

Per chunk of ``c`` token rows, the forward runs three library ops and one torch GEMM:

1. ``logits_c = hidden_c @ weight.T + bias`` -- ``torch.ops.optimized.linear_forward`` (our GEMM, the bias in
   its epilogue; float32 accumulation, rounded once to the inputs' dtype, as ``F.linear`` rounds);
2. ``torch.ops.optimized.cross_entropy_fwd_`` on ``logits_c``: each row's loss, and the gradient of that loss
   for a unit upstream gradient written OVER ``logits_c`` (no second ``(c, V)`` buffer);
3. when ``hidden`` or ``bias`` need a gradient, ``torch.ops.optimized.linear_backward`` on that gradient:
   ``d_hidden_c = dlogits_c @ weight`` (copied into its rows of ``d_hidden``) and ``db_c``, the column sums
   (added to a float32 buffer);
4. when ``weight`` needs one, ``dW += dlogits_c^T @ hidden_c`` -- ``torch.addmm`` into a buffer of the weight's
   dtype (float32 accumulation inside each chunk's product, one rounding per chunk): the library's torch ops
   cannot accumulate into an existing tensor (the C++ API can, ``LinearBackwardOptions::accumulate``, but
   ``linear_backward``'s glue always returns a fresh ``(V, d)`` gradient, which would cost ``V d`` elements of
   memory and three ``V d`` passes per chunk). With ``accumulation_dtype=torch.float32`` that fresh product
   (our GEMM, in step 3's call) is what is added, to a float32 buffer.

The gradients are of the reduced loss for an upstream 1 (``"mean"``: the kernel folds 1 / count, counted on
the device, into the logits' gradient, as torch scales before its GEMMs); the backward multiplies them in
place by ``grad_output``, touching nothing where it is exactly 1 (read on the device). ``reduction="none"`` needs a gradient
per row, which cannot be applied to ``dW`` after the sum over the rows, so there the forward only computes
the losses and the backward runs the chunks again (the logits recomputed: one more GEMM), each chunk's
gradient rows multiplied by the upstream gradient as the cross-entropy kernel writes them (its grad_scale).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._autograd import bump_version, compute_dtype
from .._library import load

load()  # registers torch.ops.optimized.* before the calls below
_ops = torch.ops.optimized

_REDUCTIONS = ("none", "mean", "sum")

# The default chunk: its logits (and their gradient, written in place) take at most this many bytes ...
CHUNK_BYTES = 256 << 20
# ... in a whole number of these rows (the GEMMs' tile height) when at least that many fit.
CHUNK_ROWS_MULTIPLE = 128


def linear_cross_entropy_chunk_size(rows: int, vocab: int, dtype: torch.dtype) -> int:
    """The chunk ``optimized_ops.linear_cross_entropy`` takes when ``chunk_size`` is None.

    The most rows whose logits fit in ``CHUNK_BYTES`` (256 MiB), rounded down to a multiple of
    ``CHUNK_ROWS_MULTIPLE`` (128) when at least 128 fit, at least 1 and at most ``rows``: with V = 128256
    bf16 logits, 1024 rows (250.5 MiB); V = 32000, 4096 rows (250 MiB); V = 262144, 512 rows.

    Parameters
    ----------
    rows : int
        Tokens (``T``).
    vocab : int
        ``V``, the weight's rows.
    dtype : torch.dtype
        The dtype of the logits (the inputs').

    Returns
    -------
    int
        The rows per chunk.
    """
    per_row = max(1, vocab) * torch.empty((), dtype=dtype).element_size()
    chunk = CHUNK_BYTES // per_row
    if chunk >= CHUNK_ROWS_MULTIPLE:
        chunk -= chunk % CHUNK_ROWS_MULTIPLE
    return max(1, min(rows, chunk))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                         z_loss: float = 0.0, reduction: str = "mean", chunk_size: Optional[int] = None,
                         accumulation_dtype: Optional[torch.dtype] = None, variant: str = "auto") -> torch.Tensor:
    r"""Cross-entropy of a linear layer's output, ``cross_entropy(hidden @ weight.T + bias, target)``, without
    materializing the ``(T, V)`` logits: forward and backward run over chunks of ``chunk_size`` token rows.

    Per row (``z = hidden[row] @ weight.T + bias``, ``lse = logsumexp(z)``, ``ls = label_smoothing``)::

        loss = lse - ((1 - ls) * z[target] + ls / V * sum(z)) + z_loss * lse**2

    as :func:`optimized_ops.cross_entropy` (``F.cross_entropy`` with label smoothing, plus PaLM's z-loss) of
    ``F.linear(hidden, weight, bias)``; the logits are rounded to the inputs' dtype as ``F.linear``'s are.

    Parameters
    ----------
    hidden : torch.Tensor
        ``(..., d)``, the leading dimensions flattened to ``T`` token rows (rows uniformly strided with a unit
        stride along ``d`` are read in place, others copied); float32, float16 or bfloat16 (float64 on the CPU).
    weight : torch.Tensor
        ``(V, d)``, as :class:`torch.nn.Linear` stores an LM head; ``hidden``'s dtype and device.
    target : torch.Tensor
        ``hidden.shape[:-1]``, int64 or int32: class indices in ``[0, V)`` or ``ignore_index`` (others: a
        ValueError on the CPU; on CUDA that row's loss and gradient are NaN, as for ``cross_entropy``).
    bias : torch.Tensor, optional, keyword-only
        ``(V,)``, ``hidden``'s dtype.
    ignore_index, label_smoothing, z_loss : keyword-only
        As for :func:`optimized_ops.cross_entropy`.
    reduction : str, keyword-only
        ``"mean"`` (over the rows whose target is not ``ignore_index``, counted on the device: no host
        synchronisation), ``"sum"`` or ``"none"`` (per row; its backward recomputes the logits, below).
    chunk_size : int, optional, keyword-only
        Token rows per chunk (any value >= 1; the last chunk may be shorter). None:
        :func:`linear_cross_entropy_chunk_size`, the most rows whose logits fit in 256 MiB, in multiples of
        128 (1024 rows for V = 128256 in bf16).
    accumulation_dtype : torch.dtype, optional, keyword-only
        The dtype of the buffer the weight's gradient is summed in across the chunks. None (the default): the
        weight's dtype -- each chunk's product is accumulated in float32 and added to the buffer with one
        rounding, in place (``torch.addmm``), and the buffer becomes the gradient (the memory target below; with
        ``n`` chunks a 16-bit gradient carries up to ``n`` roundings of the running sum instead of torch's one).
        ``torch.float32`` for 16-bit weights: a float32 buffer (``4 V d`` more bytes, plus a ``(V, d)`` product
        per chunk), to which each chunk's product from ``linear_backward`` (our GEMM, rounded once to the
        weight's dtype) is added; the gradient is rounded once more at the end.
    variant : str, keyword-only
        The linear family's rung for the library GEMMs (:func:`optimized_ops.linear_variants`: ``"auto"``,
        ``"cpu"``, ``"naive"``, ``"fused"``, ``"persistent"``); the cross-entropy op runs its ``"auto"``.

    Returns
    -------
    torch.Tensor
        The loss in ``hidden``'s dtype: 0-D for ``"mean"`` / ``"sum"``, ``target``'s shape for ``"none"``. A
        ``"mean"`` over a batch whose every target is ignored is NaN (0 / 0) and its gradients are zero, as
        torch's.

    Raises
    ------
    ValueError
        An unknown reduction, ``chunk_size < 1``, a 0-D ``hidden``, a ``weight`` that is not 2-D, a ``target``
        of another shape; the ops' own errors (dtypes, devices, ``d`` mismatch, the variant) name the op.

    Notes
    -----
    *Autograd.* When a gradient is needed, the forward computes the gradients of ``hidden``, ``weight`` and
    ``bias`` for the reduced loss and an upstream 1 (module docstring), and the backward only multiplies them,
    in place, by the upstream gradient (nothing to do where it is 1) and returns them: no ``(V, d)`` copy. So the
    backward can run once: a second one (``retain_graph=True``) raises autograd's "modified by an inplace
    operation". ``"none"`` keeps ``hidden``, ``weight``, ``bias`` and ``target`` and runs the chunks again in
    the backward (4 GEMMs in all instead of 3); it can run several times.

    *Memory* (T = 8192, V = 128256, d = 4096, bf16, the default chunk c = 1024; MiB = 2^20 bytes; the inputs
    hold 64 + 1002 MiB). ``F.linear`` + ``F.cross_entropy`` under autograd keep, at their backward's peak,
    log_softmax's saved output, nll_loss's gradient and log_softmax's gradient, three ``T V`` tensors:
    3 x 2004 = 6012 MiB beyond the inputs (7078 MiB with them; the forward's peak is 2 x 2004). This
    function: the weight's gradient ``V d`` = 1002 MiB (it is the returned gradient), ``d_hidden`` ``T d`` =
    64 MiB, one chunk's logits ``c V`` = 250.5 MiB, a chunk's ``d_hidden_c`` 8 MiB, ``db`` and the per-row
    losses (< 1 MiB): ~1325 MiB beyond the inputs, 0.22x torch's (0.34x counting the inputs, whose 1066 MiB
    plus the weight's gradient, 2068 MiB, both paths hold). ``accumulation_dtype=torch.float32`` adds
    2004 MiB (the float32 buffer, in place of the bf16 one) + 1002 MiB (a chunk's product); the gradient is
    a new 1002 MiB tensor at the backward. In general, beyond
    the inputs: torch ~ ``3 T V e``; this ~ ``V d e_w + T d e + c V e`` (``e``: bytes per element).

    *Speed.* The GEMM work is torch's (``6 T V d`` flops: logits, ``d_hidden``, ``dW``); the cross-entropy
    reads and writes each chunk's logits once (torch's eager path makes ~7 ``T V`` passes). The extra costs:
    ``T / c`` GEMMs of ``c`` rows instead of one of ``T`` (the ``dW`` products have inner size ``c`` and
    each reads and writes the ``V d`` sum), the in-place scaling of ``dW`` in the backward where the upstream
    gradient is not 1 (one read + write of ``V d``) and, for ``"none"``, the recomputed logits.

    *No host synchronisation; torch.compile.* The mean's denominator is a device tensor; the chunk loop
    depends on shapes only. Under ``torch.compile(fullgraph=True)`` the loop is unrolled (one pass of ops
    per chunk; static shapes); the ops have fake kernels.

    Examples
    --------
    >>> h = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> lm_head = torch.nn.Linear(4096, 128256, bias=False, device="cuda", dtype=torch.bfloat16)
    >>> t = torch.randint(0, 128256, (8192,), device="cuda")
    >>> optimized_ops.linear_cross_entropy(h, lm_head.weight, t).backward()
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"optimized_ops.linear_cross_entropy: reduction: expected one of {', '.join(_REDUCTIONS)}; "
                         f"given '{reduction}'")
    if hidden.dim() < 1:
        raise ValueError("optimized_ops.linear_cross_entropy: hidden: expected a tensor of at least 1 dimension "
                         "(..., d); given 0-D (a scalar)")
    if weight.dim() != 2:
        raise ValueError("optimized_ops.linear_cross_entropy: weight: expected a 2-D tensor (vocab V, d); given "
                         f"shape {list(weight.shape)}")
    if list(target.shape) != list(hidden.shape[:-1]):
        raise ValueError(f"optimized_ops.linear_cross_entropy: target: expected shape {list(hidden.shape[:-1])} "
                         f"(hidden.shape[:-1]); given {list(target.shape)}")
    rows = target.numel()
    if chunk_size is None:
        chunk_size = linear_cross_entropy_chunk_size(rows, weight.shape[0], hidden.dtype)
    elif not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"optimized_ops.linear_cross_entropy: chunk_size: expected an int >= 1 or None; "
                         f"given {chunk_size!r}")
    if accumulation_dtype not in (None, weight.dtype, torch.float32):
        raise ValueError(f"optimized_ops.linear_cross_entropy: accumulation_dtype: expected None, torch.float32 or "
                         f"the weight's dtype ({weight.dtype}); given {accumulation_dtype}")
    acc_dtype = weight.dtype if accumulation_dtype is None else accumulation_dtype
    args = (ignore_index, float(label_smoothing), float(z_loss), reduction, chunk_size, acc_dtype, variant)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        return _LinearCrossEntropy.apply(hidden, weight, bias, target, *args)
    h, t = _rows(hidden, target)
    config = _Config(*args)
    return _reduce(_chunks(h, weight, bias, t, config), t, hidden, target, config)


# ---- the chunk loop ------------------------------------------------------------------------------

class _Config:
    """The non-tensor arguments, as one object."""

    def __init__(self, ignore_index, label_smoothing, z_loss, reduction, chunk, acc_dtype, variant):
        self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
        self.reduction, self.chunk, self.acc_dtype, self.variant = reduction, chunk, acc_dtype, variant


def _rows(hidden: torch.Tensor, target: torch.Tensor):
    """hidden as (T, d) (a view where the strides allow it) and target as (T,)."""
    return hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)


class _Grads:
    """The gradients the chunks accumulate, for a unit upstream gradient of each row's loss (None: not
    needed): d_hidden (T, d) in hidden's dtype, row blocks written once; dW (V, d) in acc_dtype, summed
    over the chunks; db (V,) in float32 (float64 for float64), summed over the chunks."""

    def __init__(self, h, weight, bias, needs, acc_dtype):
        need_h, need_w, need_b = needs
        self.d_hidden = torch.empty_like(h, memory_format=torch.contiguous_format) if need_h else None
        self.d_weight = None
        if need_w:  # the first chunk overwrites a buffer of the operands' dtype; a wider one is summed into
            zeroed = acc_dtype != weight.dtype or h.shape[0] == 0
            new = torch.zeros if zeroed else torch.empty
            self.d_weight = new(weight.shape, dtype=acc_dtype, device=weight.device)
        self.d_bias = (torch.zeros(bias.shape, dtype=compute_dtype(bias), device=bias.device)
                       if need_b and bias is not None else None)

    def add_chunk(self, dlogits, h_c, weight, begin, end, first, variant):
        """Adds chunk [begin, end)'s contribution; dlogits (c, V): its rows' gradients (upstream applied)."""
        # dW in place by torch.addmm when the buffer has the operands' dtype; into a wider buffer, the chunk's
        # product comes from linear_backward (rounded once to the dtype) and is added to it.
        in_place = self.d_weight is not None and self.d_weight.dtype == dlogits.dtype
        mask = [self.d_hidden is not None, self.d_weight is not None and not in_place, self.d_bias is not None]
        if any(mask):
            d_h, d_w, d_b = _ops.linear_backward.default(dlogits, h_c, weight, None, None, activation="none",
                                                         output_mask=mask, variant=variant)
            if d_h is not None:
                self.d_hidden[begin:end].copy_(d_h)
            if d_w is not None:
                self.d_weight.add_(d_w)
            if d_b is not None:
                self.d_bias.add_(d_b)
        if in_place:
            # acc (+)= dlogits^T h_c, float32 accumulation inside the product, one rounding; the first chunk
            # overwrites (beta = 0 ignores what the buffer holds, NaN included).
            self.d_weight.addmm_(dlogits.mT, h_c, beta=0 if first else 1)


def _chunks(h, weight, bias, t, config: _Config, grads: Optional[_Grads] = None,
            row_scale: Optional[torch.Tensor] = None, grad_scale: Optional[torch.Tensor] = None
            ) -> Optional[torch.Tensor]:
    """Runs the chunks: the per-row losses (float32; float64 for float64) when ``row_scale`` is None, and the
    gradients into ``grads`` when given, each chunk's gradient rows multiplied by ``row_scale`` (T,) first
    when given (the backward of ``"none"``, which needs no losses: returns None), else by the 0-d
    ``grad_scale`` when given (the mean's 1 / count)."""
    rows = h.shape[0]
    losses = None if row_scale is not None else h.new_empty((rows,), dtype=compute_dtype(h))
    for begin in range(0, rows, config.chunk):
        end = min(begin + config.chunk, rows)
        h_c, t_c = h[begin:end], t[begin:end]
        logits, _ = _ops.linear_forward.default(h_c, weight, bias, activation="none", variant=config.variant)
        if grads is None:
            loss, _, _ = _ops.cross_entropy_fwd.default(logits, t_c, config.ignore_index, config.label_smoothing,
                                                        config.z_loss, False)
        else:
            # logits now hold the unit gradient, times row_scale's rows when given (in the same pass)
            loss, _ = _ops.cross_entropy_fwd_.default(logits, t_c, config.ignore_index, config.label_smoothing,
                                                      config.z_loss,
                                                      grad_scale if row_scale is None else row_scale[begin:end])
            grads.add_chunk(logits, h_c, weight, begin, end, begin == 0, config.variant)
        if losses is not None:
            losses[begin:end].copy_(loss)
        del logits  # before the next chunk's logits are allocated: one chunk alive at a time
    return losses


def _reduce(losses: torch.Tensor, t: torch.Tensor, hidden: torch.Tensor, target: torch.Tensor, config: _Config,
            count: Optional[torch.Tensor] = None):
    """The reduction of the per-row losses, in hidden's dtype: always a new tensor (copy=True), never ``losses``
    itself or a view of it -- an autograd.Function whose output aliases an intermediate (``.to`` of the same
    dtype returns its input) gets zero gradients under torch.compile (seen with torch 2.11, aot_eager)."""
    if config.reduction == "none":
        return losses.view(target.shape).to(hidden.dtype, copy=True)
    total = losses.sum()
    if config.reduction == "mean":
        # all rows ignored: 0 / 0 = NaN, as torch
        total = total / ((t != config.ignore_index).sum() if count is None else count)
    return total.to(hidden.dtype, copy=True)


# ---- autograd ------------------------------------------------------------------------------------

class _LinearCrossEntropy(torch.autograd.Function):
    """mean / sum: the forward accumulates the gradients for unit upstream gradients, the backward scales
    them in place. none: the forward computes the losses, the backward runs the chunks again."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, label_smoothing, z_loss, reduction, chunk, acc_dtype,
                variant):
        config = _Config(ignore_index, label_smoothing, z_loss, reduction, chunk, acc_dtype, variant)
        h, t = _rows(hidden, target)
        ctx.config, ctx.hidden_shape = config, hidden.shape
        ctx.set_materialize_grads(False)
        if config.reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, target)
            return _reduce(_chunks(h, weight, bias, t, config), t, hidden, target, config)
        grads = _Grads(h, weight, bias, ctx.needs_input_grad[:3], config.acc_dtype)
        count = (t != config.ignore_index).sum()
        # mean: 1 / count folded into the logits' gradient by the kernel (as torch scales before its GEMMs), so
        # that the backward of an upstream 1 touches nothing; all rows ignored: 1 / 0 = inf multiplies no row
        # (ignored rows are written as 0 unscaled): zero gradients, as torch
        grad_scale = torch.reciprocal(count.to(compute_dtype(h))) if config.reduction == "mean" else None
        losses = _chunks(h, weight, bias, t, config, grads, grad_scale=grad_scale)
        ctx.save_for_backward(grads.d_hidden, grads.d_weight, grads.d_bias, count)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _reduce(losses, t, hidden, target, config, count)

    @staticmethod
    def backward(ctx, grad_loss):
        if grad_loss is None:
            return (None,) * 11
        if ctx.config.reduction == "none":
            return _LinearCrossEntropy._recompute(ctx, grad_loss)
        d_hidden, d_weight, d_bias, count = ctx.saved_tensors
        # the stored gradients are those of the reduced loss (mean: 1 / count in them): scaled in place by the
        # upstream gradient, untouched where it is exactly 1 (cross_entropy_bwd_ reads it on the device)
        scale = grad_loss.to(compute_dtype(d_hidden, d_weight, d_bias))
        g_hidden = None
        if d_hidden is not None:
            _ops.cross_entropy_bwd_.default(d_hidden, scale)
            bump_version(d_hidden)  # a second backward would scale again: autograd's version check refuses it
            g_hidden = d_hidden.view(ctx.hidden_shape)
        g_weight = None
        if d_weight is not None:
            if d_weight.dtype == ctx.weight_dtype:
                _ops.cross_entropy_bwd_.default(d_weight, scale)
                bump_version(d_weight)
                g_weight = d_weight
            else:
                g_weight = torch.mul(d_weight, scale, out=torch.empty_like(d_weight, dtype=ctx.weight_dtype))
        g_bias = d_bias.mul_(scale).to(ctx.bias_dtype) if d_bias is not None else None
        return (g_hidden, g_weight, g_bias) + (None,) * 8

    @staticmethod
    def _recompute(ctx, grad_loss):
        """reduction="none": the chunks again, each chunk's unit gradients scaled by its rows' grad_loss."""
        hidden, weight, bias, target = ctx.saved_tensors
        h, t = _rows(hidden, target)
        grads = _Grads(h, weight, bias, ctx.needs_input_grad[:3], ctx.config.acc_dtype)
        _chunks(h, weight, bias, t, ctx.config, grads, row_scale=grad_loss.reshape(-1).to(compute_dtype(hidden)))
        g_weight = grads.d_weight
        if g_weight is not None and g_weight.dtype != weight.dtype:
            g_weight = g_weight.to(weight.dtype)
        g_bias = grads.d_bias.to(bias.dtype) if grads.d_bias is not None else None
        g_hidden = grads.d_hidden.view(hidden.shape) if grads.d_hidden is not None else None
        return (g_hidden, g_weight, g_bias) + (None,) * 8
