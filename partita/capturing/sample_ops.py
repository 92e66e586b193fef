"""The op tables ``partita.capturing.samples`` reads: which ops only move shapes, which are linear
in the batch, which reduce or mix along a dim, and which mix samples by their nature (attention,
recurrence, convolution windows, batch norm, ``arange`` over the batch, indexing)."""

from __future__ import annotations

import re

# Ops whose output only carries the shape of their input, and counting ops (tokens per expert: integer
# bookkeeping even when the result is a float tensor, as histc's is).
SHAPE_ONLY = {
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "randint_like",
    "scalar_tensor",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "sym_storage_offset",
    "_assert_tensor_metadata",
    "_assert_scalar",
    "_assert_async",
    "sym_constrain_range",
    "sym_constrain_range_for_size",
    "histc",
    "bincount",
    "histogram",
    "zeros",
    "ones",
    "empty",
    "full",
    "empty_strided",
    "rand",
    "randn",
    "randint",
    "lift_fresh_copy",
    "detach",
    "_functional_assert_async",
}
# What may be done to a floating-point sum or mean over the batch on its way to the loss.
LINEAR = {
    "add",
    "sub",
    "rsub",
    "mul",
    "div",
    "true_divide",
    "neg",
    "_to_copy",
    "to",
    "type_as",
    "clone",
    "alias",
    "view",
    "reshape",
    "_unsafe_view",
    "squeeze",
    "unsqueeze",
    "expand",
    "expand_as",
    "flatten",
    "copy",
    "contiguous",
    "where",
    "masked_fill",
    "clamp",
    "clamp_min",
    "clamp_max",
    "maximum",
    "minimum",
    "gt",
    "ge",
    "lt",
    "le",
    "eq",
    "ne",
    "fill",
    "nan_to_num",
    "sum",
    "mean",
    "permute",
    "transpose",
    "t",
    "select",
    "slice",
    "squeeze_copy",
    "view_copy",
    "dropout",
    "_unsafe_index",
    "index",
}
# Reductions over a dim: sums and means of per-sample terms are linear in the samples.
LINEAR_REDUCTIONS = {"sum", "mean", "nansum", "count_nonzero"}
NONLINEAR_REDUCTIONS = {
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "prod",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "logsumexp",
    "norm",
    "linalg_vector_norm",
    "any",
    "all",
    "median",
    "nanmedian",
    "mode",
    "aminmax",
    "nanmean",
}
ALONG_DIM = {
    "_softmax",
    "softmax",
    "_log_softmax",
    "log_softmax",
    "_safe_softmax",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "topk",
    "kthvalue",
}
CLASS_LOSSES = {
    "cross_entropy_loss",
    "nll_loss",
    "nll_loss_forward",
    "nll_loss2d",
    "nll_loss2d_forward",
    "nll_loss_nd",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "multilabel_margin_loss_forward",
}
ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable",
}
RECURRENT = {"lstm", "gru", "rnn_tanh", "rnn_relu"}
CONVOLUTION = re.compile(
    r"^(_?convolution|conv\d?d|conv_transpose\d?d|cudnn_convolution.*|mkldnn_convolution|"
    r"convolution_overrideable|_conv_depthwise2d|slow_conv.*|conv_tbc|miopen_convolution.*)$"
)
WINDOWED = re.compile(
    r"pool|upsample|interpolate|grid_sampler|im2col|col2im|pixel_(un)?shuffle|reflection_pad|"
    r"replication_pad|_upsample"
)
NORMALISED_TAIL = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}
BATCH_NORM = re.compile(r"batch_norm")
GROUP_NORM = {"group_norm", "native_group_norm"}
INSTANCE_NORM = {"instance_norm"}
ARANGE = {"arange", "linspace", "logspace", "randperm"}
# Ops that carry an arange over the batch along unchanged (views of it).
ARANGE_VIEWS = {
    "view",
    "reshape",
    "_unsafe_view",
    "unsqueeze",
    "squeeze",
    "expand",
    "expand_as",
    "_to_copy",
    "to",
    "clone",
    "alias",
    "contiguous",
    "lift_fresh_copy",
    "detach",
    "flatten",
    "permute",
    "transpose",
    "t",
    "slice",
}
INDEXING = {"index", "_unsafe_index", "index_put", "index_put_", "_unsafe_index_put", "_index_put_impl_"}
