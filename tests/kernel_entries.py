"""Python entry points, for the tests alone, of kernels that only other kernels call.

In a run these kernels are kernel_inner (hslm/jit.py): no Python entry point, whose
unboxing of the structs' arrays each cost its compile (cache_panels' alone 0.4 s on the
first-generation Zen). A test calls them through these, which compile in the tests."""
from hslm.jit import kernel_entry
from hslm.kernels import active_masks as _active_masks
from hslm.kernels import active_rows_grad as _active_rows_grad
from hslm.kernels import output_grad_panels as _output_grad_panels
from hslm.kernels import transpose_rows as _transpose_rows
from hslm.layers import attention_rows as _attention_rows
from hslm.layers import attention_rows_backward as _attention_rows_backward
from hslm.layers import backward_panels as _backward_panels
from hslm.layers import cache_panels as _cache_panels


@kernel_entry
def cache_panels(A, w, b, p0, p1, H, dh):
    _cache_panels(A, w, b, p0, p1, H, dh)


@kernel_entry
def backward_panels(A, w, b, p0, p1, H, dh, VC, KR):
    _backward_panels(A, w, b, p0, p1, H, dh, VC, KR)


@kernel_entry(allocates=True)
def attention_rows(Q, KC, VR, p0, p1, H, dh, scale, AP, O):
    _attention_rows(Q, KC, VR, p0, p1, H, dh, scale, AP, O)


@kernel_entry(allocates=True)
def attention_rows_backward(Q, VC, KR, AP, s, r0, r1, H, dh, scale, DO, DQ, DK, DV):
    _attention_rows_backward(Q, VC, KR, AP, s, r0, r1, H, dh, scale, DO, DQ, DK, DV)


@kernel_entry
def active_rows_grad(M, S, D, c0, c1, j0, j1, O, fresh):
    _active_rows_grad(M, S, D, c0, c1, j0, j1, O, fresh)


@kernel_entry
def active_masks(X, j0, j1, M):
    _active_masks(X, j0, j1, M)


@kernel_entry
def transpose_rows(T, G):
    _transpose_rows(T, G)


@kernel_entry(allocates=True)
def output_grad_panels(DY, PD):
    return _output_grad_panels(DY, PD)
